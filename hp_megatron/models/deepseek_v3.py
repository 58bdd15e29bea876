"""DeepSeek-V3 (``model_type: deepseek_v3``): MLA ("M") in every layer (YaRN or plain RoPE), the first
``first_k_dense_replace`` layers dense, MoE after them: sigmoid router with expert bias (``e_score_correction_bias``),
grouped top-k (``n_group`` / ``topk_group``), ``routed_scaling_factor``, ``n_shared_experts`` shared experts.

Multi-token-prediction layers (``num_nextn_predict_layers``) are not part of transformers' forward pass, nor of
the model built here; their checkpoint tensors (``model.layers.<num_hidden_layers + i>.``) are listed by
``unmodeled_tensors``, and the converter drops them only when asked (``--drop-unmodeled``).
"""
from __future__ import annotations

from hp_megatron.convert.rules import TensorRule
from hp_megatron.models.common import (ModelPreset, decoder_config, field_of, layer_mlp_rules, layer_norm_rules,
                                       layer_prefix, mla_fields, mla_rules, model_rules, moe_router_config, refuse,
                                       require, rope_parameters)

MODEL_TYPE = "deepseek_v3"


def unmodeled_tensors(hf: dict) -> dict:
    """``{HF key prefix: what it holds}`` of the multi-token-prediction layers (``num_nextn_predict_layers``)."""
    layers = field_of(hf, MODEL_TYPE, "num_hidden_layers")
    mtp = hf.get("num_nextn_predict_layers") or 0
    return {f"model.layers.{layers + i}.": f"DeepSeek-V3 multi-token-prediction layer {i} "
            f"(num_nextn_predict_layers={mtp})" for i in range(mtp)}


def moe_layers(hf: dict) -> list:
    first_dense = hf.get("first_k_dense_replace", 0)
    return [i >= first_dense for i in range(field_of(hf, MODEL_TYPE, "num_hidden_layers"))]


def megatron_config(hf: dict) -> ModelPreset:
    """The megatron-core model of a DeepSeek-V3 ``config.json`` (a dict)."""
    require(hf, MODEL_TYPE, "model_type", (MODEL_TYPE,))
    require(hf, MODEL_TYPE, "attention_bias", (False,), False)
    require(hf, MODEL_TYPE, "attention_dropout", (0, 0.0), 0.0)
    require(hf, MODEL_TYPE, "pretraining_tp", (1,), 1)
    require(hf, MODEL_TYPE, "scoring_func", ("sigmoid",), "sigmoid")
    require(hf, MODEL_TYPE, "topk_method", ("noaux_tc",), "noaux_tc")
    require(hf, MODEL_TYPE, "output_router_logits", (False,), False)
    rope = rope_parameters(hf)
    rope_type = {"default": "rope", "yarn": "yarn"}.get(rope["rope_type"])
    if rope_type is None:
        refuse(MODEL_TYPE, "rope_parameters.rope_type", rope["rope_type"], ["default", "yarn"])
    flags = moe_layers(hf)
    config = decoder_config(hf, MODEL_TYPE, 1e-6)
    if any(flags):
        experts = field_of(hf, MODEL_TYPE, "n_routed_experts")
        config.update(moe_router_config(MODEL_TYPE, num_experts=experts,
                                        topk=field_of(hf, MODEL_TYPE, "num_experts_per_tok"),
                                        norm_topk_prob=hf.get("norm_topk_prob", True), score_function="sigmoid",
                                        scaling_factor=hf.get("routed_scaling_factor"), expert_bias=True,
                                        num_groups=hf.get("n_group"), group_topk=hf.get("topk_group")),
                      moe_layer_freq=[int(f) for f in flags],
                      moe_ffn_hidden_size=field_of(hf, MODEL_TYPE, "moe_intermediate_size"))
        shared = hf.get("n_shared_experts") or 0
        if shared:
            config["moe_shared_expert_intermediate_size"] = shared * hf["moe_intermediate_size"]
    mixer = mla_fields(hf, MODEL_TYPE, rope_type, rope)
    gpt = dict(vocab_size=field_of(hf, MODEL_TYPE, "vocab_size"), position_embedding_type="none",
               share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)))
    return ModelPreset(MODEL_TYPE, "M" * hf["num_hidden_layers"], transformer_fields=config, mixer_fields=mixer,
                       gpt_model_kwargs=gpt)


def conversion_rules(hf: dict) -> list[TensorRule]:
    """One rule per megatron-core tensor of the model of :func:`megatron_config`."""
    preset = megatron_config(hf)
    rules = model_rules(preset.gpt_model_kwargs["share_embeddings_and_output_weights"])
    shared = "shared_experts." if hf.get("n_shared_experts") else None
    for i, is_moe in enumerate(moe_layers(hf)):
        rules += mla_rules(layer_prefix(i) + "self_attention.", f"model.layers.{i}.self_attn.", preset.mixer_fields,
                           preset.transformer_fields["num_attention_heads"],
                           rope_interleave=hf.get("rope_interleave", True))
        rules += layer_norm_rules(i)
        rules += layer_mlp_rules(i, is_moe, hf.get("n_routed_experts", 0), router="gate.weight",
                                 expert_bias="gate.e_score_correction_bias", shared=shared)
    return rules
