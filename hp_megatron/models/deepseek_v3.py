"""DeepSeek-V3 (``model_type: deepseek_v3``): MLA ("M") in every layer (YaRN or plain RoPE), the first
``first_k_dense_replace`` layers dense, MoE after them: sigmoid router with expert bias (``e_score_correction_bias``),
grouped top-k (``n_group`` / ``topk_group``), ``routed_scaling_factor``, ``n_shared_experts`` shared experts.

Multi-token-prediction layers (``num_nextn_predict_layers``, checkpoint keys ``model.layers.<num_hidden_layers +
k>.``: ``enorm``, ``hnorm``, ``eh_proj``, an MLA + MoE decoder layer, ``shared_head.norm``) are not part of
transformers' forward pass (its ``MtpModel`` loads them for drafting). Built with MTP (``conversion_rules(hf,
mtp_num_layers)``, the converter's ``--mtp-num-layers``) they are megatron-core's ``mtp.layers.<k>.*``; the
layers' ``embed_tokens`` / ``shared_head.head`` are copies of the model's embedding / head in the released
checkpoint (transformers' ``MtpModel`` ignores them too): the conversion checks them equal and writes them back as
copies. Without MTP, ``unmodeled_tensors`` lists them and the converter drops them only when asked
(``--drop-unmodeled``).
"""
from __future__ import annotations

from hp_megatron.convert.rules import TensorRule
from hp_megatron.registry import conversion_rules_of, register_conversion_rules
from hp_megatron.models.common import (ModelPreset, check_mtp_depth, decoder_config, field_of, layer_prefix,
                                       mla_fields, mla_rules, mlp_rules, model_rules, moe_router_config, moe_rules,
                                       mtp_head_rules, mtp_layer_prefix, norm_rules, refuse, require, rope_parameters,
                                       with_duplicates)

MODEL_TYPE = "deepseek_v3"
MTP_FIELD = "num_nextn_predict_layers"


def unmodeled_tensors(hf: dict) -> dict:
    """``{HF key prefix: what it holds}`` of the multi-token-prediction layers (``num_nextn_predict_layers``)."""
    layers = field_of(hf, hf.get("model_type", MODEL_TYPE), "num_hidden_layers")
    mtp = mtp_depth(hf)
    return {f"model.layers.{layers + i}.": f"DeepSeek-V3 multi-token-prediction layer {i} "
            f"(num_nextn_predict_layers={mtp})" for i in range(mtp)}


def mtp_depth(hf: dict) -> int:
    """The multi-token-prediction layers config.json declares (``num_nextn_predict_layers``; 0 when absent)."""
    return hf.get(MTP_FIELD) or 0


def moe_layers(hf: dict) -> list:
    first_dense = hf.get("first_k_dense_replace", 0)
    return [i >= first_dense for i in range(field_of(hf, hf.get("model_type", MODEL_TYPE), "num_hidden_layers"))]


def megatron_config(hf: dict, *, model_type: str = MODEL_TYPE, symbol: str = "M") -> ModelPreset:
    """The megatron-core model of a DeepSeek-V3 ``config.json`` (a dict); ``model_type`` / ``symbol``: a
    DeepSeek-V3-shaped architecture whose attention layers are another mixer (DeepSeek-V3.2, GLM-5: ``D``)."""
    require(hf, model_type, "model_type", (model_type,))
    require(hf, model_type, "attention_bias", (False,), False)
    require(hf, model_type, "attention_dropout", (0, 0.0), 0.0)
    require(hf, model_type, "pretraining_tp", (1,), 1)
    require(hf, model_type, "scoring_func", ("sigmoid",), "sigmoid")
    require(hf, model_type, "topk_method", ("noaux_tc",), "noaux_tc")
    require(hf, model_type, "output_router_logits", (False,), False)
    rope = rope_parameters(hf)
    rope_type = {"default": "rope", "yarn": "yarn"}.get(rope["rope_type"])
    if rope_type is None:
        refuse(model_type, "rope_parameters.rope_type", rope["rope_type"], ["default", "yarn"])
    flags = moe_layers(hf)
    config = decoder_config(hf, model_type, 1e-6)
    if any(flags):
        experts = field_of(hf, model_type, "n_routed_experts")
        config.update(moe_router_config(model_type, num_experts=experts,
                                        topk=field_of(hf, model_type, "num_experts_per_tok"),
                                        norm_topk_prob=hf.get("norm_topk_prob", True), score_function="sigmoid",
                                        scaling_factor=hf.get("routed_scaling_factor"), expert_bias=True,
                                        num_groups=hf.get("n_group"), group_topk=hf.get("topk_group")),
                      moe_layer_freq=[int(f) for f in flags],
                      moe_ffn_hidden_size=field_of(hf, model_type, "moe_intermediate_size"))
        shared = hf.get("n_shared_experts") or 0
        if shared:
            config["moe_shared_expert_intermediate_size"] = shared * hf["moe_intermediate_size"]
    mixer = mla_fields(hf, model_type, rope_type, rope)
    mixer["hp_mtp_layer_symbol"] = symbol
    gpt = dict(vocab_size=field_of(hf, model_type, "vocab_size"), position_embedding_type="none",
               share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)))
    return ModelPreset(model_type, symbol * hf["num_hidden_layers"], transformer_fields=config, mixer_fields=mixer,
                       gpt_model_kwargs=gpt, mtp_symbol=symbol, mtp_num_layers=mtp_depth(hf))


def mla_layer_rules(mcore: str, hf_layer: str, hf: dict, preset: ModelPreset) -> list[TensorRule]:
    """The ``M`` mixer's rules (registered in ``hp_megatron.registry.mla``): DeepSeek-V3's ``self_attn``."""
    return mla_rules(mcore, hf_layer + "self_attn.", preset.mixer_fields,
                     preset.transformer_fields["num_attention_heads"], rope_interleave=hf.get("rope_interleave", True))


def _decoder_layer_rules(mcore: str, hf_prefix: str, hf: dict, preset: ModelPreset, is_moe: bool) -> list[TensorRule]:
    rules = conversion_rules_of(preset.model_type, preset.pattern[0])(mcore + "self_attention.", hf_prefix, hf, preset)
    rules += norm_rules(mcore, hf_prefix)
    if not is_moe:
        return rules + mlp_rules(mcore + "mlp.", hf_prefix + "mlp.")
    shared = "shared_experts." if hf.get("n_shared_experts") else None
    return rules + moe_rules(mcore + "mlp.", hf_prefix + "mlp.", hf.get("n_routed_experts", 0), router="gate.weight",
                             expert_bias="gate.e_score_correction_bias", shared=shared)


def conversion_rules(hf: dict, mtp_num_layers: int = 0, *, preset: ModelPreset | None = None) -> list[TensorRule]:
    """One rule per megatron-core tensor of the model of :func:`megatron_config` (or ``preset``, a DeepSeek-V3-shaped
    architecture's), with ``mtp_num_layers`` MTP layers (0 or config.json's ``num_nextn_predict_layers``)."""
    preset = megatron_config(hf) if preset is None else preset
    rules = model_rules(preset.gpt_model_kwargs["share_embeddings_and_output_weights"])
    for i, is_moe in enumerate(moe_layers(hf)):
        rules += _decoder_layer_rules(layer_prefix(i), f"model.layers.{i}.", hf, preset, is_moe)
    if not mtp_num_layers:
        return rules
    check_mtp_depth(preset.model_type, MTP_FIELD, mtp_depth(hf), mtp_num_layers)
    hf_layers = [f"model.layers.{hf['num_hidden_layers'] + k}." for k in range(mtp_num_layers)]
    # the MTP layers' embedding and head copies ride on the model's (the head is the embedding when tied)
    tied = preset.gpt_model_kwargs["share_embeddings_and_output_weights"]
    embeds = [p + "embed_tokens.weight" for p in hf_layers]
    heads = [p + "shared_head.head.weight" for p in hf_layers]
    copies = {"model.embed_tokens.weight": embeds + heads} if tied else \
        {"model.embed_tokens.weight": embeds, "lm_head.weight": heads}
    rules = [with_duplicates(r, tuple(copies[r.hf_keys[0]])) if r.hf_keys[0] in copies else r for r in rules]
    for k, prefix in enumerate(hf_layers):
        rules += mtp_head_rules(k, enorm=prefix + "enorm.weight", hnorm=prefix + "hnorm.weight",
                                eh_proj=prefix + "eh_proj.weight", final_norm=prefix + "shared_head.norm.weight")
        rules += _decoder_layer_rules(mtp_layer_prefix(k), prefix, hf, preset,
                                      bool(preset.transformer_fields.get("num_moe_experts")))
    return rules


# this architecture's rules per mixer symbol, looked up through hp_megatron.registry.conversion_rules_of
register_conversion_rules(MODEL_TYPE, "M", mla_layer_rules)
