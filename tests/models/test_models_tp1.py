"""Real architectures on one rank (TP=PP=EP=CP=1, fp32): a tiny random transformers model (Qwen3-Next, DeepSeek-V3,
Kimi Linear, dense Qwen3.5 and the Qwen3.5-MoE VL checkpoint's language model: routed and shared experts, mixed
layer types, dense layers), saved with ``save_pretrained``, converted
with ``hp_megatron.models`` rules and loaded into megatron-core's GPTModel with our specs gives transformers'
logits, loss and gradients; converted back, transformers loads it and gives the original logits."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

from tests.support.models_case import (hf_logits_and_loss, mcore_logits_and_loss, read_safetensors, tiny_hf_model,
                                       to_hf, to_mcore, token_batch)
from tests.support.reference import rel_err

TOL = 1e-4


def _ours(hf_config, hf_state):
    from hp_megatron.models import conversion_rules_from_hf, preset_from_hf, preset_gpt_model, preset_transformer_config

    preset = preset_from_hf(hf_config)
    config = preset_transformer_config(preset, use_cpu_initialization=True, params_dtype=torch.float32,
                                       gradient_accumulation_fusion=False, bias_dropout_fusion=False)
    model = preset_gpt_model(preset, config, max_sequence_length=64)
    rules = conversion_rules_from_hf(hf_config)
    model.load_state_dict(to_mcore(rules, hf_state), strict=True)
    return model, rules


# (HF parameter, its mcore counterpart) whose gradients are compared, per architecture: an expert, a router,
# a mixer projection, norms. HF experts are fused in memory (``experts.down_proj [E, h, I]``): index e.
GRADS = {
    "qwen3_next": [("model.layers.0.mlp.experts.down_proj", 1,
                    "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"),
                   ("model.layers.2.mlp.gate.weight", None, "decoder.layers.2.mlp.router.weight"),
                   ("model.layers.0.linear_attn.out_proj.weight", None,
                    "decoder.layers.0.self_attention.out_proj.weight"),
                   ("model.layers.2.self_attn.q_norm.weight", None,
                    "decoder.layers.2.self_attention.q_layernorm.weight"),
                   ("model.layers.1.input_layernorm.weight", None, "decoder.layers.1.input_layernorm.weight"),
                   ("model.layers.0.mlp.shared_expert_gate.weight", None,
                    "decoder.layers.0.mlp.shared_experts.gate_weight")],
    "deepseek_v3": [("model.layers.1.mlp.experts.down_proj", 3,
                     "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"),
                    ("model.layers.3.mlp.gate.weight", None, "decoder.layers.3.mlp.router.weight"),
                    ("model.layers.0.self_attn.kv_b_proj.weight", None,
                     "decoder.layers.0.self_attention.linear_kv_up_proj.weight"),
                    ("model.layers.2.self_attn.q_a_layernorm.weight", None,
                     "decoder.layers.2.self_attention.q_layernorm.weight"),
                    ("model.layers.0.mlp.down_proj.weight", None, "decoder.layers.0.mlp.linear_fc2.weight"),
                    ("model.norm.weight", None, "decoder.final_layernorm.weight")],
    "kimi_linear": [("model.layers.2.mlp.experts.down_proj", 0,
                     "decoder.layers.2.mlp.experts.local_experts.0.linear_fc2.weight"),
                    ("model.layers.1.mlp.gate.weight", None, "decoder.layers.1.mlp.router.weight"),
                    ("model.layers.0.self_attn.forget_gate.f_b_proj.weight", None,
                     "decoder.layers.0.self_attention.forget_gate_up_proj.weight"),
                    ("model.layers.3.self_attn.o_norm.weight", None, "decoder.layers.3.self_attention.out_norm.weight"),
                    ("model.layers.2.self_attn.kv_b_proj.weight", None,
                     "decoder.layers.2.self_attention.linear_kv_up_proj.weight"),
                    ("model.layers.2.self_attn.kv_a_layernorm.weight", None,
                     "decoder.layers.2.self_attention.kv_layernorm.weight")],
    "qwen3_5_text": [("model.layers.1.linear_attn.in_proj_qkv.weight", None, None),
                     ("model.layers.3.self_attn.q_norm.weight", None,
                      "decoder.layers.3.self_attention.q_layernorm.weight"),
                     ("model.layers.0.mlp.down_proj.weight", None, "decoder.layers.0.mlp.linear_fc2.weight"),
                     ("model.layers.0.linear_attn.norm.weight", None,
                      "decoder.layers.0.self_attention.out_norm.weight")],
    "qwen3_5_moe": [("model.language_model.layers.1.mlp.experts.down_proj", 2,
                     "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"),
                    ("model.language_model.layers.3.mlp.gate.weight", None, "decoder.layers.3.mlp.router.weight"),
                    ("model.language_model.layers.0.linear_attn.A_log", None, "decoder.layers.0.self_attention.A_log"),
                    ("model.language_model.layers.2.mlp.shared_expert_gate.weight", None,
                     "decoder.layers.2.mlp.shared_experts.gate_weight")],
    "olmo_hybrid": [("model.layers.1.self_attn.q_norm.weight", None,
                     "decoder.layers.1.self_attention.q_layernorm.weight"),
                    ("model.layers.3.self_attn.k_norm.weight", None,
                     "decoder.layers.3.self_attention.k_layernorm.weight"),
                    ("model.layers.1.post_attention_layernorm.weight", None,
                     "decoder.layers.1.self_attention.post_norm.weight"),
                    ("model.layers.3.post_feedforward_layernorm.weight", None, "decoder.layers.3.mlp.post_norm.weight"),
                    ("model.layers.0.linear_attn.A_log", None, "decoder.layers.0.self_attention.A_log")],
    "bailing_hybrid": [("model.layers.1.mlp.experts.down_proj", 2,
                        "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"),
                       ("model.layers.3.mlp.gate.weight", None, "decoder.layers.3.mlp.router.weight"),
                       ("model.layers.1.self_attn.g_proj.weight", None,
                        "decoder.layers.1.self_attention.linear_gate_proj.weight"),
                       ("model.layers.2.self_attn.forget_gate.dt_bias", None,
                        "decoder.layers.2.self_attention.dt_bias"),
                       ("model.layers.3.mlp.shared_experts.down_proj.weight", None,
                        "decoder.layers.3.mlp.shared_experts.linear_fc2.weight"),
                       ("model.layers.0.self_attn.o_norm.weight", None,
                        "decoder.layers.0.self_attention.out_norm.weight")],
}
VISION = "model.visual."   # a VL checkpoint's vision tower: no rule reads it


@pytest.mark.parametrize("arch", ["qwen3_next", "deepseek_v3", "kimi_linear", "qwen3_5_text", "qwen3_5_moe",
                                  "olmo_hybrid", "bailing_hybrid"])
def test_matches_transformers_and_round_trips(single_rank, arch):
    with tempfile.TemporaryDirectory() as directory:
        hf_model, hf_config = tiny_hf_model(arch, directory)
        hf_state = {k: v for k, v in read_safetensors(directory).items() if not k.startswith(VISION)}
    model, rules = _ours(hf_config, hf_state)
    ids, targets = token_batch()

    ref_logits, ref_loss = hf_logits_and_loss(hf_model, ids)
    logits, loss = mcore_logits_and_loss(model, ids, targets)
    assert rel_err(logits, ref_logits) <= TOL
    assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item())

    ref_loss.backward()
    loss.backward()
    hf_params, ours = dict(hf_model.named_parameters()), dict(model.named_parameters())
    for hf_name, expert, mcore_name in GRADS[arch]:
        if mcore_name is None:   # part of a fused projection: checked through its rule below
            continue
        ref = hf_params[hf_name].grad
        ref = ref[expert] if expert is not None else ref
        assert rel_err(ours[mcore_name].grad, ref) <= TOL, mcore_name
    # a fused projection through its rule: the rule is a permutation, so it maps gradients too
    fused = {r.mcore_key: r for r in rules if len(r.hf_keys) > 1 and "self_attention" in r.mcore_key
             and all(k in hf_params for k in r.hf_keys)}  # transformers' in-memory names are the checkpoint's
    assert arch in ("deepseek_v3", "bailing_hybrid") or fused  # Ling: checkpoint names differ from in-memory ones
    for key, rule in list(fused.items())[:2]:
        ref = rule.to_mcore([hf_params[k].grad for k in rule.hf_keys])
        assert rel_err(ours[key].grad, ref) <= TOL, key

    # back to HF: bit-exact tensors, and transformers loads them and gives the original logits
    state = model.state_dict()
    exported = to_hf(rules, {r.mcore_key: state[r.mcore_key].detach() for r in rules})
    assert set(exported) == set(hf_state)
    assert all(torch.equal(exported[k], hf_state[k]) for k in hf_state)
    vision = {k: v.detach() for k, v in hf_model.state_dict().items() if k.startswith(VISION)}   # VL: not ours
    with tempfile.TemporaryDirectory() as directory:
        from safetensors.torch import save_file

        hf_model.config.save_pretrained(directory)
        save_file({k: v.contiguous() for k, v in {**exported, **vision}.items()},
                  os.path.join(directory, "model.safetensors"))
        reloaded = type(hf_model).from_pretrained(directory, attn_implementation="eager").float().eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, hf_model(input_ids=ids).logits)
