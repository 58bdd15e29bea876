"""Tiny random transformers models of the supported architectures (``qwen3_next``, ``deepseek_v3``,
``kimi_linear``): small configs with routed and shared experts, dense and MoE layers and mixed layer types, for
tests and for trying the HF -> megatron-core -> training path (``examples/pretrain/tiny_hf_checkpoint.py``)."""
from __future__ import annotations

import torch

TINY_VOCAB, TINY_HIDDEN = 64, 32
HF_EXTRA = "pip install -e .[hf] (in a checkout) or pip install 'hp-megatron[hf]'"


def import_transformers():
    """The ``transformers`` module; RuntimeError naming the install command when it is missing (the ``[hf]``
    extra: the converter does not need it, the tiny models do)."""
    try:
        import transformers
    except ImportError as err:
        raise RuntimeError(f"the tiny Hugging Face models need transformers, which is not installed: "
                           f"{HF_EXTRA}") from err
    return transformers


def _qwen3_next(vocab_size: int):
    transformers = import_transformers()
    cfg = transformers.Qwen3NextConfig(
        vocab_size=vocab_size, hidden_size=TINY_HIDDEN, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24, mlp_only_layers=[1], rms_norm_eps=1e-6,
        layer_types=["linear_attention", "linear_attention", "full_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    return transformers.Qwen3NextForCausalLM, cfg


def _deepseek_v3(vocab_size: int):
    transformers = import_transformers()
    cfg = transformers.DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=TINY_HIDDEN, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
        q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        max_position_embeddings=64, rope_interleave=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0})
    return transformers.DeepseekV3ForCausalLM, cfg


def _kimi_linear(vocab_size: int):
    transformers = import_transformers()
    cfg = transformers.KimiLinearConfig(
        vocab_size=vocab_size, hidden_size=TINY_HIDDEN, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_token=2,
        num_shared_experts=1, routed_scaling_factor=2.0, q_lora_rank=None, kv_lora_rank=12, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=6, rms_norm_eps=1e-5, pad_token_id=None, bos_token_id=None,
        eos_token_id=None, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        linear_attn_config={"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 4})
    return transformers.KimiLinearForCausalLM, cfg


TINY_ARCHITECTURES = {"qwen3_next": _qwen3_next, "deepseek_v3": _deepseek_v3, "kimi_linear": _kimi_linear}


def tiny_hf_config(arch: str, vocab_size: int = TINY_VOCAB):
    """(transformers CausalLM class, its tiny config) of ``arch``; ValueError naming the supported ones."""
    if arch not in TINY_ARCHITECTURES:
        raise ValueError(f"no tiny config for {arch!r}; supported: {sorted(TINY_ARCHITECTURES)}")
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
    return TINY_ARCHITECTURES[arch](vocab_size)


@torch.no_grad()
def perturb_parameters(model, seed: int) -> None:
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


def build_tiny_hf_model(arch: str, seed: int = 0, vocab_size: int = TINY_VOCAB):
    """A tiny random fp32 transformers model of ``arch`` (eager attention, eval mode, every parameter perturbed)."""
    cls, cfg = tiny_hf_config(arch, vocab_size)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    perturb_parameters(model, seed)
    return model
