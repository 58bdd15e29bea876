"""GDN over fla-npu's composite Ascend C kernels: ``chunk_gated_delta_rule_fwd`` (ten slots) and
``chunk_gated_delta_rule_bwd`` (eight slots), as one autograd Function.

Layouts: our token-major q/k/v ``[B,T,H,D]`` are the kernels' ``BSND`` (packed ``[1,T,H,D]`` is ``TND``),
so no copy is made; Ascend 910_93 rejects BSND/TND, so there q/k/v are transposed to ``BNSD`` (one copy each);
g/beta stay ``[B,T,HV]``; o comes back in the input layout. Packed runs pass ``chunk_indices`` with
``cu_seqlens`` (the kernels reject one without the other). The in-kernel gate is not supported by the
composite kernels, so ``-exp(A_log) softplus(g + dt_bias)`` runs in PyTorch before the Function (its
gradients flow through autograd); L2 norm of q/k and the beta sigmoid run inside the kernels on Ascend 950
and in PyTorch elsewhere (the kernels' in-kernel path is 950-only). The forward returns ``beta_eff`` only
when the sigmoid ran inside; otherwise the backward's beta is the raw beta. The backward takes
``initial_state`` and ``dht`` in bf16 only (``runtime.STATE_DTYPE``): those two are rounded to bf16 there,
while its accumulation stays the kernel's.
"""
from __future__ import annotations

import torch

from layers.ops.ascendc import runtime
from layers.ops.gates import gdn_gate, l2norm

_FWD, _BWD = "chunk_gated_delta_rule_fwd", "chunk_gated_delta_rule_bwd"


def check_gdn(q, v, device_name: str, needs_grad: bool) -> None:
    """Device and shape limits of the composite kernels (ValueError / RuntimeError naming them)."""
    K, V, H, HV = q.shape[-1], v.shape[-1], q.shape[2], v.shape[2]
    is_950 = device_name.startswith(runtime.A5_SOCS)
    if K != 128 or V not in ((128,) if is_950 else (128, 256)):
        raise ValueError(f"backend='ascendc' GDN on {device_name} supports K=128 and V in "
                         f"{(128,) if is_950 else (128, 256)}, got K={K}, V={V}")
    if is_950 and HV // H not in (1, 2, 3, 4):
        raise ValueError(f"backend='ascendc' GDN on {device_name} supports HV/H in (1, 2, 3, 4), got {HV}/{H}")
    runtime.check_soc_features(device_name, gdn_backward=needs_grad)


def in_kernel_transforms(device_name: str, q, k, beta, l2norm_in_kernel: bool, beta_sigmoid: bool):
    """(q, k, beta, l2norm_in_kernel, beta_sigmoid): off Ascend 950 the in-kernel L2 norm and sigmoid run here."""
    if device_name.startswith(runtime.A5_SOCS):
        return q, k, beta, l2norm_in_kernel, beta_sigmoid
    if l2norm_in_kernel:
        q, k = l2norm(q.float()).to(q.dtype), l2norm(k.float()).to(k.dtype)
    if beta_sigmoid:
        beta = torch.sigmoid(beta.float()).to(beta.dtype)
    return q, k, beta, False, False


def composite_layout(device_name: str, packed: bool) -> str:
    """BSND / TND (no copy), or BNSD on Ascend 910_93, which rejects the token-major layouts."""
    if device_name.startswith(runtime.A3_SOCS):
        return "BNSD"
    return "TND" if packed else "BSND"


def to_layout(x, layout: str):
    return x.transpose(1, 2).contiguous() if layout == "BNSD" else x


def from_layout(x, layout: str):
    return x.transpose(1, 2) if layout == "BNSD" else x


def composite_backward(ops, saved, do, dht, meta):
    """``chunk_gated_delta_rule_bwd`` on the forward's saved tensors; (dq, dk, dv, dbeta, dg, dh0)."""
    q_hat, k_hat, v, g_cumsum, beta_used, A, h0, q_rstd, k_rstd, beta_raw = saved
    bf16 = (lambda x: None if x is None else x.to(runtime.STATE_DTYPE))  # noqa: E731
    layout = meta["layout"]
    grads = ops.chunk_gated_delta_rule_bwd(
        q_hat, k_hat, v, g_cumsum, beta_used, A, to_layout(do, layout).contiguous(), meta["scale"],
        chunk_size=runtime.CHUNK, cu_seqlens=meta["cu"], chunk_indices=meta["chunk_indices"],
        initial_state=bf16(h0), dht=bf16(dht), q_rstd=q_rstd, k_rstd=k_rstd, beta_raw=beta_raw, use_exp2=False,
        use_qk_l2norm_in_kernel=meta["l2norm"], use_gate_in_kernel=False,
        use_beta_sigmoid_in_kernel=meta["beta_sigmoid"], layout=layout)
    dq, dk, dv, dbeta, dg, dh0, _, _ = runtime.slots(_BWD, grads, 8, (0, 1, 2, 3, 4) + ((5,) if h0 is not None else ()))
    return from_layout(dq, layout), from_layout(dk, layout), from_layout(dv, layout), dbeta, dg, dh0


def composite_forward(ops, q, k, v, g, beta, initial_state, meta, output_final_state):
    """``chunk_gated_delta_rule_fwd``; returns (o token-major, final_state, tensors the backward needs)."""
    layout = meta["layout"]
    result = ops.chunk_gated_delta_rule_fwd(
        to_layout(q, layout), to_layout(k, layout), to_layout(v, layout), g, beta, initial_state=initial_state,
        output_final_state=output_final_state, chunk_size=runtime.CHUNK, cu_seqlens=meta["cu"],
        chunk_indices=meta["chunk_indices"], scale=meta["scale"], use_exp2=False,
        use_qk_l2norm_in_kernel=meta["l2norm"], use_gate_in_kernel=False,
        use_beta_sigmoid_in_kernel=meta["beta_sigmoid"], disable_recompute=True, layout=layout)
    required = (0, 2, 3, 6, 7) + ((1,) if output_final_state else ()) + ((8, 9) if meta["l2norm"] else ()) \
        + ((4,) if meta["beta_sigmoid"] else ())
    o, final, g_cumsum, A, beta_eff, _, q_hat, k_hat, q_rstd, k_rstd = runtime.slots(_FWD, result, 10, required)
    # the backward's beta: beta_eff (fp32) with the in-kernel sigmoid and the raw beta in its dtype, else raw beta
    beta_used, beta_raw = (beta_eff, beta.to(beta_eff.dtype)) if meta["beta_sigmoid"] else (beta, None)
    saved = (q_hat, k_hat, to_layout(v, layout), g_cumsum, beta_used, A, initial_state, q_rstd, k_rstd, beta_raw)
    return from_layout(o, layout), final, saved


class AscendCGatedDeltaRule(torch.autograd.Function):
    """(q, k, v, g natural-log decay, beta, initial_state) -> (o, final_state) through the composite kernels."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, meta):
        ops = runtime.require_api("gdn")
        o, final, saved = composite_forward(ops, q, k, v, g, beta, initial_state, meta, meta["output_final_state"])
        ctx.save_for_backward(*saved)
        ctx.meta = meta
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        ops = runtime.require_api("gdn")
        dq, dk, dv, dbeta, dg, dh0 = composite_backward(ops, ctx.saved_tensors, do, dfinal, ctx.meta)
        h0 = ctx.saved_tensors[6]
        qd, kd, vd, gd, bd = ctx.dtypes
        return (dq.to(qd), dk.to(kd), dv.to(vd), dg.to(gd), dbeta.to(bd), None if h0 is None else dh0.to(h0.dtype),
                None)


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                           use_beta_sigmoid_in_kernel, use_gate_in_kernel, A_log, dt_bias, cu_seqlens):
    """Backend entry (inputs validated by layers/ops/delta_rule.py)."""
    runtime.check_dtype("gdn", q=q, k=k, v=v)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, A_log, dt_bias, initial_state))
    device_name = runtime.soc(q.device)
    check_gdn(q, v, device_name, needs_grad)
    if use_gate_in_kernel:  # the composite kernels refuse it; the gate runs here, differentiably
        g = gdn_gate(g.float(), A_log, dt_bias)
    q, k, beta, l2, sig = in_kernel_transforms(device_name, q, k, beta, use_qk_l2norm_in_kernel,
                                               use_beta_sigmoid_in_kernel)
    cu = runtime.host_offsets(cu_seqlens)
    meta = {"scale": float(scale), "cu": cu, "chunk_indices": runtime.chunk_indices(cu),
            "layout": composite_layout(device_name, cu is not None), "output_final_state": output_final_state,
            "l2norm": l2, "beta_sigmoid": sig}
    state = None if initial_state is None else initial_state.float().contiguous()
    return AscendCGatedDeltaRule.apply(q, k, v, g.float().contiguous(), beta.contiguous(), state, meta)
