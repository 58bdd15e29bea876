"""Public GDN and KDA ops: validation, then one dispatch to a backend or to the CP engine.

Contract (flash-linear-attention 0.6): q, k ``[B,T,H,K]``; v ``[B,T,HV,V]`` with HV % H == 0 (value head
i reads q/k head ``i // (HV // H)``); beta ``[B,T,HV]``; g natural-log decay ``[B,T,HV]`` (GDN) or
``[B,T,HV,K]`` (KDA); states ``[N,HV,K,V]`` fp32 with N = B, or the number of documents when
``cu_seqlens`` (``[N+1]``, B == 1) packs documents. Returns ``(o [B,T,HV,V] in q.dtype, final_state)``.
In-kernel gate parameters: A_log ``[HV]``; dt_bias ``[HV]`` (GDN) or ``[HV*K]`` (KDA). Table: docs/layers.md.
"""
from __future__ import annotations

import math

from layers.ops.backends import get_backend
from layers.ops.kinds import GDN, KDA, delta_kind
from layers.ops.validation import (check_same_device, check_shape, check_state, check_tensor,
                                   normalize_cu_seqlens)


def _check_flags(**flags):
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")


def _validate(kind, q, k, v, g, beta, scale, initial_state, output_final_state, use_gate_in_kernel,
              A_log, dt_bias, cu_seqlens, cp_context, lower_bound=None, safe_gate=False):
    """Checks of the op contract for ``kind`` (a ``layers.ops.kinds.DeltaKind``) -> normalized cu_seqlens."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, ndim=4)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if min(B, T, H, K, HV, V) < 1:
        raise ValueError(f"q [B,T,H,K] and v [B,T,HV,V] need every size >= 1, got q {tuple(q.shape)}, "
                         f"v {tuple(v.shape)}")
    check_shape("k", k, (B, T, H, K))
    if v.shape[:2] != (B, T):
        raise ValueError(f"v must have shape [B={B}, T={T}, HV, V], got {tuple(v.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if HV % H != 0:
        raise ValueError(f"value heads HV={HV} must be a multiple of query/key heads H={H}")
    check_tensor("g", g)
    check_shape("g", g, (B, T) + kind.gate_shape(HV, K))
    check_tensor("beta", beta)
    check_shape("beta", beta, (B, T, HV))
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool)
                              or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"scale must be a positive finite number or None, got {scale!r}")
    _check_flags(output_final_state=output_final_state, use_gate_in_kernel=use_gate_in_kernel, safe_gate=safe_gate)
    if use_gate_in_kernel:
        if A_log is None and (lower_bound is None or not kind.lower_bound_gate):
            raise ValueError(f"use_gate_in_kernel=True for {kind.label} requires A_log of shape [HV]"
                             + (" (or lower_bound)" if kind.lower_bound_gate else ""))
        if A_log is not None:
            check_tensor("A_log", A_log)
            check_shape("A_log", A_log, (HV,))
        if dt_bias is not None:
            check_tensor("dt_bias", dt_bias)
            check_shape("dt_bias", dt_bias, kind.dt_bias_shape(HV, K))
    elif A_log is not None or dt_bias is not None:
        raise ValueError("A_log/dt_bias are only used with use_gate_in_kernel=True; got them with False")
    if not kind.lower_bound_gate:
        if lower_bound is not None or safe_gate:
            raise ValueError(f"{kind.label} has no lower_bound gate: lower_bound must be None and safe_gate False, "
                             f"got {lower_bound!r}, {safe_gate!r}")
    else:
        if lower_bound is not None:
            if (not isinstance(lower_bound, (int, float)) or isinstance(lower_bound, bool)
                    or not math.isfinite(lower_bound) or lower_bound >= 0):
                raise ValueError(f"lower_bound must be a negative finite number or None, got {lower_bound!r}")
            if not use_gate_in_kernel:
                raise ValueError("lower_bound requires use_gate_in_kernel=True")
        if safe_gate and (lower_bound is None or not -5 <= lower_bound < 0):
            raise ValueError(f"safe_gate=True requires lower_bound in [-5, 0), got {lower_bound!r}")
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state)
    if cp_context is not None and cu_seqlens is not None:
        raise ValueError("with cp_context, give the GLOBAL cu_seqlens to build_cp_context and leave the op's "
                         "cu_seqlens=None (the context knows this rank's pieces)")
    cu = normalize_cu_seqlens(cu_seqlens, B, T)
    N = B if cu is None else cu.numel() - 1
    check_state("initial_state", initial_state, kind.state_shape(N, HV, K, V))
    if cp_context is not None and (initial_state is not None or output_final_state):
        raise ValueError("cp_context does not take initial_state or output_final_state (the CP engine owns "
                         f"cross-rank states); got initial_state={initial_state is not None}, "
                         f"output_final_state={output_final_state}")
    return cu


def _dispatch(kind, backend, cp_context, q, k, v, g, beta, cu, *, initial_state, output_final_state, **kw):
    impl = get_backend(backend)
    if cp_context is not None:   # the context (built by layers.cp) carries the CP engine; ops never import it
        return cp_context.delta_rule(kind, backend, q, k, v, g, beta, **kw)
    kw.update(initial_state=initial_state, output_final_state=output_final_state)
    return kind.backend_op(impl)(q, k, v, g, beta, cu_seqlens=cu, **kw)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                           use_gate_in_kernel=False, A_log=None, dt_bias=None, cu_seqlens=None,
                           cp_context=None, backend="eager"):
    """Gated delta rule: S_t = exp(g_t)(I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, o_t = scale S_t^T q_t.

    With ``use_gate_in_kernel`` g is raw and becomes ``-exp(A_log) * softplus(g + dt_bias)``; with
    ``use_beta_sigmoid_in_kernel`` beta becomes ``sigmoid(beta)``; with ``use_qk_l2norm_in_kernel`` q and k
    are divided by ``sqrt(sum x^2 + 1e-6)``. ``cp_context`` (from ``layers.cp.build_cp_context``) runs the op
    on this rank's shard of a context-parallel sequence.
    """
    _check_flags(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel)
    cu = _validate(GDN, q, k, v, g, beta, scale, initial_state, output_final_state, use_gate_in_kernel,
                   A_log, dt_bias, cu_seqlens, cp_context)
    return _dispatch(GDN, backend, cp_context, q, k, v, g, beta, cu,
                     scale=q.shape[-1] ** -0.5 if scale is None else float(scale), initial_state=initial_state,
                     output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                     A_log=A_log, dt_bias=dt_bias)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, use_gate_in_kernel=False,
              A_log=None, dt_bias=None, lower_bound=None, safe_gate=False, cu_seqlens=None, cp_context=None,
              backend="eager"):
    """Kimi delta attention: S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T.

    g is per channel ``[B,T,HV,K]``. In-kernel gate: ``-exp(A_log)[h] * softplus(g + dt_bias)`` (dt_bias
    ``[HV*K]``), or with ``lower_bound``: ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``
    (``lower_bound * sigmoid(g + dt_bias)`` when A_log is None). Other arguments as in
    :func:`chunk_gated_delta_rule`.
    """
    _check_flags(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel)
    cu = _validate(KDA, q, k, v, g, beta, scale, initial_state, output_final_state, use_gate_in_kernel,
                   A_log, dt_bias, cu_seqlens, cp_context, lower_bound=lower_bound, safe_gate=safe_gate)
    return _dispatch(KDA, backend, cp_context, q, k, v, g, beta, cu,
                     scale=q.shape[-1] ** -0.5 if scale is None else float(scale), initial_state=initial_state,
                     output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                     A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, safe_gate=safe_gate)


_OPS = {fn.__name__: fn for fn in (chunk_gated_delta_rule, chunk_kda)}


def chunk_op(kind):
    """The public chunked op of ``kind`` (a name or ``DeltaKind``): ``chunk_gated_delta_rule`` / ``chunk_kda``."""
    kind = delta_kind(kind)
    if kind.op not in _OPS:
        raise ValueError(f"layers.ops has no {kind.op} (delta-rule kind {kind.name!r})")
    return _OPS[kind.op]
