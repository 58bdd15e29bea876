"""GDN backward on Ascend 910B / 910_93 (A2 / A3) from fla-npu's building blocks, where the composite
``chunk_gated_delta_rule_bwd`` does not run (its op_api: "supported on Ascend950 only").

The composition is the one fla-npu's own A2/A3 example runs (d05824fe ``examples/chunk_gdn_cp.py``
``run_gdn_a2_a3``), on the tensors the composite forward saved (``A``, the natural-log chunk-cumulative gate
``g_cumsum``), every op-def registering ascend910b and ascend910_93 (main 17e24fdd
``fla/ops/ascendc/gdn/chunk_gdn_{fwd,bwd}/*/op_host/*_def.cpp``):

1. ``recompute_w_u_fwd`` -> w, u (the composite forward does not return them) and ``chunk_fwd_h`` -> h, v_new
   (one more state pass: the backward's recompute cost), from the initial state in bf16 as the example passes it
   (its merge_boundary: "the BF16 [1,H,K,V] FwdH/Dhu need"; the composite backward also takes it in bf16 only);
2. ``chunk_bwd_dv_local`` -> the intra-chunk dv; ``chunk_gated_delta_rule_bwd_dhu`` -> dh, dh0 and dv2 (the
   whole gradient of v_new);
3. ``chunk_bwd_dqkwg`` -> dq, dk (outputs and state path), dw, dg; ``prepare_wy_repr_bwd_da`` -> the gradient
   of the WY matrix; ``prepare_wy_repr_bwd_full`` -> dk (WY path), dv, dbeta, dg;
4. ``chunk_local_cumsum(reverse=True)`` of the summed cumulative-gate gradients -> the per-token dg.

Inputs are head-major (BNSD); q/k/v come in the composite forward's layout and are transposed once when that is
BSND/TND. The in-kernel L2 norm / sigmoid never reach this path (off Ascend 950 they run in PyTorch before the
kernels, ``gdn.in_kernel_transforms``). A final-state gradient arrives as the composite path's does: through the
dummy tokens the forward appended (``dht`` is None here; the dhu ignores it).
"""
from __future__ import annotations

from layers.ops.ascendc import runtime


def head_major(x, layout: str):
    """A q/k/v tensor in the composite layout -> BNSD [B, N, T, D]."""
    return x if layout == "BNSD" else x.transpose(1, 2).contiguous()


def from_head_major(x, layout: str):
    return x if layout == "BNSD" else x.transpose(1, 2)


def staged_backward(ops, q, k, v, g_cumsum, beta, A, do, scale: float, cu, h0, layout: str):
    """(dq, dk, dv in ``layout``, dbeta [B,T,HV], dg [B,T,HV] w.r.t. the per-token natural-log gate, dh0 or None).

    q, k, v: the forward's q_hat / k_hat / v in ``layout``; g_cumsum, beta [B,T,HV]; A [B,HV,T,64]; do
    [B,T,HV,V]; h0 [N,HV,K,V] fp32 or None; ``cu`` host offsets or None."""
    C = runtime.CHUNK
    ci = runtime.chunk_indices(cu)
    qh, kh, vh = (head_major(x, layout) for x in (q, k, v))
    gc = g_cumsum.float().transpose(1, 2).contiguous()                                 # [B, HV, T]
    bh = beta.transpose(1, 2).contiguous()
    do_h = do.to(qh.dtype).transpose(1, 2).contiguous()                                # [B, HV, T, V]
    w, u = runtime.slots("recompute_w_u_fwd", ops.recompute_w_u_fwd(
        kh, vh, bh, A, C, g=gc, cu_seqlens=cu, chunk_indices=ci), 2, (0, 1))
    h0_bf16 = None if h0 is None else h0.to(runtime.STATE_DTYPE)   # the example's FwdH takes a bf16 state
    h, v_new, _ = runtime.slots("chunk_fwd_h", ops.chunk_fwd_h(
        kh, w, u, g=gc, initial_state=h0_bf16, output_final_state=False, chunk_size=C, cu_seqlens=cu, chunk_indices=ci,
        use_exp2=False), 3, (0, 1))
    dv_local = ops.chunk_bwd_dv_local(qh, kh, do_h, gc, scale, C, cu_seqlens=cu, chunk_indices=ci)
    dh, dh0, dv2 = runtime.slots("chunk_gated_delta_rule_bwd_dhu", ops.chunk_gated_delta_rule_bwd_dhu(
        qh, kh, w, do_h, dv_local, scale, C, g=gc, h0=None if h0 is None else h0.to(qh.dtype), dht=None,
        cu_seqlens=cu, chunk_indices=ci, use_exp2=False), 3, (0, 2) + ((1,) if h0 is not None else ()))
    dq, dk, dw, dg_out = runtime.slots("chunk_bwd_dqkwg", ops.chunk_bwd_dqkwg(
        qh, kh, v_new, gc, h, do_h, dh, dv2, C, cu_seqlens=cu, chunk_indices=ci, scale=scale, use_exp2=False),
        4, (0, 1, 2, 3))
    dA = ops.prepare_wy_repr_bwd_da(kh, vh, bh, A, dw, dv2, gc, chunk_size=C, cu_seqlens=cu, chunk_indices=ci)
    dk_wy, dv, dbeta, dg_wy = runtime.slots("prepare_wy_repr_bwd_full", ops.prepare_wy_repr_bwd_full(
        kh, vh, bh, A, dA, dw, dv2, gc, C, cu_seqlens=cu, chunk_indices=ci), 4, (0, 1, 2, 3))
    dg = ops.chunk_local_cumsum((dg_out.float() + dg_wy.float()).contiguous(), C, cu_seqlens=cu, reverse=True,
                                head_first=True)
    dk = dk.float() + dk_wy.float()
    return (from_head_major(dq, layout), from_head_major(dk, layout), from_head_major(dv, layout),
            dbeta.transpose(1, 2), dg.transpose(1, 2), dh0)
