"""Qwen3.5 (dense ``qwen3_5_text`` e.g. Qwen3.5-27B, MoE ``qwen3_5_moe_text`` e.g. Qwen3.5-35B-A3B) and the released
vision-language checkpoints of both (``qwen3_5`` / ``qwen3_5_moe``): the Qwen3-Next decoder
(``hp_megatron.models.qwen3_next.hybrid_preset``: GDN "G" and output-gated attention "A", zero-centred norms,
MoE with a gated shared expert) with two differences:

* GDN in-projections stored separately: ``in_proj_qkv`` (rows q | k | v, all heads of one kind together),
  ``in_proj_z``, ``in_proj_b``, ``in_proj_a``. Our GDN's ``in_proj`` holds the parts (q, k, v, z, beta, alpha) in
  that order, so its weight is the four tensors concatenated (Qwen3-Next's per-key-head grouping is not there).
* RoPE is Qwen3-VL's mRoPE (``mrope_section``, ``mrope_interleaved``) over the first ``partial_rotary_factor`` of
  each head. For text tokens the three position axes (time, height, width) are equal, so each frequency's angle is
  ``position * inv_freq`` whichever axis it is taken from: megatron's partial RoPE (``rotary_percent``) exactly.
  Position ids whose axes differ (image / video tokens) have no counterpart: :func:`text_position_ids` refuses them
  and the models built from these presets check the position ids they are given (``ModelPreset.position_ids_map``).

Every MoE layer routes (no ``decoder_sparse_step`` / ``mlp_only_layers``) with softmax top-k renormalised
(``Qwen3VLMoeTextTopKRouter``). The VL checkpoints hold the language model under ``model.language_model.*``,
``lm_head`` at the top, the vision tower under ``model.visual.*`` (unmodeled: dropped only with
``--drop-unmodeled``; the VL config.json's ``text_config`` is the language model's) and, like Qwen3-Next's, one
multi-token-prediction module ``mtp.*`` (``mtp_num_hidden_layers`` in the text config), converted with
``--mtp-num-layers 1`` into megatron-core's ``mtp.layers.0.*``.
"""
from __future__ import annotations

import torch

import hp_megatron.models.qwen3_next as qwen3_next
from hp_megatron.convert.rules import TensorRule, identity_rule
from hp_megatron.models.common import ModelPreset, refuse, require, rope_parameters
from hp_megatron.registry import register_conversion_rules

TEXT, MOE_TEXT, VL, MOE_VL = "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe"
MODEL_TYPES = (TEXT, MOE_TEXT, VL, MOE_VL)
VL_TEXT_MODEL_TYPE = {VL: TEXT, MOE_VL: MOE_TEXT}    # a VL checkpoint's text_config.model_type
LANGUAGE_MODEL = "model.language_model."               # the VL checkpoints' prefix of the language model's ``model.``
ROPE_KEYS = {"rope_type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}
GDN_IN_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")   # our in_proj rows: [q; k; v] | z | beta | alpha


def text_config(hf: dict) -> dict:
    """The language model's config of a Qwen3.5 ``config.json``: itself for the text model types; for VL, its
    ``text_config`` with the top-level ``tie_word_embeddings`` (the one transformers' VL class ties by)."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        refuse("qwen3_5", "model_type", model_type, list(MODEL_TYPES))
    if model_type not in VL_TEXT_MODEL_TYPE:
        return hf
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{model_type} config.json lacks the field 'text_config' (the language model's config)")
    require(text, model_type, "text_config.model_type", (VL_TEXT_MODEL_TYPE[model_type],),
            text.get("model_type", VL_TEXT_MODEL_TYPE[model_type]))
    tied = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return {**text, "tie_word_embeddings": tied}


def text_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Text position ids ``[b, s]`` from position ids ``[b, s]`` or mRoPE ones ``[3, b, s]`` (time, height, width;
    transformers also passes ``[4, b, s]`` with the text positions first) whose axes are all equal; ValueError for
    multimodal position ids (axes differ: image / video tokens, which need the vision path)."""
    if position_ids is None or position_ids.dim() == 2:
        return position_ids
    if position_ids.dim() != 3 or position_ids.shape[0] not in (3, 4):
        raise ValueError(f"Qwen3.5 position ids must be [b, s] or mRoPE [3, b, s], got shape "
                         f"{tuple(position_ids.shape)}")
    if not bool((position_ids == position_ids[:1]).all()):
        raise ValueError("Qwen3.5 multimodal mRoPE position ids (axes differ: image / video tokens) are not supported; "
                         "only text positions (all axes equal) until a vision path exists")
    return position_ids[0]


def _rope(hf: dict, model_type: str) -> dict:
    rope = rope_parameters(hf)
    unknown = sorted(set(rope) - ROPE_KEYS)
    if unknown:
        refuse(model_type, "rope_parameters", {k: rope[k] for k in unknown}, sorted(ROPE_KEYS))
    return rope


def megatron_config(hf: dict) -> ModelPreset:
    """The megatron-core model of a Qwen3.5 ``config.json`` (text or VL; for VL: its language model)."""
    model_type = hf.get("model_type")
    text = text_config(hf)
    if model_type in (TEXT, VL) and text.get("num_experts"):
        refuse(model_type, "num_experts", text["num_experts"], "absent (the dense model; MoE is qwen3_5_moe_text)")
    if model_type in (MOE_TEXT, MOE_VL) and "intermediate_size" not in text:
        # every layer is MoE: megatron's dense ffn_hidden_size is unused; the experts' size stands in for it
        text = {**text, "intermediate_size": text.get("moe_intermediate_size")}
    preset = qwen3_next.hybrid_preset(text, model_type, _rope(text, model_type))
    if model_type in (MOE_TEXT, MOE_VL) and not preset.transformer_fields.get("num_moe_experts"):
        raise ValueError(f"{model_type} config.json lacks the field 'num_experts' (> 0)")
    preset.position_ids_map = text_position_ids
    return preset


def _in_proj_rule(mcore_key: str, hf: str, dims: dict) -> TensorRule:
    H, HV, K, V = dims["num_key_heads"], dims["num_value_heads"], dims["key_head_dim"], dims["value_head_dim"]
    sizes = (2 * H * K + HV * V, HV * V, HV, HV)
    return TensorRule(mcore_key, tuple(f"{hf}{name}.weight" for name in GDN_IN_PROJ),
                      lambda ts: torch.cat(list(ts), 0), lambda t: t.split(list(sizes), 0))


def gdn_layer_rules(mcore: str, hf_layer: str, hf: dict, preset: ModelPreset) -> list[TensorRule]:
    """The ``G`` mixer's rules: Qwen3.5's ``linear_attn`` (separate in-projections; conv over [q; k; v] channels)."""
    hf_mixer = hf_layer + "linear_attn."
    dims = qwen3_next.gdn_dims(hf, preset.model_type)   # hf: the text config (qwen3_next.hybrid_rules)
    qwen3_next.gdn_head_groups(**dims)
    return [_in_proj_rule(mcore + "in_proj.weight", hf_mixer, dims),
            identity_rule(mcore + "conv1d.weight", hf_mixer + "conv1d.weight"),
            identity_rule(mcore + "A_log", hf_mixer + "A_log"),
            identity_rule(mcore + "dt_bias", hf_mixer + "dt_bias"),
            identity_rule(mcore + "out_norm.weight", hf_mixer + "norm.weight"),
            identity_rule(mcore + "out_proj.weight", hf_mixer + "out_proj.weight")]


def _under_language_model(rule: TensorRule) -> TensorRule:
    keys = tuple(LANGUAGE_MODEL + k[len("model."):] if k.startswith("model.") else k for k in rule.hf_keys)
    return TensorRule(rule.mcore_key, keys, rule.to_mcore, rule.to_hf)


def conversion_rules(hf: dict, mtp_num_layers: int = 0) -> list[TensorRule]:
    """One rule per megatron-core tensor of :func:`megatron_config`'s model with ``mtp_num_layers`` MTP layers (0 or
    the text config's ``mtp_num_hidden_layers``); VL: the language model's keys under ``model.language_model.``."""
    preset = megatron_config(hf)
    rules = qwen3_next.hybrid_rules(text_config(hf), preset, mtp_num_layers)
    if hf["model_type"] in VL_TEXT_MODEL_TYPE:
        rules = [_under_language_model(r) for r in rules]
    return rules


def unmodeled_tensors(hf: dict) -> dict:
    """``{HF key prefix: what it holds}``: the released checkpoints' MTP module (and the VL ones' vision tower)."""
    return {"mtp.": "Qwen3.5 multi-token-prediction module (mtp.*)", **unmodeled_with_mtp(hf)}


def unmodeled_with_mtp(hf: dict) -> dict:
    """The parts still unmodeled when the MTP layers are converted: the VL checkpoints' vision tower."""
    if hf.get("model_type") in VL_TEXT_MODEL_TYPE:
        return {"model.visual.": "Qwen3.5 vision tower (model.visual.*; no vision path in the megatron model)"}
    return {}


for _model_type in MODEL_TYPES:   # the mixers' rules per architecture (hp_megatron.registry.conversion_rules_of)
    register_conversion_rules(_model_type, "A", qwen3_next.attention_layer_rules)
    register_conversion_rules(_model_type, "G", gdn_layer_rules)
