"""Ling 3.0 (``model_type: bailing_hybrid``, e.g. inclusionAI/Ling-3.0-Flash): KDA layers ("K") and MLA layers ("M":
layer i when ``(i + 1) % layer_group_size == 0``), DeepSeek-V3's grouped sigmoid MoE with expert bias after the
first dense layers, per-layer SwiGLU clipping.

megatron-core equivalents of what differs from Kimi Linear / DeepSeek-V3:
* KDA with the safe gate (``kda_safe_gate``, ``kda_lower_bound``) and full-rank gates (``kda_full_rank_gates``:
  ``f_proj`` / ``g_proj`` as parts of our in_proj), the short conv stored as ``q/k/v_conv1d``;
* MLA with a head-wise sigmoid output gate (``mla_output_gate``: ``g_proj`` -> ``linear_gate_proj``), interleaved
  RoPE, the output projection stored as ``dense``;
* routed experts and shared experts clipped per layer (``hp_swiglu_limits`` / ``hp_shared_swiglu_limits`` from
  ``expert_swiglu_limit_list`` / ``share_expert_swiglu_limit_list``; a dense layer's MLP is not clipped, as in
  transformers' ``BailingHybridMLP(config)``).

Checkpoint names are the released ones (``save_pretrained`` writes them): ``model.word_embeddings``,
``model.layers.<i>.attention.*``, ``mlp.gate.expert_bias``.

Multi-token prediction (``num_nextn_predict_layers``, transformers' ``num_mtp_layers``): the checkpoints store MTP
layer ``k`` as ``model.layers.<num_hidden_layers + k>.``, which transformers 5.25 skips on load
(``_keys_to_ignore_on_load_unexpected``) and has no forward for. Its layout is the Ling family's NextN layer (Ling
2.0's, as SGLang's ``BailingMoeForCausalLMNextN`` loads it): ``enorm``, ``hnorm``, ``eh_proj`` over
``[enorm(emb); hnorm(h)]``, ``final_layernorm``, and a decoder layer of the full-attention kind, here MLA with the
output gate (``attention.*``), with the MoE MLP (``mlp.*``; transformers' ``get_mtp_config`` makes MTP layers MoE)
and its two norms; no copies of the embedding or head. Built with MTP (``conversion_rules(hf, mtp_num_layers)``,
the converter's ``--mtp-num-layers``) they are megatron-core's ``mtp.layers.<k>.*``, not SwiGLU-clipped (the limit
lists have one entry per main layer). Without MTP ``unmodeled_tensors`` lists them and the converter drops them
only when asked (``--drop-unmodeled``).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from hp_megatron.convert.rules import TensorRule, identity_rule
from hp_megatron.models.common import (ModelPreset, check_mtp_depth, decoder_config, field_of, first_of,
                                       grouped_sigmoid_moe_config, layer_prefix, mla_fields, mla_rules, mlp_rules,
                                       moe_rules, mtp_head_rules, mtp_layer_prefix, norm_rules, refuse, require,
                                       rope_parameters)
from hp_megatron.registry import check_hf_symbols, conversion_rules_of, register_conversion_rules

MODEL_TYPE = "bailing_hybrid"
LAYER_SYMBOLS = check_hf_symbols(MODEL_TYPE, {"linear_attention": "K", "full_attention": "M"})
MTP_FIELD = "num_nextn_predict_layers"
MTP_SYMBOL = "M"   # the kind of the MTP layers' decoder layer: MLA with the output gate


def mtp_depth(hf: dict) -> int:
    """The multi-token-prediction layers config.json declares (``num_nextn_predict_layers``; 0 when absent)."""
    return first_of(hf, MTP_FIELD, "num_mtp_layers", default=0)


def unmodeled_tensors(hf: dict) -> dict:
    layers = field_of(hf, MODEL_TYPE, "num_hidden_layers")
    return {f"model.layers.{layers + i}.": f"Ling 3.0 multi-token-prediction layer {i} ({MTP_FIELD}="
            f"{mtp_depth(hf)})" for i in range(mtp_depth(hf))}


def _layer_types(hf: dict) -> list:
    num_layers = field_of(hf, MODEL_TYPE, "num_hidden_layers")
    types = hf.get("layer_types")
    if types is None:
        group = hf.get("layer_group_size", 6)
        types = ["full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(num_layers)]
    if len(types) != num_layers or any(t not in LAYER_SYMBOLS for t in types):
        refuse(MODEL_TYPE, "layer_types", types, f"{num_layers} entries of {sorted(LAYER_SYMBOLS)}")
    return types


def moe_layers(hf: dict) -> list:
    num_layers = field_of(hf, MODEL_TYPE, "num_hidden_layers")
    types = hf.get("mlp_layer_types")
    if types is None:
        first_dense = hf.get("first_k_dense_replace", 2)
        types = ["dense" if i < first_dense else "sparse" for i in range(num_layers)]
    if len(types) != num_layers or any(t not in ("dense", "sparse") for t in types):
        refuse(MODEL_TYPE, "mlp_layer_types", types, f"{num_layers} of ['dense', 'sparse']")
    return [t == "sparse" for t in types]


def _kda_dims(hf: dict) -> dict:
    """KDA heads (= attention heads), head dim (transformers: ``linear_head_dim``, set from ``head_dim``), conv."""
    return dict(heads=field_of(hf, MODEL_TYPE, "num_attention_heads"),
                head_dim=first_of(hf, "linear_head_dim", "head_dim", default=128),
                conv=first_of(hf, "linear_conv_kernel_dim", "short_conv_kernel_size", default=4))


def _limits(hf: dict, name: str, alias: str, flags: list) -> tuple | None:
    limits = first_of(hf, name, alias)
    if not limits:
        return None
    if len(limits) != len(flags):
        refuse(MODEL_TYPE, name, limits, f"one limit per layer ({len(flags)})")
    limits = tuple(float(v) if is_moe else 0.0 for v, is_moe in zip(limits, flags))   # dense MLPs: no clip
    return limits if any(limits) else None


def megatron_config(hf: dict) -> ModelPreset:
    """The megatron-core model of a Ling 3.0 ``config.json`` (a dict)."""
    require(hf, MODEL_TYPE, "model_type", (MODEL_TYPE,))
    require(hf, MODEL_TYPE, "attention_bias", (False,), False)
    require(hf, MODEL_TYPE, "attention_dropout", (0, 0.0), 0.0)
    require(hf, MODEL_TYPE, "output_router_logits", (False,), False)
    rope = rope_parameters(hf)
    if rope["rope_type"] != "default":
        refuse(MODEL_TYPE, "rope_parameters.rope_type", rope["rope_type"], ["default"])
    types, flags = _layer_types(hf), moe_layers(hf)
    config = decoder_config(hf, MODEL_TYPE, 1e-6)
    config.update(grouped_sigmoid_moe_config(hf, MODEL_TYPE, flags))
    kda = _kda_dims(hf)
    lower = float(hf.get("kda_lower_bound", -5.0))
    mixer = dict(linear_num_key_heads=kda["heads"], linear_num_value_heads=kda["heads"],
                 linear_key_head_dim=kda["head_dim"], linear_value_head_dim=kda["head_dim"],
                 linear_conv_kernel_dim=kda["conv"], kda_full_rank_gates=True,
                 kda_safe_gate=bool(hf.get("kda_safe_gate", True)), kda_lower_bound=lower,
                 mla_output_gate=True, hp_swiglu_limits=_limits(hf, "expert_swiglu_limit_list", "swiglu_limits", flags),
                 hp_shared_swiglu_limits=_limits(hf, "share_expert_swiglu_limit_list", "swiglu_limits_shared", flags),
                 hp_mtp_layer_symbol=MTP_SYMBOL, **mla_fields(hf, MODEL_TYPE, "rope", rope))
    gpt = dict(vocab_size=field_of(hf, MODEL_TYPE, "vocab_size"), position_embedding_type="none",
               share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)))
    return ModelPreset(MODEL_TYPE, "".join(LAYER_SYMBOLS[t] for t in types), transformer_fields=config,
                       mixer_fields=mixer, gpt_model_kwargs=gpt, mtp_symbol=MTP_SYMBOL, mtp_num_layers=mtp_depth(hf))


def _cat_rule(mcore_key: str, hf_keys: tuple, sizes: list) -> TensorRule:
    return TensorRule(mcore_key, hf_keys, lambda ts: torch.cat(list(ts), 0), lambda t: tuple(t.split(sizes, 0)))


def kda_layer_rules(mcore: str, hf_layer: str, hf: dict, preset: ModelPreset) -> list[TensorRule]:
    """The ``K`` mixer's rules: Ling's ``attention`` (q/k/v/b/f/g projections: our in_proj parts)."""
    d = _kda_dims(hf)
    H, K = d["heads"], d["head_dim"]
    attn = hf_layer + "attention."
    return [_cat_rule(mcore + "in_proj.weight", tuple(f"{attn}{n}_proj.weight" for n in "qkvbfg"),
                      [H * K] * 3 + [H] + [H * K] * 2),
            _cat_rule(mcore + "conv1d.weight", tuple(f"{attn}{n}_conv1d.weight" for n in "qkv"), [H * K] * 3),
            identity_rule(mcore + "A_log", attn + "A_log"),
            identity_rule(mcore + "dt_bias", attn + "dt_bias"),
            identity_rule(mcore + "out_norm.weight", attn + "o_norm.weight"),
            identity_rule(mcore + "out_proj.weight", attn + "dense.weight")]


def mla_layer_rules(mcore: str, hf_layer: str, hf: dict, preset: ModelPreset) -> list[TensorRule]:
    """The ``M`` mixer's rules: DeepSeek-V3's MLA under ``attention.`` (``o_proj`` stored as ``dense``) and the
    output gate ``g_proj``."""
    attn = hf_layer + "attention."
    rules = mla_rules(mcore, attn, preset.mixer_fields, preset.transformer_fields["num_attention_heads"],
                      rope_interleave=True)
    rules = [replace(r, hf_keys=(attn + "dense.weight",)) if r.hf_keys == (attn + "o_proj.weight",) else r
             for r in rules]
    return rules + [identity_rule(mcore + "linear_gate_proj.weight", attn + "g_proj.weight")]


def _decoder_layer_rules(mcore: str, theirs: str, symbol: str, is_moe: bool, hf: dict,
                         preset: ModelPreset) -> list[TensorRule]:
    """One decoder layer's rules: its mixer, its two norms and its MLP (MoE or dense)."""
    rules = conversion_rules_of(MODEL_TYPE, symbol)(mcore + "self_attention.", theirs, hf, preset)
    rules += norm_rules(mcore, theirs)
    if not is_moe:
        return rules + mlp_rules(mcore + "mlp.", theirs + "mlp.")
    shared = "shared_experts." if preset.transformer_fields.get("moe_shared_expert_intermediate_size") else None
    return rules + moe_rules(mcore + "mlp.", theirs + "mlp.", preset.transformer_fields["num_moe_experts"],
                             router="gate.weight", shared=shared, expert_bias="gate.expert_bias")


def _mtp_rules(hf: dict, preset: ModelPreset, mtp_num_layers: int) -> list[TensorRule]:
    """MTP layer ``k`` <- ``model.layers.<num_hidden_layers + k>.`` (the module docstring's layout)."""
    check_mtp_depth(MODEL_TYPE, MTP_FIELD, mtp_depth(hf), mtp_num_layers)
    moe = bool(preset.transformer_fields.get("num_moe_experts"))
    rules = []
    for k in range(mtp_num_layers):
        theirs = f"model.layers.{field_of(hf, MODEL_TYPE, 'num_hidden_layers') + k}."
        rules += mtp_head_rules(k, enorm=theirs + "enorm.weight", hnorm=theirs + "hnorm.weight",
                                eh_proj=theirs + "eh_proj.weight", final_norm=theirs + "final_layernorm.weight")
        rules += _decoder_layer_rules(mtp_layer_prefix(k), theirs, MTP_SYMBOL, moe, hf, preset)
    return rules


def conversion_rules(hf: dict, mtp_num_layers: int = 0) -> list[TensorRule]:
    """One rule per megatron-core tensor of the model of :func:`megatron_config`, with ``mtp_num_layers`` MTP layers
    (0 or config.json's ``num_nextn_predict_layers``)."""
    preset = megatron_config(hf)
    rules = [identity_rule("embedding.word_embeddings.weight", "model.word_embeddings.weight"),
             identity_rule("decoder.final_layernorm.weight", "model.norm.weight")]
    if not preset.gpt_model_kwargs["share_embeddings_and_output_weights"]:
        rules.append(identity_rule("output_layer.weight", "lm_head.weight"))
    for i, (symbol, is_moe) in enumerate(zip(preset.pattern, moe_layers(hf))):
        rules += _decoder_layer_rules(layer_prefix(i), f"model.layers.{i}.", symbol, is_moe, hf, preset)
    return rules + (_mtp_rules(hf, preset, mtp_num_layers) if mtp_num_layers else [])


register_conversion_rules(MODEL_TYPE, "K", kda_layer_rules)
register_conversion_rules(MODEL_TYPE, "M", mla_layer_rules)
