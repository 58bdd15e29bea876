"""Decode steps on fla-npu's recurrent Ascend C kernels (backend interface; inputs validated by layers/ops/step.py).

GDN: ``recurrent_gated_delta_rule`` (exported since fla-npu 8a63cf3e, 2026-08-13). It takes q/k ``[T,H,K]``,
v ``[T,HV,V]`` and beta ``[T,HV]`` in bf16, the decay as a natural-log gate ``g`` fp32 ``[T,HV]``, a V-first
state pool ``[blocks,HV,V,K]`` (bf16 or fp32) updated in place, ``actual_seq_lengths`` int32 = (start offset,
L_1, ..., L_N) and ``ssm_state_indices`` int32 ``[T]``, and has no in-kernel L2 norm, gate or sigmoid. So the
q/k L2 norm, the beta sigmoid and the GDN gate run here in fp32 (q, k and beta are then rounded to bf16 once,
where the eager step keeps fp32), one token per sequence goes as ``actual_seq_lengths = [0, 1, ..., 1]``,
``ssm_state_indices = arange(N)``, and our K-first fp32 cache ``[N,HV,K,V]`` travels as a V-first fp32 copy
(two ``[N,HV,K,V]`` copies per step: CANN before 9.1.0 takes no strided state). K = V = 128.

KDA: ``recurrent_kda`` (BSND, ``state_v_first=False``: our cache layout, updated in place, no copy) with the
in-kernel L2 norm and beta sigmoid, and the in-kernel gate where its form is ours (A_log given; the sigmoid form
with ``safe_gate`` and ``lower_bound`` in [-5, 0), else the softplus form); any other gate runs here in fp32.
K = 128, V in (128, 256).

Both kernels take ``cu_seqlens`` / ``actual_seq_lengths`` as device tensors; they are built once per (N, device).
The short-conv step is the eager backend's PyTorch step on the NPU tensors, as the chunked conv is
(``layers/ops/ascendc/backend.py``).
"""
from __future__ import annotations

from functools import lru_cache

import torch

from layers.ops.ascendc import runtime
from layers.ops.ascendc.kda import kernel_gate_matches
from layers.ops.gates import gdn_gate, kda_gate, l2norm
from layers.ops.kinds import GDN, KDA, delta_kind


@lru_cache(maxsize=64)
def _decode_indices(n: int, device: str):
    """(sequence boundaries [0, 1, ..., n], actual_seq_lengths [0, 1, ..., 1], state indices [0 .. n-1]), int32."""
    cu = torch.arange(n + 1, dtype=torch.int32, device=device)
    lengths = torch.ones(n + 1, dtype=torch.int32, device=device)
    lengths[0] = 0
    return cu, lengths, torch.arange(n, dtype=torch.int32, device=device)


def _check_gdn_step(q, v, device_name: str) -> None:
    K, V, HV = q.shape[-1], v.shape[-1], v.shape[2]
    if K != 128 or V != 128 or HV > 256:
        raise ValueError(f"backend='ascendc' GDN decode (recurrent_gated_delta_rule) on {device_name} supports "
                         f"K = V = 128 and HV <= 256, got K={K}, V={V}, HV={HV}")


def _check_kda_step(q, v, device_name: str) -> None:
    K, V = q.shape[-1], v.shape[-1]
    if K != 128 or V not in (128, 256):
        raise ValueError(f"backend='ascendc' KDA decode (recurrent_kda) on {device_name} supports K = 128 and V in "
                         f"(128, 256), got K={K}, V={V}")


def _gdn_step(op, q, k, v, g, beta, state, *, scale, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
              use_gate_in_kernel, A_log, dt_bias):
    N = q.shape[0]
    qs, ks, b, gate = q[:, 0].float(), k[:, 0].float(), beta[:, 0].float(), g[:, 0].float()
    if use_qk_l2norm_in_kernel:
        qs, ks = l2norm(qs), l2norm(ks)
    if use_beta_sigmoid_in_kernel:
        b = torch.sigmoid(b)
    if use_gate_in_kernel:
        gate = gdn_gate(gate, A_log, dt_bias)
    _, lengths, index = _decode_indices(N, str(q.device))
    pool = state.transpose(-1, -2).contiguous()                      # V-first [N, HV, V, K] fp32
    o = op(qs.to(q.dtype), ks.to(q.dtype), v[:, 0].contiguous(), pool, beta=b.to(q.dtype), scale=float(scale),
           actual_seq_lengths=lengths, ssm_state_indices=index, g=gate.contiguous())
    state.copy_(pool.transpose(-1, -2))
    return o[:, None]


def _kda_step(op, q, k, v, g, beta, state, *, scale, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
              use_gate_in_kernel, A_log, dt_bias, lower_bound):
    in_kernel = use_gate_in_kernel and kernel_gate_matches(A_log, lower_bound, lower_bound is not None)
    if use_gate_in_kernel and not in_kernel:
        g = kda_gate(g.float(), A_log, dt_bias, lower_bound)
    cu, _, _ = _decode_indices(q.shape[0], str(q.device))
    gate = dict(A_log=A_log.float(), dt_bias=None if dt_bias is None else dt_bias.float(),
                safe_gate=lower_bound is not None, lower_bound=lower_bound) if in_kernel else {}
    o, _ = runtime.slots("recurrent_kda", op(
        q, k, v, g, beta, state, cu_seqlens=cu, layout="BSND", scale=float(scale), output_final_state=False,
        inplace_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, state_v_first=False, **gate), 2, (0,))
    return o


# per kind: (shape limits of its recurrent kernel, the adapter calling it with the op of ``kernels["ascendc"]["step"]``)
STEPS = {GDN: (_check_gdn_step, _gdn_step), KDA: (_check_kda_step, _kda_step)}


def delta_rule_step(kind, q, k, v, g, beta, state, *, scale, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                    use_gate_in_kernel, A_log, dt_bias, lower_bound=None):
    """One token through fla-npu's recurrent kernel; ``state`` [N,HV,K,V] fp32 updated in place -> o [N,1,HV,V]."""
    kind = delta_kind(kind)
    check, step = kind.pick(STEPS, "backend='ascendc' decode")
    runtime.check_dtype(kind.kernel("ascendc", "api"), q=q, k=k, v=v)
    device_name = runtime.soc(q.device)
    check(q, v, device_name)
    op = runtime.op(runtime.require_api(kind.kernel("ascendc", "step_api")), kind.kernel("ascendc", "step"))
    flags = dict(scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                 use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                 A_log=A_log, dt_bias=dt_bias)
    if kind.lower_bound_gate:
        flags["lower_bound"] = lower_bound
    with torch.no_grad():
        return step(op, q, k, v, g, beta, state, **flags)


def causal_conv1d_step(x, history, weight, *, bias=None, activation=None):
    """The eager backend's conv step on the NPU tensors (fla-npu's conv update op is not used; module doc)."""
    from layers.ops.backends import get_backend

    return get_backend("eager").causal_conv1d_step(x, history, weight, bias=bias, activation=activation)
