"""Tiny random transformers models of the supported architectures and the conversion round trip, shared by
``test_models_*.py``: build with transformers, perturb every parameter off its initial constant, ``save_pretrained``,
read the safetensors, convert with ``hp_megatron.models`` rules, run both sides in fp32."""
from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from helpers import use_transformers_torch_path

VOCAB, HIDDEN, SEQ, BATCH = 64, 32, 12, 2


@pytest.fixture(scope="module")
def single_rank():
    """A one-rank gloo group and megatron-core's parallel state (TP=PP=CP=EP=1), with the CPU shims."""
    from megatron.core import parallel_state

    from hp_megatron.platform import apply_cpu_shims

    created = False
    if not dist.is_initialized():
        store = tempfile.NamedTemporaryFile(delete=False)
        dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
        created = True
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    apply_cpu_shims(0)
    yield
    if created:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.models.qwen3_next import modeling_qwen3_next

    use_transformers_torch_path(modeling_qwen3_next)
    cfg = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, mlp_only_layers=[1], rms_norm_eps=1e-6,
        layer_types=["linear_attention", "linear_attention", "full_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    return Qwen3NextForCausalLM, cfg


def _deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=4,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=16,
        kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=64,
        rope_interleave=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0})
    return DeepseekV3ForCausalLM, cfg


def _kimi_linear():
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    from transformers.models.kimi_linear import modeling_kimi_linear

    use_transformers_torch_path(modeling_kimi_linear)
    cfg = KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
        routed_scaling_factor=2.0, q_lora_rank=None, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=6, rms_norm_eps=1e-5, pad_token_id=None, bos_token_id=None, eos_token_id=None, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        linear_attn_config={"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 4})
    return KimiLinearForCausalLM, cfg


ARCHITECTURES = {"qwen3_next": _qwen3_next, "deepseek_v3": _deepseek_v3, "kimi_linear": _kimi_linear}


@torch.no_grad()
def _perturb(model, seed):
    """Move every parameter and buffer off transformers' constant initialisations (zero-centred norms, zero
    routers, A_log / dt_bias), with router weights large enough that top-k choices are far from ties."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if not p.is_floating_point() or "inv_freq" in name or "original_inv_freq" in name:
            continue
        noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        if name.endswith("gate.weight") and p.shape[0] > 1:  # routers
            p.copy_(noise)
        elif "e_score_correction_bias" in name:
            p.copy_(0.3 * noise)
        elif "norm" in name:
            p.copy_(p + 0.1 * noise)
        elif name.endswith("A_log"):
            p.copy_(torch.rand(p.shape, generator=gen).mul(2.0).add(0.5).log())
        else:
            p.copy_(0.2 * noise if p.dim() < 2 else noise / p.shape[-1] ** 0.5)


def tiny_hf_model(arch: str, directory: str, seed: int = 0, save: bool = True):
    """(model, config.json as a dict): a tiny random transformers model of ``arch`` saved to ``directory``
    (``save=False``: (model, None), another process saves the same model there)."""
    cls, cfg = ARCHITECTURES[arch]()
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    _perturb(model, seed)
    if save:
        model.save_pretrained(directory)
        with open(os.path.join(directory, "config.json")) as f:
            return model, json.load(f)
    return model, None


def read_checkpoint(directory: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, "model.safetensors"))


def to_mcore(rules, hf_state: dict) -> dict:
    used = {k for r in rules for k in r.hf_keys}
    unused = sorted(set(hf_state) - used)
    assert not unused, f"HF tensors no rule reads: {unused[:8]}"
    return {r.mcore_key: r.to_mcore([hf_state[k] for k in r.hf_keys]) for r in rules}


def to_hf(rules, mcore_state: dict) -> dict:
    out = {}
    for r in rules:
        out.update(zip(r.hf_keys, r.to_hf(mcore_state[r.mcore_key])))
    return out


def token_batch(seed: int = 0):
    """(input ids [B, S], labels [B, S]: the next token, -100 at the last position)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def hf_logits_and_loss(model, ids):
    """transformers' logits [B, S, V] and mean next-token loss over positions 0..S-2 (it shifts the labels)."""
    out = model(input_ids=ids, labels=ids)
    return out.logits, out.loss


def mcore_logits_and_loss(model, ids, targets):
    """Our GPTModel's logits [B, S, V] and the mean loss over positions 0..S-2 (transformers' loss positions)."""
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    logits = model(ids, positions, None)
    per_token = model(ids, positions, None, labels=targets)
    return logits, per_token[:, :-1].mean()
