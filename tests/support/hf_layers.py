"""Weight conversion between transformers' single layers and ours (GDN <-> Qwen3-Next, KDA <-> Kimi Linear), for the
tests and benchmarks that compare our layers with transformers' (the model converter, ``hp_megatron.convert``,
has its own rules in ``hp_megatron/models``).

Our side is the dict of *global logical tensors* of a layer (``layer.global_part_names()``: fused parameters
split into their parts, e.g. ``in_proj.weight.query``), which ``layer.load_global_parts(...)`` loads under any
tensor-parallel size and ``layer.global_parts()`` gathers back; the same names are the keys of our
``dist_checkpointing`` checkpoints. The transformers side is the state dict of one mixer module
(``Qwen3NextGatedDeltaNet`` / ``KimiLinearDeltaAttention``), keys relative to it, optionally under ``prefix``.

The ``*_dims_from_*_config`` helpers return the head counts and sizes as the keyword options our layers take
(``GatedDeltaNet(config, submodules, **dims)`` or ``ModuleSpec(params=dims)``).
"""
from __future__ import annotations

import torch

from hp_megatron.models.qwen3_next import (GDN_IN_PROJ_PARTS, gdn_head_groups, join_qwen3_next_in_proj,
                                           split_qwen3_next_in_proj)


def gdn_dims_from_qwen3_next_config(hf_config) -> dict:
    """Our GDN options from a ``Qwen3NextConfig``."""
    return dict(num_key_heads=hf_config.linear_num_key_heads, num_value_heads=hf_config.linear_num_value_heads,
                key_head_dim=hf_config.linear_key_head_dim, value_head_dim=hf_config.linear_value_head_dim,
                conv_kernel_dim=hf_config.linear_conv_kernel_dim, norm_eps=hf_config.rms_norm_eps)


def kda_dims_from_kimi_linear_config(hf_config) -> dict:
    """Our KDA options from a ``KimiLinearConfig`` (Kimi Linear: no GVA, K = V = head_dim, gate rank = head_dim)."""
    heads, dim = hf_config.linear_num_heads, hf_config.linear_head_dim
    return dict(num_key_heads=heads, num_value_heads=heads, key_head_dim=dim, value_head_dim=dim,
                gate_low_rank_dim=dim, conv_kernel_dim=hf_config.linear_conv_kernel_dim,
                norm_eps=hf_config.rms_norm_eps)


def _take(state_dict, prefix, key, shape):
    full = prefix + key
    if full not in state_dict:
        raise KeyError(f"missing {full!r} in the state dict (have {sorted(state_dict)[:8]}...)")
    t = state_dict[full]
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{full} must have shape {tuple(shape)} for the given dims, got {tuple(t.shape)}")
    return t


def gdn_from_qwen3_next(hf_state_dict: dict, *, num_key_heads: int, num_value_heads: int, key_head_dim: int,
                        value_head_dim: int, prefix: str = "", **_unused) -> dict:
    """``Qwen3NextGatedDeltaNet`` state dict -> our GDN global parts.

    Qwen3-Next groups its fused projections per key head: ``in_proj_qkvz`` rows are, for each key head,
    ``[q (K), k (K), v (r*V), z (r*V)]`` and ``in_proj_ba`` rows ``[b (r), a (r)]`` with r = HV/H.
    """
    H, HV, K, V, r = gdn_head_groups(num_key_heads, num_value_heads, key_head_dim, value_head_dim)
    qkvz = hf_state_dict[prefix + "in_proj_qkvz.weight"]
    hidden = qkvz.shape[1]
    qkvz = _take(hf_state_dict, prefix, "in_proj_qkvz.weight", (H * (2 * K + 2 * r * V), hidden))
    ba = _take(hf_state_dict, prefix, "in_proj_ba.weight", (2 * HV, hidden))
    q, k, v, z, b, a = split_qwen3_next_in_proj(qkvz, ba, num_key_heads, num_value_heads, key_head_dim,
                                                value_head_dim)
    conv = hf_state_dict[prefix + "conv1d.weight"]
    conv = _take(hf_state_dict, prefix, "conv1d.weight", (2 * H * K + HV * V, 1, conv.shape[-1]))
    conv_q, conv_k, conv_v = conv.split([H * K, H * K, HV * V], dim=0)
    return {
        "in_proj.weight.query": q.clone(), "in_proj.weight.key": k.clone(), "in_proj.weight.value": v.clone(),
        "in_proj.weight.z": z.clone(), "in_proj.weight.beta": b.clone(), "in_proj.weight.alpha": a.clone(),
        "conv1d.weight.query": conv_q.clone(),
        "conv1d.weight.key": conv_k.clone(),
        "conv1d.weight.value": conv_v.clone(),
        "A_log": _take(hf_state_dict, prefix, "A_log", (HV,)).clone(),
        "dt_bias": _take(hf_state_dict, prefix, "dt_bias", (HV,)).clone(),
        "out_norm.weight": _take(hf_state_dict, prefix, "norm.weight", (V,)).clone(),
        "out_proj.weight": _take(hf_state_dict, prefix, "out_proj.weight", (hidden, HV * V)).clone(),
    }


def gdn_to_qwen3_next(parts: dict, *, num_key_heads: int, num_value_heads: int, key_head_dim: int,
                      value_head_dim: int, prefix: str = "", **_unused) -> dict:
    """Our GDN global parts -> ``Qwen3NextGatedDeltaNet`` state dict (inverse of :func:`gdn_from_qwen3_next`)."""
    qkvz, ba = join_qwen3_next_in_proj(*(parts[f"in_proj.weight.{n}"] for n in GDN_IN_PROJ_PARTS),
                                       num_key_heads, num_value_heads, key_head_dim, value_head_dim)
    conv = torch.cat([parts["conv1d.weight.query"], parts["conv1d.weight.key"], parts["conv1d.weight.value"]])
    out = {
        "in_proj_qkvz.weight": qkvz, "in_proj_ba.weight": ba,
        "conv1d.weight": conv,
        "A_log": parts["A_log"], "dt_bias": parts["dt_bias"],
        "norm.weight": parts["out_norm.weight"], "out_proj.weight": parts["out_proj.weight"],
    }
    return {prefix + k: v.clone() for k, v in out.items()}


def kda_from_kimi_linear(hf_state_dict: dict, *, num_key_heads: int, key_head_dim: int, prefix: str = "",
                         **_unused) -> dict:
    """``KimiLinearDeltaAttention`` state dict -> our KDA global parts (H = HV heads of size K = V)."""
    H, K = num_key_heads, key_head_dim
    q = hf_state_dict[prefix + "q_proj.weight"]
    hidden = q.shape[1]
    take = lambda key, shape: _take(hf_state_dict, prefix, key, shape)  # noqa: E731
    conv = hf_state_dict[prefix + "conv1d.weight"]
    conv_q, conv_k, conv_v = take("conv1d.weight", (3 * H * K, 1, conv.shape[-1])).split(H * K, dim=0)
    return {
        "in_proj.weight.query": take("q_proj.weight", (H * K, hidden)).clone(),
        "in_proj.weight.key": take("k_proj.weight", (H * K, hidden)).clone(),
        "in_proj.weight.value": take("v_proj.weight", (H * K, hidden)).clone(),
        "in_proj.weight.beta": take("b_proj.weight", (H, hidden)).clone(),
        "conv1d.weight.query": conv_q.clone(),
        "conv1d.weight.key": conv_k.clone(),
        "conv1d.weight.value": conv_v.clone(),
        "gate_down_proj.weight.forget": take("forget_gate.f_a_proj.weight", (K, hidden)).clone(),
        "gate_down_proj.weight.output": take("g_a_proj.weight", (K, hidden)).clone(),
        "forget_gate_up_proj.weight": take("forget_gate.f_b_proj.weight", (H * K, K)).clone(),
        "output_gate_up_proj.weight": take("g_b_proj.weight", (H * K, K)).clone(),
        "A_log": take("forget_gate.A_log", (1, 1, H, 1)).reshape(H).clone(),
        "dt_bias": take("forget_gate.dt_bias", (H * K,)).clone(),
        "out_norm.weight": take("o_norm.weight", (K,)).clone(),
        "out_proj.weight": take("o_proj.weight", (hidden, H * K)).clone(),
    }


def kda_to_kimi_linear(parts: dict, *, num_key_heads: int, key_head_dim: int, prefix: str = "",
                       **_unused) -> dict:
    """Our KDA global parts -> ``KimiLinearDeltaAttention`` state dict (inverse of :func:`kda_from_kimi_linear`)."""
    H = num_key_heads
    if "output_gate_up_proj.bias" in parts:
        raise ValueError("Kimi Linear's g_b_proj has no bias; this layer was built with output_gate_bias=True")
    conv = torch.cat([parts["conv1d.weight.query"], parts["conv1d.weight.key"], parts["conv1d.weight.value"]])
    out = {
        "q_proj.weight": parts["in_proj.weight.query"], "k_proj.weight": parts["in_proj.weight.key"],
        "v_proj.weight": parts["in_proj.weight.value"], "b_proj.weight": parts["in_proj.weight.beta"],
        "conv1d.weight": conv,
        "forget_gate.f_a_proj.weight": parts["gate_down_proj.weight.forget"],
        "forget_gate.f_b_proj.weight": parts["forget_gate_up_proj.weight"],
        "forget_gate.A_log": parts["A_log"].reshape(1, 1, H, 1),
        "forget_gate.dt_bias": parts["dt_bias"],
        "g_a_proj.weight": parts["gate_down_proj.weight.output"],
        "g_b_proj.weight": parts["output_gate_up_proj.weight"],
        "o_norm.weight": parts["out_norm.weight"], "o_proj.weight": parts["out_proj.weight"],
    }
    return {prefix + k: v.clone() for k, v in out.items()}
