"""GDN over fla-npu's composite Ascend C kernels: ``chunk_gated_delta_rule_fwd`` (ten slots) and
``chunk_gated_delta_rule_bwd`` (eight slots), as one autograd Function.

Layouts: our token-major q/k/v ``[B,T,H,D]`` are the kernels' ``BSND`` (packed ``[1,T,H,D]`` is ``TND``),
so no copy is made; Ascend 910_93 rejects BSND/TND, so there q/k/v are transposed to ``BNSD`` (one copy each);
g/beta stay ``[B,T,HV]``. ``o`` comes back ``[B,T,HV,V]`` and the backward takes ``d_o`` ``[B,T,HV,V]``
(BSND) whatever ``layout`` says (the ctypes wrapper allocates o so; the backward's op_api checks "d_o must be
BSND"); dq/dk/dv come back in ``layout``. Packed runs pass ``chunk_indices`` with ``cu_seqlens`` (the kernels
reject one without the other). The in-kernel gate is not supported by the composite kernels, so
``-exp(A_log) softplus(g + dt_bias)`` runs in PyTorch before the Function (its gradients flow through
autograd); L2 norm of q/k and the beta sigmoid run inside the kernels on Ascend 950 and in PyTorch elsewhere
(the kernels' in-kernel path is 950-only). The forward returns ``beta_eff`` only when the sigmoid ran inside;
otherwise the backward's beta is the raw beta. The backward takes ``initial_state`` in bf16 only
(``runtime.STATE_DTYPE``) and returns dh0 in bf16: both are rounded there, while its accumulation stays the
kernel's.

Terminal gradient: the composite backward hands ``dht`` to ``ChunkGatedDeltaRuleBwdDhu``, which ignores it
(``(void)dht;``), so a final-state gradient would be dropped without an error. When one can arrive (the
single-rank op with ``output_final_state`` and gradients; GDN CP for every exit piece) the forward runs on
sequences extended by dummy tokens (``layers/ops/ascendc/terminal.py``: q = e_j, k = v = gate = 0) and the
backward feeds ``dht[j, :] / (scale c_j)`` as their ``d_o``, with c_j the kernel's own L2-normalised q at dummy
token j (1 without the in-kernel L2 norm), and passes ``dht=None``: exact in every build, whether it honours
``dht`` or not. Cost: up to 63 + 128 extra tokens per such sequence in the forward and the backward.
"""
from __future__ import annotations

import torch

from layers.ops.ascendc import runtime
from layers.ops.ascendc.gdn_staged import staged_backward
from layers.ops.ascendc.terminal import Extension
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


def staged_gdn_backward(device_name: str) -> bool:
    """Whether GDN's backward runs on fla-npu's building blocks (gdn_staged.py): everywhere but Ascend 950, where
    the composite backward runs."""
    return not device_name.startswith(runtime.A5_SOCS)


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


def extension(meta, T: int, tails):
    """The dummy-token plan for ``tails`` (bool or one flag per sequence), or None when no sequence has one."""
    if tails is None or tails is False or (not isinstance(tails, bool) and not any(tails)):
        return None
    return Extension.of(meta["cu"], T, tails, runtime.CHUNK, runtime.CHUNK * 2)


def composite_forward(ops, q, k, v, g, beta, initial_state, meta, output_final_state, tails=None):
    """``chunk_gated_delta_rule_fwd`` on token-major inputs (sequences extended by dummy tokens where ``tails``
    says a terminal gradient will come); returns (o [B,T,HV,V] on the real tokens, final_state, state for
    :func:`composite_backward`)."""
    layout = meta["layout"]
    ext = extension(meta, q.shape[1], tails)
    cu = meta["cu"]
    if ext is not None:
        K = q.shape[-1]
        if K != ext.extra:
            raise ValueError(f"backend='ascendc' GDN terminal gradient needs K = {ext.extra}, got K={K}")
        eye = torch.eye(K, dtype=q.dtype, device=q.device)[None, :, None, :]           # [1, K tokens, 1, K]
        q = ext.extend(q, 1, tail=lambda n: eye)
        k, v, g, beta = (ext.extend(x, 1) for x in (k, v, g, beta))
        cu = ext.cu
    result = ops.chunk_gated_delta_rule_fwd(
        to_layout(q, layout), to_layout(k, layout), to_layout(v, layout), g, beta, initial_state=initial_state,
        output_final_state=output_final_state, chunk_size=runtime.CHUNK, cu_seqlens=cu,
        chunk_indices=runtime.chunk_indices(cu), scale=meta["scale"], use_exp2=False,
        use_qk_l2norm_in_kernel=meta["l2norm"], use_gate_in_kernel=False,
        use_beta_sigmoid_in_kernel=meta["beta_sigmoid"], disable_recompute=True, layout=layout)
    required = (0, 2, 3, 6, 7) + ((1,) if output_final_state else ()) + ((8, 9) if meta["l2norm"] else ()) \
        + ((4,) if meta["beta_sigmoid"] else ())
    o, final, g_cumsum, A, beta_eff, _, q_hat, k_hat, q_rstd, k_rstd = runtime.slots(_FWD, result, 10, required)
    # the backward's beta: beta_eff (fp32) with the in-kernel sigmoid and the raw beta in its dtype, else raw beta
    beta_used, beta_raw = (beta_eff, beta.to(beta_eff.dtype)) if meta["beta_sigmoid"] else (beta, None)
    saved = (q_hat, k_hat, to_layout(v, layout), g_cumsum, beta_used, A, initial_state, q_rstd, k_rstd, beta_raw)
    return (o if ext is None else ext.real(o, 1)), final, (saved, ext)


def real_g_cumsum(state):
    """The forward's ``g_cumsum`` ``[B,T,HV]`` on the real tokens (the extension leaves their chunks unchanged)."""
    (saved, ext) = state
    return saved[3] if ext is None else ext.real(saved[3], 1)


def terminal_d_o(do, dht, saved, ext, meta):
    """``d_o`` of the extended sequences: the real ``do``, zeros on the padding, ``dht[n, :, j] / (scale c_j)``
    on dummy token j of sequence n (c_j: the kernel's q at that token, row j of its L2-normalised identity)."""
    q_hat = from_layout(saved[0], meta["layout"])                                          # [B, T_ext, H, K]
    HV = do.shape[2]

    def tail(n):
        rows = q_hat.index_select(1, ext.tail_index(n, q_hat.device)).float()             # [B', K, H, K]
        c = torch.diagonal(rows, dim1=1, dim2=3)                                          # [B', H, K]
        c = c.repeat_interleave(HV // c.shape[1], dim=1)                                  # [B', HV, K]
        d = dht[n:n + 1] if ext.packed else dht                                           # [B', HV, K, V]
        return (d.float() / (meta["scale"] * c[..., None])).transpose(1, 2)              # [B', K, HV, V]
    return ext.extend(do, 1, tail=tail)


def composite_backward(ops, state, do, dht, meta):
    """``chunk_gated_delta_rule_bwd`` on the forward's saved tensors; (dq, dk, dv, dbeta, dg, dh0) on the real
    tokens. ``dht`` [N,HV,K,V] needs a forward with dummy tokens for those sequences."""
    saved, ext = state
    q_hat, k_hat, v, g_cumsum, beta_used, A, h0, q_rstd, k_rstd, beta_raw = saved
    layout, cu = meta["layout"], meta["cu"]
    do = do.contiguous()
    if ext is not None:
        dht = torch.zeros(len(ext.lengths) if ext.packed else do.shape[0], do.shape[2], q_hat.shape[-1],
                          do.shape[3], device=do.device) if dht is None else dht
        do, cu = terminal_d_o(do, dht, saved, ext, meta), ext.cu
    elif dht is not None:
        raise RuntimeError("backend='ascendc' GDN: a final-state gradient arrived for a forward run without "
                           "dummy tokens (fla-npu's composite backward ignores dht)")
    if meta["staged"]:  # off Ascend 950: fla-npu's building blocks (gdn_staged.py)
        dq, dk, dv, dbeta, dg, dh0 = staged_backward(runtime.require_api("gdn_staged_bwd"), q_hat, k_hat, v,
                                                     g_cumsum, beta_used, A, do, meta["scale"], cu, h0, layout)
    else:
        grads = ops.chunk_gated_delta_rule_bwd(
            q_hat, k_hat, v, g_cumsum, beta_used, A, do.to(q_hat.dtype), meta["scale"], chunk_size=runtime.CHUNK,
            cu_seqlens=cu, chunk_indices=runtime.chunk_indices(cu),
            initial_state=None if h0 is None else h0.to(runtime.STATE_DTYPE), dht=None, q_rstd=q_rstd,
            k_rstd=k_rstd, beta_raw=beta_raw, use_exp2=False, use_qk_l2norm_in_kernel=meta["l2norm"],
            use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=meta["beta_sigmoid"], layout=layout)
        dq, dk, dv, dbeta, dg, dh0, _, _ = runtime.slots(_BWD, grads, 8,
                                                         (0, 1, 2, 3, 4) + ((5,) if h0 is not None else ()))
    dq, dk, dv = (from_layout(x, layout) for x in (dq, dk, dv))
    if ext is not None:
        dq, dk, dv, dbeta, dg = (ext.real(x, 1) for x in (dq, dk, dv, dbeta, dg))
    return dq, dk, dv, dbeta, dg, dh0


class AscendCGatedDeltaRule(torch.autograd.Function):
    """(q, k, v, g natural-log decay, beta, initial_state) -> (o, final_state) through the composite kernels."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, meta):
        ops = runtime.require_api("gdn")
        o, final, state = composite_forward(ops, q, k, v, g, beta, initial_state, meta, meta["output_final_state"],
                                            tails=meta["terminal"])
        saved, ctx.ext = state
        ctx.save_for_backward(*saved)
        ctx.meta = meta
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        ops = runtime.require_api("gdn")
        dq, dk, dv, dbeta, dg, dh0 = composite_backward(ops, (ctx.saved_tensors, ctx.ext), do, dfinal, ctx.meta)
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
            "l2norm": l2, "beta_sigmoid": sig, "terminal": bool(output_final_state and needs_grad),
            "staged": staged_gdn_backward(device_name)}
    state = None if initial_state is None else initial_state.float().contiguous()
    return AscendCGatedDeltaRule.apply(q, k, v, g.float().contiguous(), beta.contiguous(), state, meta)
