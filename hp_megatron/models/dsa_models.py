"""DeepSeek-V3.2 (``model_type: deepseek_v32``) and GLM-5 (``glm_moe_dsa``): DeepSeek-V3's model (MoE with the
sigmoid, grouped, expert-biased router, dense first layers, MTP layers for DeepSeek-V3.2) whose every attention layer
is DSA ("D", ``layers.mixers.mla.dsa.DSAttention``): MLA plus the lightning indexer's ``self_attn.indexer.{wq_b, wk,
k_norm, weights_proj}``.

The indexer fields: ``index_n_heads``, ``index_head_dim``, ``index_topk``; its k_norm eps is transformers' 1e-6; its
RoPE is half-split for DeepSeek-V3.2 and interleaved for GLM-5 (``dsa_indexer_rope_interleaved``); both score with
the ReLU (transformers'). GLM-5's ``indexer_types`` ("full" / "shared" per layer) must be megatron-core's schedule
(``dsa_indexer_topk_freq`` / ``dsa_indexer_skip_topk_offset``, which is how transformers builds it from
``index_topk_freq`` / ``index_skip_topk_offset``); another list is refused naming it.
"""
from __future__ import annotations

import hp_megatron.models.deepseek_v3 as deepseek_v3
from hp_megatron.convert.rules import identity_rule
from hp_megatron.models.common import ModelPreset, field_of, refuse
from hp_megatron.registry import register_conversion_rules

DEEPSEEK_V32, GLM_MOE_DSA = "deepseek_v32", "glm_moe_dsa"
INDEXER_NAMES = {"wq_b.weight": "linear_wq_b.weight", "wk.weight": "linear_wk.weight", "k_norm.weight": "k_norm.weight",
                 "k_norm.bias": "k_norm.bias", "weights_proj.weight": "linear_weights_proj.weight"}


def topk_schedule(model_type: str, indexer_types: list) -> tuple:
    """``(dsa_indexer_topk_freq, dsa_indexer_skip_topk_offset)`` reproducing ``indexer_types``; ValueError when none
    of megatron-core's schedules does."""
    from layers.mixers.mla.dsa import is_skip_topk_layer

    n = len(indexer_types)
    if set(indexer_types) - {"full", "shared"}:
        refuse(model_type, "indexer_types", indexer_types, "'full' / 'shared' per layer")
    if all(t == "full" for t in indexer_types):
        return 1, 0
    for freq in range(2, n + 1):
        for offset in range(0, n + 1):
            if all((t == "shared") == is_skip_topk_layer(i + 1, offset, freq) for i, t in enumerate(indexer_types)):
                return freq, offset
    refuse(model_type, "indexer_types", indexer_types, "a schedule of megatron-core's dsa_indexer_topk_freq / "
           "dsa_indexer_skip_topk_offset")


def _preset(hf: dict, model_type: str) -> ModelPreset:
    preset = deepseek_v3.megatron_config(hf, model_type=model_type, symbol="D")
    layers = field_of(hf, model_type, "num_hidden_layers")
    mlp_types = ["sparse" if moe else "dense" for moe in deepseek_v3.moe_layers(hf)]
    if hf.get("mlp_layer_types") not in (None, mlp_types):
        refuse(model_type, "mlp_layer_types", hf["mlp_layer_types"], f"{mlp_types} (from first_k_dense_replace)")
    freq, offset = topk_schedule(model_type, hf.get("indexer_types") or ["full"] * layers)
    preset.mixer_fields.update(
        dsa_indexer_n_heads=field_of(hf, model_type, "index_n_heads"),
        dsa_indexer_head_dim=field_of(hf, model_type, "index_head_dim"),
        dsa_indexer_topk=field_of(hf, model_type, "index_topk"), dsa_indexer_topk_freq=freq,
        dsa_indexer_skip_topk_offset=offset, dsa_indexer_rope_interleaved=model_type == GLM_MOE_DSA,
        dsa_indexer_k_norm_epsilon=1e-6)
    return preset


def deepseek_v32_config(hf: dict) -> ModelPreset:
    return _preset(hf, DEEPSEEK_V32)


def glm_moe_dsa_config(hf: dict) -> ModelPreset:
    return _preset(hf, GLM_MOE_DSA)


def dsa_layer_rules(mcore: str, hf_layer: str, hf: dict, preset: ModelPreset) -> list:
    """The ``D`` mixer's rules: DeepSeek-V3's MLA rules (the attention always rotates interleaved pairs) and, on layers
    that run an indexer, its tensors one to one."""
    rules = deepseek_v3.mla_layer_rules(mcore, hf_layer, {**hf, "rope_interleave": True}, preset)
    number = int(mcore.rstrip(".").split(".")[-2]) + 1 if mcore.startswith("decoder.layers.") else None
    from layers.mixers.mla.dsa import is_skip_topk_layer

    fields = preset.mixer_fields
    freq, offset = fields["dsa_indexer_topk_freq"], fields["dsa_indexer_skip_topk_offset"]
    if number is not None and freq > 1 and is_skip_topk_layer(number, offset, freq):
        return rules
    return rules + [identity_rule(f"{mcore}indexer.{ours}", f"{hf_layer}self_attn.indexer.{name}")
                    for name, ours in INDEXER_NAMES.items()]


def deepseek_v32_rules(hf: dict, mtp_num_layers: int = 0) -> list:
    return deepseek_v3.conversion_rules(hf, mtp_num_layers, preset=deepseek_v32_config(hf))


def glm_moe_dsa_rules(hf: dict) -> list:
    return deepseek_v3.conversion_rules(hf, preset=glm_moe_dsa_config(hf))


register_conversion_rules(DEEPSEEK_V32, "D", dsa_layer_rules)
register_conversion_rules(GLM_MOE_DSA, "D", dsa_layer_rules)
