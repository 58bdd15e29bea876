"""Public short (depthwise causal) convolution op: validation, then one dispatch to a backend or the CP halo.

y[t, d] = act(bias_d + sum_{i<W} weight[d, i] * x[t - W + 1 + i, d]) with zero history at each sequence
start, or the W-1 tokens of ``history`` before it. x ``[B,T,D]``; weight ``[D,W]`` (a ``nn.Conv1d`` weight
``[D,1,W]`` squeezed); bias ``[D]``; packed documents via ``cu_seqlens`` ``[N+1]`` (B == 1); history
``[N, W-1, D]`` with N = B, or the number of documents when packed. Output in x's dtype.
"""
from __future__ import annotations

from layers.ops.backends import get_backend
from layers.ops.validation import check_same_device, check_shape, check_tensor, normalize_cu_seqlens

ACTIVATIONS = (None, "silu", "swish")


def _validate(x, weight, bias, activation, cu_seqlens, history, cp_context):
    check_tensor("x", x, ndim=3)
    B, T, D = x.shape
    check_tensor("weight", weight)
    if weight.ndim != 2:
        raise ValueError(f"weight must have shape [D, W] = [{D}, W] (squeeze a Conv1d weight [D, 1, W] with "
                         f".squeeze(1)), got shape {tuple(weight.shape)}")
    if weight.shape[0] != D:
        raise ValueError(f"weight must have D={D} rows (one filter per channel of x {tuple(x.shape)}), "
                         f"got shape {tuple(weight.shape)}")
    W = weight.shape[1]
    if W < 1:
        raise ValueError(f"kernel size W must be >= 1, got weight shape {tuple(weight.shape)}")
    if bias is not None:
        check_tensor("bias", bias)
        check_shape("bias", bias, (D,))
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    check_same_device(x=x, weight=weight, bias=bias, history=history)
    if cp_context is not None:
        if history is not None:
            raise ValueError("cp_context does not take history (the CP halo supplies the W-1 tokens before each "
                             "local piece); got history of shape " f"{tuple(history.shape)}")
        if cu_seqlens is not None:
            raise ValueError("with cp_context pass cu_seqlens=None: the context holds the global packed "
                             f"boundaries (build_cp_context(..., cu_seqlens=...)); got cu_seqlens={cu_seqlens!r}")
        return None
    cu = normalize_cu_seqlens(cu_seqlens, B, T)
    if history is not None:
        check_tensor("history", history, ndim=3)
        N = B if cu is None else cu.numel() - 1
        if tuple(history.shape) != (N, W - 1, D):
            raise ValueError(f"history must have shape [N, W-1, D] = [{N}, {W - 1}, {D}] (N = "
                             f"{'number of documents in cu_seqlens' if cu is not None else 'batch size B'}), "
                             f"got {tuple(history.shape)}")
    return cu


def causal_conv1d(x, weight, bias=None, activation=None, cu_seqlens=None, history=None, cp_context=None,
                  backend="eager"):
    """Depthwise causal convolution ``[B,T,D] -> [B,T,D]``, optionally followed by SiLU.

    ``history`` (gradients flow into it) replaces the zero left padding of each sequence. ``cp_context``
    (from ``layers.cp.build_cp_context``, any method) runs the op on this rank's shard: the W-1 tokens that
    precede each local piece in chain order are fetched from their owners (the halo) and gradients return.
    """
    cu = _validate(x, weight, bias, activation, cu_seqlens, history, cp_context)
    impl = get_backend(backend)
    if cp_context is not None:   # the context (built by layers.cp) carries the halo exchange
        return cp_context.causal_conv1d(impl, x, weight, bias=bias, activation=activation)
    return impl.causal_conv1d(x, weight, bias=bias, activation=activation, cu_seqlens=cu, history=history)
