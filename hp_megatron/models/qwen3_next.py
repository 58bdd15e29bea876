"""Qwen3-Next (``model_type: qwen3_next``, e.g. Qwen3-Next-80B-A3B): GDN ("G") and gated attention ("A") layers,
MoE MLPs with a gated shared expert, zero-centred RMSNorm weights.

megatron-core equivalents: attention with ``attention_output_gate`` (``q_proj`` holds each head's query and gate),
q/k RMSNorm (``qk_layernorm``), partial rotary (``rotary_percent``), ``layernorm_zero_centered_gamma`` for every
norm except the GDN output norm (``gated_norm_zero_centered_gamma=False``: Qwen3-Next stores that one plainly),
softmax top-k router (``moe_router_pre_softmax`` when ``norm_topk_prob`` is false), ``moe_shared_expert_gate``.

The released checkpoints also hold a multi-token-prediction module (``mtp.*``, config.json
``mtp_num_hidden_layers``: 1), which transformers skips on load. Built with MTP (``conversion_rules(hf,
mtp_num_layers=1)``, the converter's ``--mtp-num-layers 1``) it is megatron-core's ``mtp.layers.0.*``:
``pre_fc_norm_embedding`` -> ``enorm``, ``pre_fc_norm_hidden`` -> ``hnorm``, ``fc`` -> ``eh_proj`` (input
``[embedding; hidden]``), ``layers.0`` (gated attention + MoE) -> its transformer layer, ``norm`` ->
``final_layernorm``, all zero-centred norms as the model's. Without MTP ``unmodeled_tensors`` lists the module and
the converter drops it only when asked (``--drop-unmodeled``).
"""
from __future__ import annotations

import torch

from hp_megatron.convert.rules import TensorRule, identity_rule
from hp_megatron.registry import check_hf_symbols, conversion_rules_of, register_conversion_rules
from hp_megatron.models.common import (ModelPreset, check_mtp_depth, decoder_config, field_of, layer_mlp_rules,
                                       layer_norm_rules, layer_prefix, mlp_rules, model_rules, moe_router_config,
                                       moe_rules, mtp_head_rules, mtp_layer_prefix, norm_rules, refuse, require,
                                       rope_parameters)

MODEL_TYPE = "qwen3_next"
# HF layer type -> pattern symbol (checked against the mixer registry, hp_megatron.registry)
LAYER_SYMBOLS = check_hf_symbols(MODEL_TYPE, {"linear_attention": "G", "full_attention": "A"})
MTP_FIELD = "mtp_num_hidden_layers"
GDN_IN_PROJ_PARTS = ("query", "key", "value", "z", "beta", "alpha")  # row order of our GDN in_proj


def mtp_depth(hf: dict) -> int:
    """The multi-token-prediction layers config.json declares (``mtp_num_hidden_layers``; 0 when absent)."""
    return hf.get(MTP_FIELD) or 0


def unmodeled_tensors(hf: dict) -> dict:
    """``{HF key prefix: what it holds}``: the multi-token-prediction module of the released checkpoints."""
    return {"mtp.": "Qwen3-Next multi-token-prediction module (mtp.*)"}


def _layer_types(hf: dict, model_type: str = MODEL_TYPE) -> list:
    num_layers = field_of(hf, model_type, "num_hidden_layers")
    types = hf.get("layer_types")
    if types is None:  # transformers' default: full attention every full_attention_interval-th layer
        interval = hf.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if len(types) != num_layers or any(t not in LAYER_SYMBOLS for t in types):
        refuse(model_type, "layer_types", types, f"{num_layers} entries of {sorted(LAYER_SYMBOLS)}")
    return types


def moe_layers(hf: dict) -> list:
    """One bool per layer: sparse (MoE) MLP, as ``Qwen3NextDecoderLayer`` decides it."""
    num_layers, experts = hf["num_hidden_layers"], hf.get("num_experts", 0) or 0
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    return [i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers)]


def gdn_dims(hf: dict, model_type: str = MODEL_TYPE) -> dict:
    """The GDN layers' head counts and dims (``linear_*`` fields) of a Qwen3-Next / Qwen3.5 config."""
    return dict(num_key_heads=field_of(hf, model_type, "linear_num_key_heads"),
                num_value_heads=field_of(hf, model_type, "linear_num_value_heads"),
                key_head_dim=field_of(hf, model_type, "linear_key_head_dim"),
                value_head_dim=field_of(hf, model_type, "linear_value_head_dim"))


def megatron_config(hf: dict) -> ModelPreset:
    """The megatron-core model of a Qwen3-Next ``config.json`` (a dict)."""
    require(hf, MODEL_TYPE, "model_type", (MODEL_TYPE,))
    return hybrid_preset(hf, MODEL_TYPE, rope_parameters(hf))


def hybrid_preset(hf: dict, model_type: str, rope: dict) -> ModelPreset:
    """The preset of a Qwen3-Next-style decoder (GDN / gated attention layers, dense or MoE-with-shared-expert MLPs,
    zero-centred norms) from its text config ``hf``; ``rope``: its checked ``rope_parameters``; Qwen3.5 shares it
    (``hp_megatron.models.qwen3_5``)."""
    require(hf, model_type, "attention_bias", (False,), False)
    require(hf, model_type, "attention_dropout", (0, 0.0), 0.0)
    if rope["rope_type"] != "default":
        refuse(model_type, "rope_parameters.rope_type", rope["rope_type"], ["default"])
    types, flags = _layer_types(hf, model_type), moe_layers(hf)
    config = decoder_config(hf, model_type, 1e-6)
    heads = config["num_attention_heads"]
    config.update(num_query_groups=hf.get("num_key_value_heads", heads),
                  kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads, layernorm_zero_centered_gamma=True,
                  qk_layernorm=True, attention_output_gate=True)
    if any(flags):
        require(hf, model_type, "output_router_logits", (False,), False)
        shared = field_of(hf, model_type, "shared_expert_intermediate_size")
        config.update(moe_router_config(model_type, num_experts=hf["num_experts"],
                                        topk=field_of(hf, model_type, "num_experts_per_tok"),
                                        norm_topk_prob=hf.get("norm_topk_prob", True), score_function="softmax",
                                        scaling_factor=None, expert_bias=False),
                      moe_layer_freq=[int(f) for f in flags],
                      moe_ffn_hidden_size=field_of(hf, model_type, "moe_intermediate_size"),
                      moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    dims = gdn_dims(hf, model_type)
    mixer = dict(linear_num_key_heads=dims["num_key_heads"], linear_num_value_heads=dims["num_value_heads"],
                 linear_key_head_dim=dims["key_head_dim"], linear_value_head_dim=dims["value_head_dim"],
                 linear_conv_kernel_dim=hf.get("linear_conv_kernel_dim", 4), gated_norm_zero_centered_gamma=False,
                 hp_mtp_layer_symbol="A")
    gpt = dict(vocab_size=field_of(hf, model_type, "vocab_size"), position_embedding_type="rope",
               rotary_percent=float(rope.get("partial_rotary_factor", 0.25)),
               rotary_base=float(rope.get("rope_theta", 10000.0)),
               share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)))
    return ModelPreset(model_type, "".join(LAYER_SYMBOLS[t] for t in types), transformer_fields=config,
                       mixer_fields=mixer, gpt_model_kwargs=gpt, qk_layernorm=True, mtp_symbol="A",
                       mtp_num_layers=mtp_depth(hf))


def _gated_qkv_rule(mcore_key: str, hf: str, heads: int, groups: int, head_dim: int) -> TensorRule:
    """megatron's ``linear_qkv`` with output gate: per query group ``[q (r heads), gate (r heads), k, v]``;
    transformers' ``q_proj`` holds ``[q, gate]`` per head."""
    r = heads // groups

    def to_mcore(ts):
        q_proj, k, v = ts
        hidden = q_proj.shape[1]
        q, gate = q_proj.reshape(heads, 2, head_dim, hidden).unbind(1)
        return torch.cat([q.reshape(groups, r * head_dim, hidden), gate.reshape(groups, r * head_dim, hidden),
                          k.reshape(groups, head_dim, hidden), v.reshape(groups, head_dim, hidden)], 1
                         ).reshape(-1, hidden)

    def to_hf(t):
        hidden = t.shape[1]
        q, gate, k, v = t.reshape(groups, 2 * (r + 1) * head_dim, hidden).split(
            [r * head_dim, r * head_dim, head_dim, head_dim], 1)
        q_proj = torch.stack([q.reshape(heads, head_dim, hidden), gate.reshape(heads, head_dim, hidden)], 1)
        return q_proj.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)

    return TensorRule(mcore_key, (hf + "q_proj.weight", hf + "k_proj.weight", hf + "v_proj.weight"), to_mcore, to_hf)


def _attention_rules(mcore: str, hf: str, preset: ModelPreset) -> list[TensorRule]:
    c = preset.transformer_fields
    return [_gated_qkv_rule(mcore + "linear_qkv.weight", hf, c["num_attention_heads"], c["num_query_groups"],
                            c["kv_channels"]),
            identity_rule(mcore + "linear_proj.weight", hf + "o_proj.weight"),
            identity_rule(mcore + "q_layernorm.weight", hf + "q_norm.weight"),
            identity_rule(mcore + "k_layernorm.weight", hf + "k_norm.weight")]


def gdn_head_groups(num_key_heads, num_value_heads, key_head_dim, value_head_dim):
    """``(H, HV, K, V, HV // H)``; ValueError unless HV is a multiple of H."""
    if num_value_heads % num_key_heads:
        raise ValueError(f"num_value_heads={num_value_heads} must be a multiple of num_key_heads={num_key_heads}")
    return num_key_heads, num_value_heads, key_head_dim, value_head_dim, num_value_heads // num_key_heads


def split_qwen3_next_in_proj(qkvz, ba, num_key_heads, num_value_heads, key_head_dim, value_head_dim):
    """Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` weights -> our in_proj parts (q, k, v, z, beta, alpha),
    each ``[rows, hidden]``: Qwen3-Next groups rows per key head (``[q K, k K, v r*V, z r*V]`` and ``[b r, a r]``,
    r = HV/H), our parts hold all heads of one kind."""
    H, HV, K, V, r = gdn_head_groups(num_key_heads, num_value_heads, key_head_dim, value_head_dim)
    hidden = qkvz.shape[1]
    q, k, v, z = qkvz.reshape(H, 2 * K + 2 * r * V, hidden).split([K, K, r * V, r * V], dim=1)
    b, a = ba.reshape(H, 2 * r, hidden).split([r, r], dim=1)
    return (q.reshape(H * K, hidden), k.reshape(H * K, hidden), v.reshape(HV * V, hidden), z.reshape(HV * V, hidden),
            b.reshape(HV, hidden), a.reshape(HV, hidden))


def join_qwen3_next_in_proj(q, k, v, z, b, a, num_key_heads, num_value_heads, key_head_dim, value_head_dim):
    """Inverse of :func:`split_qwen3_next_in_proj`: ``(in_proj_qkvz, in_proj_ba)`` weights."""
    H, HV, K, V, r = gdn_head_groups(num_key_heads, num_value_heads, key_head_dim, value_head_dim)
    hidden = q.shape[1]
    grouped = [q.reshape(H, K, hidden), k.reshape(H, K, hidden), v.reshape(H, r * V, hidden),
               z.reshape(H, r * V, hidden)]
    ba = [b.reshape(H, r, hidden), a.reshape(H, r, hidden)]
    return torch.cat(grouped, dim=1).reshape(-1, hidden), torch.cat(ba, dim=1).reshape(-1, hidden)


def _gdn_rules(mcore: str, hf: str, dims: dict) -> list[TensorRule]:
    H, HV, K, V = dims["num_key_heads"], dims["num_value_heads"], dims["key_head_dim"], dims["value_head_dim"]
    sizes = dict(zip(GDN_IN_PROJ_PARTS, (H * K, H * K, HV * V, HV * V, HV, HV)))

    def in_proj_to_mcore(ts):
        return torch.cat(split_qwen3_next_in_proj(*ts, **dims), 0)

    def in_proj_to_hf(t):
        return join_qwen3_next_in_proj(*t.split(list(sizes.values()), 0), **dims)

    return [TensorRule(mcore + "in_proj.weight", (hf + "in_proj_qkvz.weight", hf + "in_proj_ba.weight"),
                       in_proj_to_mcore, in_proj_to_hf),
            identity_rule(mcore + "conv1d.weight", hf + "conv1d.weight"),  # both [q; k; v] channels
            identity_rule(mcore + "A_log", hf + "A_log"),
            identity_rule(mcore + "dt_bias", hf + "dt_bias"),
            identity_rule(mcore + "out_norm.weight", hf + "norm.weight"),
            identity_rule(mcore + "out_proj.weight", hf + "out_proj.weight")]


def attention_layer_rules(mcore: str, hf_layer: str, hf: dict, preset: ModelPreset) -> list[TensorRule]:
    """The ``A`` mixer's rules (registered in ``hp_megatron.registry.attention``): Qwen3-Next's ``self_attn``."""
    return _attention_rules(mcore, hf_layer + "self_attn.", preset)


def gdn_layer_rules(mcore: str, hf_layer: str, hf: dict, preset: ModelPreset) -> list[TensorRule]:
    """The ``G`` mixer's rules (registered in ``hp_megatron.registry.gdn``): Qwen3-Next's ``linear_attn``."""
    return _gdn_rules(mcore, hf_layer + "linear_attn.", gdn_dims(hf))


def _mtp_rules(hf: dict, preset: ModelPreset, mtp_num_layers: int) -> list[TensorRule]:
    model_type = preset.model_type
    check_mtp_depth(model_type, MTP_FIELD, mtp_depth(hf), mtp_num_layers)
    if mtp_num_layers != 1:
        raise ValueError(f"{model_type}: one MTP layer is supported (mtp.fc and its norms are shared by mtp.layers.*; "
                         f"megatron-core has them per layer), got {MTP_FIELD}={mtp_num_layers}")
    mcore = mtp_layer_prefix(0)
    rules = mtp_head_rules(0, enorm="mtp.pre_fc_norm_embedding.weight", hnorm="mtp.pre_fc_norm_hidden.weight",
                           eh_proj="mtp.fc.weight", final_norm="mtp.norm.weight")
    rules += conversion_rules_of(model_type, preset.mtp_symbol)(mcore + "self_attention.", "mtp.layers.0.", hf, preset)
    rules += norm_rules(mcore, "mtp.layers.0.")
    if preset.transformer_fields.get("num_moe_experts"):
        return rules + moe_rules(mcore + "mlp.", "mtp.layers.0.mlp.", hf["num_experts"], router="gate.weight",
                                 shared="shared_expert.", shared_gate="shared_expert_gate.weight")
    return rules + mlp_rules(mcore + "mlp.", "mtp.layers.0.mlp.")


def conversion_rules(hf: dict, mtp_num_layers: int = 0) -> list[TensorRule]:
    """One rule per megatron-core tensor of the model of :func:`megatron_config`, with ``mtp_num_layers`` MTP layers
    (0 or config.json's ``mtp_num_hidden_layers``)."""
    return hybrid_rules(hf, megatron_config(hf), mtp_num_layers)


def hybrid_rules(hf: dict, preset: ModelPreset, mtp_num_layers: int = 0) -> list[TensorRule]:
    """The rules of :func:`hybrid_preset`'s model (text config ``hf``, checkpoint keys ``model.*``), each mixer's
    from the registry under ``preset.model_type``."""
    rules = model_rules(preset.gpt_model_kwargs["share_embeddings_and_output_weights"])
    for i, (symbol, is_moe) in enumerate(zip(preset.pattern, moe_layers(hf))):
        rules += conversion_rules_of(preset.model_type, symbol)(layer_prefix(i) + "self_attention.",
                                                                f"model.layers.{i}.", hf, preset)
        rules += layer_norm_rules(i)
        rules += layer_mlp_rules(i, is_moe, hf.get("num_experts", 0), router="gate.weight",
                                 shared="shared_expert.", shared_gate="shared_expert_gate.weight")
    return rules + (_mtp_rules(hf, preset, mtp_num_layers) if mtp_num_layers else [])


# this architecture's rules per mixer symbol, looked up through hp_megatron.registry.conversion_rules_of
register_conversion_rules(MODEL_TYPE, "A", attention_layer_rules)
register_conversion_rules(MODEL_TYPE, "G", gdn_layer_rules)
