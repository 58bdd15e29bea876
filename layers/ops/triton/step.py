"""Decode steps on flash-linear-attention 0.6's fused recurrent kernels (backend interface; inputs validated).

``fused_recurrent_gated_delta_rule`` / ``fused_recurrent_kda`` run one token from the cached state (FLA returns a
new final state, copied into the cache: one ``[N,HV,K,V]`` copy per step); ``causal_conv1d_update`` rolls FLA's
conv cache ``[N, D, W]``, built from and written back to our ``[N, W-1, D]`` history (two small copies).
"""
from __future__ import annotations

from functools import lru_cache

from layers.ops.kinds import delta_kind
from layers.ops.triton.runtime import (check_inputs, check_tensor_device, history_to_fla_cache,
                                       import_fla_functions, load_fla)


@lru_cache(maxsize=None)
def _fla_function(path: str):
    """The FLA function at ``"module:attribute"`` (RuntimeError naming it if FLA lacks it)."""
    load_fla()   # versions and the interpreter flag first
    return import_fla_functions("decoding", path)[0]


def delta_rule_step(kind, q, k, v, g, beta, state, *, scale, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                    use_gate_in_kernel, A_log, dt_bias, lower_bound=None):
    """One token through FLA's fused recurrent kernel; ``state`` [N,HV,K,V] fp32 updated in place."""
    kind = delta_kind(kind)
    path = kind.kernel("triton", "step")
    check_inputs(q, k, v, g, beta)
    step = _fla_function(path)
    common = dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=state, output_final_state=True,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                  use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, use_gate_in_kernel=use_gate_in_kernel)
    gate = {"A_log": A_log, "dt_bias": dt_bias} if use_gate_in_kernel else {}
    if kind.lower_bound_gate:
        gate["lower_bound"] = lower_bound
    o, final = step(**common, **gate)
    state.copy_(final)
    return o


def causal_conv1d_step(x, history, weight, *, bias=None, activation=None):
    """One token through FLA's ``causal_conv1d_update``; ``history`` [N,W-1,D] shifted in place."""
    check_tensor_device("x", x)
    conv = _fla_function("fla.modules.causal_conv1d:causal_conv1d_update")
    cache = history_to_fla_cache(history.to(x.dtype))                     # [N, D, W]
    y, cache = conv(x=x, cache=cache, weight=weight, bias=bias, activation=activation)
    history.copy_(cache[:, :, 1:].transpose(1, 2))
    return y
