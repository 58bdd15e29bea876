"""Public decode-step ops: one token per sequence through a cached state, updated in place (inference).

``delta_rule_step(kind, q, k, v, g, beta, state, ...)`` is one step of the recurrence that
:func:`layers.ops.chunk_gated_delta_rule` / :func:`layers.ops.chunk_kda` run chunked: q, k ``[N,1,H,K]``,
v ``[N,1,HV,V]``, g ``[N,1,HV]`` (GDN) or ``[N,1,HV,K]`` (KDA), beta ``[N,1,HV]``, ``state [N,HV,K,V]`` fp32 (the
final state of the chunked op) -> o ``[N,1,HV,V]`` in q's dtype; ``state`` then holds the state after the token.

``causal_conv1d_step(x, history, weight, ...)``: x ``[N,1,D]``, history ``[N,W-1,D]`` (the W-1 previous inputs,
oldest first, as :func:`layers.ops.causal_conv1d` takes it) -> y ``[N,1,D]``; ``history`` is shifted by one
token in place.

Backends: eager (vectorized over sequences and heads), triton (FLA's ``fused_recurrent_*`` and
``causal_conv1d_update``), ascendc (fla-npu's ``recurrent_gated_delta_rule`` / ``recurrent_kda``; the conv step
is the eager one). A backend without steps raises RuntimeError (:func:`check_decode_backend`).
"""
from __future__ import annotations

import torch

from layers.ops.backends import get_backend
from layers.ops.delta_rule import _validate
from layers.ops.kinds import delta_kind
from layers.ops.validation import check_same_device, check_shape, check_tensor


def check_decode_backend(backend: str):
    """The backend module if it has decode steps, else RuntimeError naming what is missing."""
    impl = get_backend(backend)
    if getattr(impl, "delta_rule_step", None) is None:
        raise RuntimeError(getattr(impl, "NO_DECODE_STEP", f"backend={backend!r} has no decode-step kernels"))
    return impl


def _check_state(kind, state, N, HV, K, V):
    if not isinstance(state, torch.Tensor) or state.dtype != torch.float32:
        raise TypeError(f"state must be a float32 tensor [N={N}, HV={HV}, K={K}, V={V}] (updated in place), got "
                        f"{getattr(state, 'dtype', type(state).__name__)}")
    check_shape("state", state, kind.state_shape(N, HV, K, V))


def delta_rule_step(kind, q, k, v, g, beta, state, *, scale=None, use_qk_l2norm_in_kernel=False,
                    use_beta_sigmoid_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                    lower_bound=None, safe_gate=False, backend="eager"):
    """One decode token of the delta-rule ``kind`` (a name of ``layers.ops.kinds``: ``"gdn"``, ``"kda"``); the flags
    mean what they mean for the chunked ops (``safe_gate`` only selects a kernel path of FLA's chunked KDA: no effect
    here)."""
    kind = delta_kind(kind)
    if q.ndim == 4 and q.shape[1] != 1:
        raise ValueError(f"a decode step takes one token per sequence: q [N, 1, H, K], got {tuple(q.shape)}")
    _validate(kind, q, k, v, g, beta, scale, None, True, use_gate_in_kernel, A_log, dt_bias, None, None,
              lower_bound=lower_bound, safe_gate=safe_gate)
    N, _, H, K = q.shape
    _check_state(kind, state, N, v.shape[2], K, v.shape[3])
    check_same_device(q=q, state=state)
    impl = check_decode_backend(backend)
    return impl.delta_rule_step(kind, q, k, v, g, beta, state, scale=K ** -0.5 if scale is None else float(scale),
                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                                use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                                lower_bound=lower_bound)


def causal_conv1d_step(x, history, weight, bias=None, activation=None, backend="eager"):
    """One decode token of the depthwise causal conv (see module doc); ``history`` is updated in place."""
    check_tensor("x", x, ndim=3)
    N, T, D = x.shape
    if T != 1:
        raise ValueError(f"a decode step takes one token per sequence: x [N, 1, D], got {tuple(x.shape)}")
    check_tensor("weight", weight, ndim=2)
    check_shape("weight", weight, (D, weight.shape[1]))
    W = weight.shape[1]
    check_tensor("history", history, ndim=3)
    check_shape("history", history, (N, W - 1, D))
    if bias is not None:
        check_shape("bias", bias, (D,))
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    check_same_device(x=x, history=history, weight=weight, bias=bias)
    impl = check_decode_backend(backend)
    return impl.causal_conv1d_step(x, history, weight, bias=bias, activation=activation)
