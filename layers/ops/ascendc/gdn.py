"""GDN over fla-npu's composite Ascend C kernels: ``chunk_gated_delta_rule_fwd`` (ten slots) and
``chunk_gated_delta_rule_bwd`` (eight slots), as one autograd Function.

Layouts: our token-major q/k/v ``[B,T,H,D]`` are the kernels' ``BSND`` (packed ``[1,T,H,D]`` is ``TND``),
so no copy is made; g/beta stay ``[B,T,HV]``; o comes back ``BSND``. The in-kernel gate is not supported by
the composite kernels, so ``-exp(A_log) softplus(g + dt_bias)`` runs in PyTorch before the Function (its
gradients flow through autograd); L2 norm of q/k and the beta sigmoid run inside the kernels.
"""
from __future__ import annotations

import torch

from layers.ops.ascendc import runtime
from layers.ops.gates import gdn_gate

_FWD, _BWD = "chunk_gated_delta_rule_fwd", "chunk_gated_delta_rule_bwd"


def check_gdn(q, v, device_name: str, needs_grad: bool) -> None:
    """Device and shape limits of the composite kernels (ValueError / RuntimeError naming them)."""
    K, V, H, HV = q.shape[-1], v.shape[-1], q.shape[2], v.shape[2]
    is_950 = device_name.startswith("Ascend950")
    if K != 128 or V not in ((128,) if is_950 else (128, 256)):
        raise ValueError(f"backend='ascendc' GDN on {device_name} supports K=128 and V in "
                         f"{(128,) if is_950 else (128, 256)}, got K={K}, V={V}")
    if is_950 and HV // H not in (1, 2, 3, 4):
        raise ValueError(f"backend='ascendc' GDN on {device_name} supports HV/H in (1, 2, 3, 4), got {HV}/{H}")
    if needs_grad and not device_name.startswith(runtime.GDN_BACKWARD_SOCS):
        raise RuntimeError(f"backend='ascendc' GDN backward uses fla-npu's composite backward, which runs on "
                           f"{runtime.GDN_BACKWARD_SOCS} only; found {device_name}. Run forward without grad or "
                           f"use backend='eager'")


class AscendCGatedDeltaRule(torch.autograd.Function):
    """(q, k, v, g natural-log decay, beta, initial_state) -> (o, final_state) through the composite kernels."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, meta):
        ops = runtime.require_api("gdn")
        result = ops.chunk_gated_delta_rule_fwd(
            q, k, v, g, beta, initial_state=initial_state, output_final_state=meta["output_final_state"],
            chunk_size=runtime.CHUNK, cu_seqlens=meta["cu"], scale=meta["scale"], use_exp2=False,
            use_qk_l2norm_in_kernel=meta["l2norm"], use_gate_in_kernel=False,
            use_beta_sigmoid_in_kernel=meta["beta_sigmoid"], disable_recompute=True, layout=meta["layout"])
        required = (0, 2, 3, 4, 6, 7) + ((1,) if meta["output_final_state"] else ()) + ((8, 9) if meta["l2norm"] else ())
        o, final, g_cumsum, A, beta_eff, _, q_hat, k_hat, q_rstd, k_rstd = runtime.slots(_FWD, result, 10, required)
        ctx.save_for_backward(q_hat, k_hat, v, g_cumsum, beta_eff, A, initial_state, q_rstd, k_rstd,
                              beta if meta["beta_sigmoid"] else None)
        ctx.meta = meta
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        ops = runtime.require_api("gdn")
        meta = ctx.meta
        q_hat, k_hat, v, g_cumsum, beta_eff, A, h0, q_rstd, k_rstd, beta_raw = ctx.saved_tensors
        grads = ops.chunk_gated_delta_rule_bwd(
            q_hat, k_hat, v, g_cumsum, beta_eff, A, do.contiguous(), meta["scale"], chunk_size=runtime.CHUNK,
            cu_seqlens=meta["cu"], initial_state=h0, dht=dfinal, q_rstd=q_rstd, k_rstd=k_rstd, beta_raw=beta_raw,
            use_exp2=False, use_qk_l2norm_in_kernel=meta["l2norm"], use_gate_in_kernel=False,
            use_beta_sigmoid_in_kernel=meta["beta_sigmoid"], layout=meta["layout"])
        dq, dk, dv, dbeta, dg, dh0, _, _ = runtime.slots(_BWD, grads, 8,
                                                         (0, 1, 2, 3, 4) + ((5,) if h0 is not None else ()))
        qd, kd, vd, gd, bd = ctx.dtypes
        return dq.to(qd), dk.to(kd), dv.to(vd), dg.to(gd), dbeta.to(bd), dh0, None


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                           use_beta_sigmoid_in_kernel, use_gate_in_kernel, A_log, dt_bias, cu_seqlens):
    """Backend entry (inputs validated by layers/ops/delta_rule.py)."""
    runtime.check_dtype("gdn", q=q, k=k, v=v)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, A_log, dt_bias, initial_state))
    check_gdn(q, v, runtime.soc(q.device), needs_grad)
    if use_gate_in_kernel:  # the composite kernels refuse it; the gate runs here, differentiably
        g = gdn_gate(g.float(), A_log, dt_bias)
    meta = {"scale": float(scale), "cu": runtime.host_offsets(cu_seqlens), "layout": "TND" if cu_seqlens is not None
            else "BSND", "output_final_state": output_final_state, "l2norm": use_qk_l2norm_in_kernel,
            "beta_sigmoid": use_beta_sigmoid_in_kernel}
    state = None if initial_state is None else initial_state.float().contiguous()
    return AscendCGatedDeltaRule.apply(q, k, v, g.float().contiguous(), beta.contiguous(), state, meta)
