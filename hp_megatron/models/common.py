"""What the architecture modules share: the preset they return, config-field checks, and conversion rules for the
parts every architecture has (embeddings, norms, SwiGLU MLPs, megatron-core MoE layers).

mcore keys are ``GPTModel.state_dict()`` keys at TP=PP=EP=1 (``decoder.layers.<i>.`` with the 0-based global
layer index, ``mlp.experts.local_experts.<e>.`` with the global expert index); HF keys are the checkpoint keys
that ``save_pretrained`` writes (per-expert ``mlp.experts.<e>.gate_proj.weight``, not transformers' fused
in-memory expert tensors).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from hp_megatron.convert.rules import TensorRule, identity_rule


@dataclass
class ModelPreset:
    """A megatron-core model equivalent to one HF ``config.json``.

    ``transformer_fields``: megatron ``TransformerConfig`` fields; ``mixer_fields``: fields of our mixers, declared
    by ``hp_megatron.config.HybridTransformerConfig`` (megatron's ``linear_*``, MLA's ``q_lora_rank``...,
    ``kda_gate_low_rank_dim``, ``gated_norm_zero_centered_gamma``); ``gpt_model_kwargs``:
    ``GPTModel`` keywords (vocab size, rotary embedding, tied embeddings); ``pattern``: one layer symbol per layer
    (``G`` GDN, ``K`` KDA, ``M`` MLA, ``A`` attention); ``qk_layernorm``: the spec option for ``A`` layers.
    A declaration only: ``hp_megatron.models.build`` makes its config, layer spec and ``GPTModel``.
    """

    model_type: str
    pattern: str
    transformer_fields: dict
    mixer_fields: dict = field(default_factory=dict)
    gpt_model_kwargs: dict = field(default_factory=dict)
    qk_layernorm: bool = False
    mtp_symbol: str | None = None   # the kind of the multi-token-prediction layers (DeepSeek-V3 "M", Qwen3-Next "A")
    mtp_num_layers: int = 0          # the MTP depth config.json declares (the checkpoint's MTP layers)
    # position ids the model is given -> the [b, s] ones it uses, ValueError for those it cannot take (Qwen3.5:
    # equal-axis mRoPE ids [3, b, s] are text positions, multimodal ones are refused); None: taken as they are
    position_ids_map: Callable | None = None


def refuse(model_type: str, name: str, value, supported) -> None:
    raise ValueError(f"{model_type} config.json field {name}={value!r} is not supported (supported: {supported})")


def require(hf: dict, model_type: str, name: str, allowed, default=None):
    """``hf[name]`` (or ``default`` when absent) if it is in ``allowed``, else ValueError naming the field."""
    value = hf.get(name, default)
    if value not in allowed:
        refuse(model_type, name, value, allowed)
    return value


def field_of(hf: dict, model_type: str, name: str):
    """A field the architecture needs: ValueError naming it when config.json lacks it."""
    if name not in hf or hf[name] is None:
        raise ValueError(f"{model_type} config.json lacks the field {name!r}")
    return hf[name]


def rope_parameters(hf: dict) -> dict:
    """transformers 5 ``rope_parameters``, or the older top-level ``rope_theta`` / ``rope_scaling`` fields."""
    params = dict(hf.get("rope_parameters") or {})
    if not params:
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
        if "partial_rotary_factor" in hf:
            params.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def swiglu_config(hf: dict, model_type: str) -> dict:
    """Megatron fields of SwiGLU MLPs without biases (``hidden_act`` must be SiLU)."""
    require(hf, model_type, "hidden_act", ("silu", "swish"))
    return dict(gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False)


def decoder_config(hf: dict, model_type: str, eps_default: float) -> dict:
    """TransformerConfig fields every supported model shares: layers, sizes and heads, RMSNorm with ``rms_norm_eps``
    (``eps_default``, the transformers class's default, where config.json leaves it out), no dropout, SwiGLU."""
    heads = field_of(hf, model_type, "num_attention_heads")
    return dict(num_layers=hf["num_hidden_layers"], hidden_size=field_of(hf, model_type, "hidden_size"),
                ffn_hidden_size=field_of(hf, model_type, "intermediate_size"), num_attention_heads=heads,
                normalization="RMSNorm", layernorm_epsilon=hf.get("rms_norm_eps", eps_default), hidden_dropout=0.0,
                attention_dropout=0.0, **swiglu_config(hf, model_type))


def moe_router_config(model_type: str, *, num_experts: int, topk: int, norm_topk_prob: bool,
                      score_function: str, scaling_factor, expert_bias: bool, num_groups=None, group_topk=None) -> dict:
    """megatron-core router fields reproducing an HF router (no auxiliary loss: transformers' CausalLM loss has
    none unless ``output_router_logits``)."""
    if score_function == "sigmoid" and not norm_topk_prob and topk > 1:
        raise ValueError(f"{model_type}: a sigmoid router without norm_topk_prob has no megatron-core "
                         "counterpart (megatron renormalizes the top-k sigmoid scores)")
    fields = dict(num_moe_experts=num_experts, moe_router_topk=topk, moe_router_score_function=score_function,
                  moe_router_pre_softmax=score_function == "softmax" and not norm_topk_prob,
                  moe_router_enable_expert_bias=expert_bias, moe_router_load_balancing_type="none",
                  moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False)
    if scaling_factor not in (None, 1, 1.0):
        fields["moe_router_topk_scaling_factor"] = float(scaling_factor)
    if num_groups not in (None, 1):
        if topk % group_topk or topk // group_topk != 2:
            # transformers scores a group by its top-2 experts; megatron by its top-(topk / group_topk)
            raise ValueError(f"{model_type}: grouped routing needs num_experts_per_tok / topk_group == 2 (the "
                             f"group score of transformers), got {topk} / {group_topk}")
        fields.update(moe_router_num_groups=num_groups, moe_router_group_topk=group_topk)
    return fields


def first_of(hf: dict, *names, default=None):
    """The first of ``names`` config.json sets (transformers' attribute maps spell fields two ways)."""
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    return default


def grouped_sigmoid_moe_config(hf: dict, model_type: str, flags: list) -> dict:
    """The MoE config fields of Kimi Linear's and Ling 3.0's routing (sigmoid scores with expert bias, grouped top-k,
    routed scaling, shared experts) for the MoE layers ``flags`` marks (one bool per layer); ``{}`` without any."""
    if not any(flags):
        return {}
    config = moe_router_config(model_type, num_experts=first_of(hf, "num_experts", "num_local_experts"),
                               topk=first_of(hf, "num_experts_per_token", "num_experts_per_tok"),
                               norm_topk_prob=first_of(hf, "moe_renormalize", "norm_topk_prob", default=True),
                               score_function="sigmoid", scaling_factor=hf.get("routed_scaling_factor"),
                               expert_bias=True, num_groups=first_of(hf, "num_expert_group", "n_group"),
                               group_topk=hf.get("topk_group"))
    config.update(moe_layer_freq=[int(f) for f in flags],
                  moe_ffn_hidden_size=field_of(hf, model_type, "moe_intermediate_size"))
    shared = first_of(hf, "num_shared_experts", "n_shared_experts", default=0)
    if shared:
        config["moe_shared_expert_intermediate_size"] = shared * hf["moe_intermediate_size"]
    return config


def layer_prefix(i: int) -> str:
    return f"decoder.layers.{i}."


def swiglu_fc1_rule(mcore_key: str, gate_key: str, up_key: str) -> TensorRule:
    """megatron's fused SwiGLU ``linear_fc1`` rows ``[gate; up]`` at TP=1."""
    return TensorRule(mcore_key, (gate_key, up_key), lambda ts: torch.cat(ts, 0),
                      lambda t: tuple(t.chunk(2, 0)))


def mlp_rules(mcore: str, hf: str) -> list[TensorRule]:
    """A SwiGLU MLP (``gate_proj``/``up_proj``/``down_proj``) as megatron's ``linear_fc1``/``linear_fc2``."""
    return [swiglu_fc1_rule(mcore + "linear_fc1.weight", hf + "gate_proj.weight", hf + "up_proj.weight"),
            identity_rule(mcore + "linear_fc2.weight", hf + "down_proj.weight")]


def moe_rules(mcore: str, hf: str, num_experts: int, *, router: str, shared: str | None, expert_bias: str | None = None,
              shared_gate: str | None = None) -> list[TensorRule]:
    """megatron-core ``MoELayer`` (router, SequentialMLP experts, shared experts) from HF keys under ``hf``."""
    rules = [identity_rule(mcore + "router.weight", hf + router)]
    if expert_bias is not None:
        rules.append(identity_rule(mcore + "router.expert_bias", hf + expert_bias))
    for e in range(num_experts):
        rules += mlp_rules(f"{mcore}experts.local_experts.{e}.", f"{hf}experts.{e}.")
    if shared is not None:
        rules += mlp_rules(mcore + "shared_experts.", hf + shared)
    if shared_gate is not None:
        rules.append(identity_rule(mcore + "shared_experts.gate_weight", hf + shared_gate))
    return rules


def model_rules(tied: bool) -> list[TensorRule]:
    """Embedding, final norm and output layer (``lm_head``; none when the embeddings are tied)."""
    rules = [identity_rule("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
             identity_rule("decoder.final_layernorm.weight", "model.norm.weight")]
    if not tied:
        rules.append(identity_rule("output_layer.weight", "lm_head.weight"))
    return rules


def layer_norm_rules(i: int) -> list[TensorRule]:
    return norm_rules(layer_prefix(i), f"model.layers.{i}.")


def norm_rules(mcore: str, hf: str) -> list[TensorRule]:
    """A decoder layer's two norms (megatron ``input_layernorm`` / ``pre_mlp_layernorm``) under the prefixes."""
    return [identity_rule(mcore + "input_layernorm.weight", hf + "input_layernorm.weight"),
            identity_rule(mcore + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight")]


# ---- multi-token prediction (DeepSeek-V3, Qwen3-Next) ------------------------------------------------------------
def mtp_prefix(k: int) -> str:
    """megatron-core's key prefix of MTP layer ``k`` (0-based): ``enorm``, ``hnorm``, ``eh_proj``, its transformer
    layer (:func:`mtp_layer_prefix`), ``final_layernorm``."""
    return f"mtp.layers.{k}."


def mtp_layer_prefix(k: int) -> str:
    """The key prefix of MTP layer ``k``'s transformer layer: ``mtp.layers.<k>.transformer_layer.`` (megatron-core
    0.19: ``mtp_model_layer.``, ``layers.base.megatron_compat.mtp_inner_layer_name``)."""
    from layers.base.megatron_compat import mtp_inner_layer_name

    return f"{mtp_prefix(k)}{mtp_inner_layer_name()}."


def mtp_head_rules(k: int, *, enorm: str, hnorm: str, eh_proj: str, final_norm: str) -> list[TensorRule]:
    """MTP layer ``k``'s norms and projection from the HF keys (the decoder layer's rules come separately)."""
    mcore = mtp_prefix(k)
    return [identity_rule(mcore + "enorm.weight", enorm), identity_rule(mcore + "hnorm.weight", hnorm),
            identity_rule(mcore + "eh_proj.weight", eh_proj),
            identity_rule(mcore + "final_layernorm.weight", final_norm)]


def with_duplicates(rule: TensorRule, copies: tuple) -> TensorRule:
    """``rule`` (one HF tensor) also reading ``copies``, HF tensors the checkpoint stores as exact duplicates of it
    (DeepSeek-V3's per-MTP-layer ``embed_tokens`` / ``shared_head.head``): the model keeps one tensor, the
    conversion checks the copies equal it (CheckpointError naming the first that differs) and writes them back."""
    from hp_megatron.checkpoint import CheckpointError

    if len(rule.hf_keys) != 1:
        raise ValueError(f"{rule.mcore_key}: duplicates need a one-tensor rule, got {rule.hf_keys}")
    keys = rule.hf_keys + tuple(copies)

    def to_mcore(ts):
        first = ts[0]
        for key, t in zip(keys[1:], ts[1:]):
            if t.shape != first.shape or (first.device.type != "meta" and not torch.equal(t, first)):
                raise CheckpointError(f"{key} differs from {keys[0]}; megatron's multi-token prediction shares the "
                                      f"model's tensor ({rule.mcore_key}), so the checkpoint must hold a copy of it")
        return rule.to_mcore(ts[:1])

    return TensorRule(rule.mcore_key, keys, to_mcore, lambda t: tuple(rule.to_hf(t)) * len(keys))


def check_mtp_depth(model_type: str, field_name: str, declared: int, mtp_num_layers: int) -> None:
    """The MTP depth to convert must be the checkpoint's (config.json ``field_name``)."""
    if mtp_num_layers != declared:
        raise ValueError(f"{model_type}: mtp_num_layers={mtp_num_layers} (--mtp-num-layers) but config.json declares "
                         f"{field_name}={declared}; the conversion keeps the checkpoint's MTP layers, all of them")


def layer_mlp_rules(i: int, is_moe: bool, num_experts: int, **moe_keys) -> list[TensorRule]:
    mcore, hf = layer_prefix(i) + "mlp.", f"model.layers.{i}.mlp."
    return moe_rules(mcore, hf, num_experts, **moe_keys) if is_moe else mlp_rules(mcore, hf)


# ---- MLA (DeepSeek-V3, Kimi Linear) -------------------------------------------------------------------------
MLA_ROPE_KEYS = {"rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                 "mscale", "mscale_all_dim"}


def mla_fields(hf: dict, model_type: str, rope_type: str, rope: dict) -> dict:
    """Our MLA layers' config attributes (``MLATransformerConfig`` names) from an HF MLA config."""
    unknown = sorted(set(rope) - MLA_ROPE_KEYS)
    if unknown:
        refuse(model_type, "rope_parameters", {k: rope[k] for k in unknown}, sorted(MLA_ROPE_KEYS))
    fields = dict(q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=field_of(hf, model_type, "kv_lora_rank"),
                  qk_head_dim=field_of(hf, model_type, "qk_nope_head_dim"),
                  qk_pos_emb_head_dim=field_of(hf, model_type, "qk_rope_head_dim"),
                  v_head_dim=field_of(hf, model_type, "v_head_dim"), rope_type=rope_type,
                  rotary_base=float(rope.get("rope_theta", 10000.0)), rotary_percent=1.0,
                  rotary_scaling_factor=float(rope.get("factor", 1.0)),
                  original_max_position_embeddings=int(rope.get("original_max_position_embeddings",
                                                                hf.get("max_position_embeddings", 4096))),
                  beta_fast=float(rope.get("beta_fast", 32.0)), beta_slow=float(rope.get("beta_slow", 1.0)),
                  mscale=float(rope.get("mscale", 1.0)),
                  # transformers scales the softmax by YaRN's mscale only for YaRN; megatron whenever it is set
                  mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)) if rope_type == "yarn" else 0.0)
    return fields


def mla_rules(mcore: str, hf: str, mixer_fields: dict, heads: int, *, rope_interleave: bool) -> list[TensorRule]:
    """``layers.mixers.mla.layer.MultiLatentAttention`` from ``DeepseekV3Attention`` / ``KimiLinearAttention`` tensors
    (``layers.mixers.mla.layer``'s name map; rotary rows permuted when transformers' layout is half-split)."""
    from types import SimpleNamespace

    from layers.mixers.mla.layer import HF_TO_MLA, mla_state_dict_from_hf, mla_state_dict_to_hf

    dims = SimpleNamespace(num_attention_heads=heads, qk_head_dim=mixer_fields["qk_head_dim"],
                           qk_pos_emb_head_dim=mixer_fields["qk_pos_emb_head_dim"])
    if mixer_fields["q_lora_rank"] is None:
        names = ("q_proj.weight",)
    else:
        names = ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight")
    names += ("kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight")

    def rule(hf_name):
        ours = HF_TO_MLA[hf_name]
        return TensorRule(mcore + ours, (hf + hf_name,),
                          lambda ts: mla_state_dict_from_hf({hf_name: ts[0]}, dims,
                                                            rope_interleave=rope_interleave)[ours],
                          lambda t: (mla_state_dict_to_hf({ours: t}, dims, rope_interleave=rope_interleave)[hf_name],))

    return [rule(name) for name in names]
