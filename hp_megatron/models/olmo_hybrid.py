"""OLMo-Hybrid (``model_type: olmo_hybrid``, e.g. allenai/Olmo-Hybrid-7B): GDN layers ("G", pre-norm, as Llama's)
and OLMo 3 attention layers ("A", post-norm), dense SwiGLU MLPs, no RoPE in the released checkpoints.

megatron-core equivalents of what differs from Qwen3-Next's GDN / attention:
* GDN with ``linear_allow_neg_eigval`` (beta = 2 sigmoid(b): ``gdn_allow_neg_eigval``), key head dim != value head
  dim, separate ``q/k/v/g/a/b_proj`` (our in_proj parts query, key, value, z, alpha, beta), the short conv stored as
  ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` (our conv1d parts), an output norm with FLA's eps 1e-5
  (``delta_norm_eps``) whatever ``rms_norm_eps`` is, plain norm weights.
* attention layers post-norm (``hp_post_norm_symbols="A"``: ``h + norm(attn(h))``, ``h + norm(mlp(h))``) with q/k
  RMSNorm over the whole projection (``hp_qk_norm_scope="projection"``), RoPE only when ``rope_parameters`` has a
  ``rope_theta`` (transformers' OlmoHybridModel; else NoPE: ``position_embedding_type="none"``).

Checkpoint names are those ``save_pretrained`` writes (transformers' conversion mapping reversed): a GDN layer's norms
``attention_layer_norm`` / ``feedforward_layer_norm``; an attention layer's ``feedforward_layer_norm`` (its norm
after attention, transformers' ``post_attention_layernorm`` in memory) and ``post_feedforward_layernorm``.
"""
from __future__ import annotations

import torch

from hp_megatron.convert.rules import TensorRule, grouped_qkv_rule, identity_rule
from hp_megatron.models.common import (ModelPreset, decoder_config, field_of, layer_prefix, mlp_rules, model_rules,
                                       refuse, require)
from hp_megatron.registry import check_hf_symbols, conversion_rules_of, register_conversion_rules

MODEL_TYPE = "olmo_hybrid"
LAYER_SYMBOLS = check_hf_symbols(MODEL_TYPE, {"linear_attention": "G", "full_attention": "A"})
GDN_OUT_NORM_EPS = 1e-5   # OlmoHybridGatedDeltaNet's o_norm (FLA's FusedRMSNormGated default)


def _layer_types(hf: dict) -> list:
    num_layers = field_of(hf, MODEL_TYPE, "num_hidden_layers")
    types = hf.get("layer_types")
    if types is None:   # transformers' default: full attention every 4th layer, at least the last one
        types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(num_layers)]
        if "full_attention" not in types:
            types[-1] = "full_attention"
    if len(types) != num_layers or any(t not in LAYER_SYMBOLS for t in types):
        refuse(MODEL_TYPE, "layer_types", types, f"{num_layers} entries of {sorted(LAYER_SYMBOLS)}")
    return types


def _gdn_dims(hf: dict) -> dict:
    heads = field_of(hf, MODEL_TYPE, "num_attention_heads")
    key_heads = hf.get("linear_num_key_heads") or heads
    key_dim = hf.get("linear_key_head_dim") or int(0.75 * hf["hidden_size"] / key_heads)
    return dict(num_key_heads=key_heads, num_value_heads=hf.get("linear_num_value_heads") or heads,
                key_head_dim=key_dim, value_head_dim=hf.get("linear_value_head_dim") or 2 * key_dim)


def _rope_theta(hf: dict):
    """RoPE base, or None for NoPE (transformers builds no rotary embedding without ``rope_parameters.rope_theta``)."""
    rope = hf.get("rope_parameters")
    if not rope or rope.get("rope_theta") is None:
        return None
    if rope.get("rope_type", "default") != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
        refuse(MODEL_TYPE, "rope_parameters", rope, "rope_type 'default', full rotary, or no rope_theta (NoPE)")
    return float(rope["rope_theta"])


def megatron_config(hf: dict) -> ModelPreset:
    """The megatron-core model of an OLMo-Hybrid ``config.json`` (a dict)."""
    require(hf, MODEL_TYPE, "model_type", (MODEL_TYPE,))
    require(hf, MODEL_TYPE, "attention_bias", (False,), False)
    require(hf, MODEL_TYPE, "attention_dropout", (0, 0.0), 0.0)
    types = _layer_types(hf)
    config = decoder_config(hf, MODEL_TYPE, 1e-6)
    heads = config["num_attention_heads"]
    config.update(num_query_groups=hf.get("num_key_value_heads") or heads, kv_channels=hf["hidden_size"] // heads,
                  qk_layernorm=True)
    dims = _gdn_dims(hf)
    mixer = dict(linear_num_key_heads=dims["num_key_heads"], linear_num_value_heads=dims["num_value_heads"],
                 linear_key_head_dim=dims["key_head_dim"], linear_value_head_dim=dims["value_head_dim"],
                 linear_conv_kernel_dim=hf.get("linear_conv_kernel_dim", 4),
                 gdn_allow_neg_eigval=bool(hf.get("linear_allow_neg_eigval", True)),
                 delta_norm_eps=GDN_OUT_NORM_EPS, gated_norm_zero_centered_gamma=False,
                 hp_post_norm_symbols="A", hp_qk_norm_scope="projection")
    theta = _rope_theta(hf)
    gpt = dict(vocab_size=field_of(hf, MODEL_TYPE, "vocab_size"),
               share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)))
    gpt.update(dict(position_embedding_type="none") if theta is None else
               dict(position_embedding_type="rope", rotary_base=theta))
    return ModelPreset(MODEL_TYPE, "".join(LAYER_SYMBOLS[t] for t in types), transformer_fields=config,
                       mixer_fields=mixer, gpt_model_kwargs=gpt, qk_layernorm=True)


def gdn_layer_rules(mcore: str, hf_layer: str, hf: dict, preset: ModelPreset) -> list[TensorRule]:
    """The ``G`` mixer's rules: ``linear_attn``'s separate projections and per-part convs; and the layer's norms."""
    d = _gdn_dims(hf)
    key, value = d["num_key_heads"] * d["key_head_dim"], d["num_value_heads"] * d["value_head_dim"]
    hf_attn = hf_layer + "linear_attn."
    parts = ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "a_proj")   # our in_proj parts' order
    proj_sizes = [key, key, value, value, d["num_value_heads"], d["num_value_heads"]]
    convs = ("q_conv1d", "k_conv1d", "v_conv1d")
    return [TensorRule(mcore + "in_proj.weight", tuple(f"{hf_attn}{p}.weight" for p in parts),
                       lambda ts: torch.cat(ts, 0), lambda t: tuple(t.split(proj_sizes, 0))),
            TensorRule(mcore + "conv1d.weight", tuple(f"{hf_attn}{c}.weight" for c in convs),
                       lambda ts: torch.cat(ts, 0), lambda t: tuple(t.split([key, key, value], 0))),
            identity_rule(mcore + "A_log", hf_attn + "A_log"),
            identity_rule(mcore + "dt_bias", hf_attn + "dt_bias"),
            identity_rule(mcore + "out_norm.weight", hf_attn + "o_norm.weight"),
            identity_rule(mcore + "out_proj.weight", hf_attn + "o_proj.weight")]


def attention_layer_rules(mcore: str, hf_layer: str, hf: dict, preset: ModelPreset) -> list[TensorRule]:
    """The ``A`` mixer's rules: OLMo 3's ``self_attn`` (whole-projection q/k norms) and its post-attention norm."""
    t = preset.transformer_fields
    attn = hf_layer + "self_attn."
    return [grouped_qkv_rule(mcore + "linear_qkv.weight", attn + "q_proj.weight", attn + "k_proj.weight",
                             attn + "v_proj.weight", num_heads=t["num_attention_heads"],
                             num_groups=t["num_query_groups"], head_dim=t["kv_channels"]),
            identity_rule(mcore + "linear_proj.weight", attn + "o_proj.weight"),
            identity_rule(mcore + "q_layernorm.weight", attn + "q_norm.weight"),
            identity_rule(mcore + "k_layernorm.weight", attn + "k_norm.weight")]


def _layer_norm_rules(i: int, symbol: str) -> list[TensorRule]:
    mcore, hf = layer_prefix(i), f"model.layers.{i}."
    if symbol == "A":   # post-norm: the norms are the mixer's and the MLP's (hp_megatron.decoder.post_norm)
        return [identity_rule(mcore + "self_attention.post_norm.weight", hf + "feedforward_layer_norm.weight"),
                identity_rule(mcore + "mlp.post_norm.weight", hf + "post_feedforward_layernorm.weight")]
    return [identity_rule(mcore + "input_layernorm.weight", hf + "attention_layer_norm.weight"),
            identity_rule(mcore + "pre_mlp_layernorm.weight", hf + "feedforward_layer_norm.weight")]


def conversion_rules(hf: dict) -> list[TensorRule]:
    """One rule per megatron-core tensor of the model of :func:`megatron_config`."""
    preset = megatron_config(hf)
    rules = model_rules(preset.gpt_model_kwargs["share_embeddings_and_output_weights"])
    for i, symbol in enumerate(preset.pattern):
        rules += conversion_rules_of(MODEL_TYPE, symbol)(layer_prefix(i) + "self_attention.", f"model.layers.{i}.",
                                                         hf, preset)
        rules += _layer_norm_rules(i, symbol)
        rules += mlp_rules(layer_prefix(i) + "mlp.", f"model.layers.{i}.mlp.")
    return rules


register_conversion_rules(MODEL_TYPE, "A", attention_layer_rules)
register_conversion_rules(MODEL_TYPE, "G", gdn_layer_rules)
