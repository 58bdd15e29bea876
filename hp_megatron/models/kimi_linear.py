"""Kimi Linear (``model_type: kimi_linear``, e.g. Kimi-Linear-48B-A3B): KDA ("K") and NoPE MLA ("M") layers, the
first ``first_k_dense_replace`` layers dense, MoE after them (sigmoid router with expert bias, grouped top-k,
``routed_scaling_factor``, shared experts), plain RMSNorm weights.

config.json comes in two shapes, both read here as ``KimiLinearConfig`` reads them: Moonshot's
(``linear_attn_config: {kda_layers, full_attn_layers (1-based), head_dim, num_heads, short_conv_kernel_size}``,
``first_k_dense_replace``) and transformers' (``layer_types``, ``mlp_layer_types``, ``linear_*``). Checkpoint keys
are Moonshot's, which transformers also writes: ``block_sparse_moe.experts.<e>.w1/w2/w3`` (gate/down/up),
``self_attn.{q,k,v}_conv1d``, ``f_a_proj``/``f_b_proj``/``A_log [1, 1, H, 1]``. Dense layers are ``mlp.*_proj`` in
Moonshot's checkpoints; transformers' ``save_pretrained`` writes them as ``block_sparse_moe.*_proj`` (it reverses its
load-time rename ``block_sparse_moe -> mlp`` on every MLP) and writes ``mlp_layer_types`` into config.json, which
Moonshot's config lacks: that field picks the dense name (transformers loads both).
"""
from __future__ import annotations

import torch

from hp_megatron.convert.rules import TensorRule, identity_rule
from hp_megatron.registry import check_hf_symbols, conversion_rules_of, register_conversion_rules
from hp_megatron.models.common import (ModelPreset, decoder_config, field_of, first_of, grouped_sigmoid_moe_config,
                                       layer_norm_rules, layer_prefix, mla_fields, mla_rules, mlp_rules, model_rules,
                                       refuse, require, swiglu_fc1_rule)

MODEL_TYPE = "kimi_linear"
# HF layer type -> pattern symbol (checked against the mixer registry, hp_megatron.registry)
LAYER_SYMBOLS = check_hf_symbols(MODEL_TYPE, {"linear_attention": "K", "full_attention": "M"})




def _linear(hf: dict) -> dict:
    return dict(hf.get("linear_attn_config") or {})


def layer_types(hf: dict) -> list:
    num_layers, linear = field_of(hf, MODEL_TYPE, "num_hidden_layers"), _linear(hf)
    types = hf.get("layer_types")
    if types is None and "kda_layers" in linear and "full_attn_layers" in linear:
        types = [None] * num_layers
        for layer in linear["full_attn_layers"]:
            types[layer - 1] = "full_attention"
        for layer in linear["kda_layers"]:
            types[layer - 1] = "linear_attention"
    if types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(num_layers)]
    if len(types) != num_layers or any(t not in LAYER_SYMBOLS for t in types):
        refuse(MODEL_TYPE, "layer_types / linear_attn_config", types, f"{num_layers} of {sorted(LAYER_SYMBOLS)}")
    return types


def moe_layers(hf: dict) -> list:
    num_layers = hf["num_hidden_layers"]
    types = hf.get("mlp_layer_types")
    if types is None:
        first_dense = hf.get("first_k_dense_replace", 1)
        types = ["dense" if i < first_dense else "sparse" for i in range(num_layers)]
    if len(types) != num_layers or any(t not in ("dense", "sparse") for t in types):
        refuse(MODEL_TYPE, "mlp_layer_types", types, f"{num_layers} of ['dense', 'sparse']")
    return [t == "sparse" for t in types]


def _kda_dims(hf: dict) -> dict:
    linear = _linear(hf)
    return dict(heads=first_of(linear, "num_heads", default=hf.get("linear_num_heads", 32)),
                head_dim=first_of(linear, "head_dim", default=hf.get("linear_head_dim", 128)),
                conv=first_of(linear, "short_conv_kernel_size", default=hf.get("linear_conv_kernel_dim", 4)))


def megatron_config(hf: dict) -> ModelPreset:
    """The megatron-core model of a Kimi Linear ``config.json`` (a dict)."""
    require(hf, MODEL_TYPE, "model_type", (MODEL_TYPE,))
    require(hf, MODEL_TYPE, "attention_bias", (False,), False)
    require(hf, MODEL_TYPE, "attention_dropout", (0, 0.0), 0.0)
    require(hf, MODEL_TYPE, "pretraining_tp", (1,), 1)
    require(hf, MODEL_TYPE, "output_router_logits", (False,), False)
    require(hf, MODEL_TYPE, "moe_router_activation_func", ("sigmoid",), "sigmoid")
    require(hf, MODEL_TYPE, "mla_use_nope", (True,), True)
    require(hf, MODEL_TYPE, "moe_layer_freq", (1,), 1)
    types, flags = layer_types(hf), moe_layers(hf)
    config = decoder_config(hf, MODEL_TYPE, 1e-5)
    config.update(grouped_sigmoid_moe_config(hf, MODEL_TYPE, flags))
    kda = _kda_dims(hf)
    mixer = dict(linear_num_key_heads=kda["heads"], linear_num_value_heads=kda["heads"],
                 linear_key_head_dim=kda["head_dim"], linear_value_head_dim=kda["head_dim"],
                 kda_gate_low_rank_dim=kda["head_dim"], linear_conv_kernel_dim=kda["conv"],
                 **mla_fields(hf, MODEL_TYPE, "none", {}))
    gpt = dict(vocab_size=field_of(hf, MODEL_TYPE, "vocab_size"), position_embedding_type="none",
               share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)))
    return ModelPreset(MODEL_TYPE, "".join(LAYER_SYMBOLS[t] for t in types), transformer_fields=config,
                       mixer_fields=mixer, gpt_model_kwargs=gpt)


def _cat_rule(mcore_key: str, hf_keys: tuple, sizes: list) -> TensorRule:
    """An mcore tensor that stacks several HF tensors along dim 0 (rows ``sizes`` each)."""
    return TensorRule(mcore_key, hf_keys, lambda ts: torch.cat(list(ts), 0), lambda t: t.split(sizes, 0))


def _kda_rules(mcore: str, hf: str, kda: dict) -> list[TensorRule]:
    H, K = kda["heads"], kda["head_dim"]
    return [_cat_rule(mcore + "in_proj.weight", tuple(hf + f"{n}_proj.weight" for n in "qkvb"), [H * K] * 3 + [H]),
            _cat_rule(mcore + "conv1d.weight", tuple(hf + f"{n}_conv1d.weight" for n in "qkv"), [H * K] * 3),
            _cat_rule(mcore + "gate_down_proj.weight", (hf + "f_a_proj.weight", hf + "g_a_proj.weight"), [K, K]),
            identity_rule(mcore + "forget_gate_up_proj.weight", hf + "f_b_proj.weight"),
            identity_rule(mcore + "output_gate_up_proj.weight", hf + "g_b_proj.weight"),
            TensorRule(mcore + "A_log", (hf + "A_log",), lambda ts: ts[0].reshape(H),
                       lambda t: (t.reshape(1, 1, H, 1),)),
            identity_rule(mcore + "dt_bias", hf + "dt_bias"),
            identity_rule(mcore + "out_norm.weight", hf + "o_norm.weight"),
            identity_rule(mcore + "out_proj.weight", hf + "o_proj.weight")]


def kda_layer_rules(mcore: str, hf_layer: str, hf: dict, preset: ModelPreset) -> list[TensorRule]:
    """The ``K`` mixer's rules (registered in ``hp_megatron.registry.kda``): Kimi Linear's KDA ``self_attn``."""
    return _kda_rules(mcore, hf_layer + "self_attn.", _kda_dims(hf))


def mla_layer_rules(mcore: str, hf_layer: str, hf: dict, preset: ModelPreset) -> list[TensorRule]:
    """The ``M`` mixer's rules (registered in ``hp_megatron.registry.mla``): Kimi Linear's MLA ``self_attn`` (NoPE;
    rotary rows interleaved)."""
    return mla_rules(mcore, hf_layer + "self_attn.", preset.mixer_fields,
                     preset.transformer_fields["num_attention_heads"], rope_interleave=True)


def _moe_rules(mcore: str, hf: str, num_experts: int, shared: bool) -> list[TensorRule]:
    rules = [identity_rule(mcore + "router.weight", hf + "gate.weight"),
             identity_rule(mcore + "router.expert_bias", hf + "gate.e_score_correction_bias")]
    for e in range(num_experts):
        ours, theirs = f"{mcore}experts.local_experts.{e}.", f"{hf}experts.{e}."
        rules += [swiglu_fc1_rule(ours + "linear_fc1.weight", theirs + "w1.weight", theirs + "w3.weight"),
                  identity_rule(ours + "linear_fc2.weight", theirs + "w2.weight")]
    if shared:
        rules += mlp_rules(mcore + "shared_experts.", hf + "shared_experts.")
    return rules


def conversion_rules(hf: dict) -> list[TensorRule]:
    """One rule per megatron-core tensor of the model of :func:`megatron_config`."""
    preset = megatron_config(hf)
    experts = preset.transformer_fields.get("num_moe_experts", 0)
    shared = bool(preset.transformer_fields.get("moe_shared_expert_intermediate_size"))
    dense = "block_sparse_moe." if "mlp_layer_types" in hf else "mlp."  # written by transformers / by Moonshot
    rules = model_rules(preset.gpt_model_kwargs["share_embeddings_and_output_weights"])
    for i, (symbol, is_moe) in enumerate(zip(preset.pattern, moe_layers(hf))):
        mcore, theirs = layer_prefix(i), f"model.layers.{i}."
        rules += conversion_rules_of(MODEL_TYPE, symbol)(mcore + "self_attention.", theirs, hf, preset)
        rules += layer_norm_rules(i)
        if is_moe:
            rules += _moe_rules(mcore + "mlp.", theirs + "block_sparse_moe.", experts, shared)
        else:
            rules += mlp_rules(mcore + "mlp.", theirs + dense)
    return rules


# this architecture's rules per mixer symbol, looked up through hp_megatron.registry.conversion_rules_of
register_conversion_rules(MODEL_TYPE, "K", kda_layer_rules)
register_conversion_rules(MODEL_TYPE, "M", mla_layer_rules)
