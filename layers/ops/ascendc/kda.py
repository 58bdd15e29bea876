"""KDA over fla-npu's staged Ascend C kernels, as one autograd Function.

Forward: ``chunk_kda_fwd_prepare`` (13 slots: gates, L2 norm, beta, WY tensors; the in-kernel gate and
sigmoid run here) -> ``chunk_fwd_h`` (state pass, per-channel log2 gate ``gk``) -> ``chunk_kda_fwd_finalize``.
Backward: ``chunk_kda_bwd_prepare`` (3 slots) -> ``chunk_gated_delta_rule_bwd_dhu`` (reverse state pass with
the initial state and terminal gradient) -> ``chunk_kda_bwd_finalize`` (7 slots, every input gradient). The
staged path is used instead of fla-npu's monolithic ``chunk_kda_bwd`` because that one rejects
``initial_state`` and ``dht``, which initial states, final-state gradients and CP need.

Layouts: token-major ``[B,T,H,D]`` inputs are ``BSND`` (packed: rank-3 ``TND`` views ``[T,H,D]``); every
intermediate is head-major (``BNSD`` / packed ``NTD``), so the upstream gradient is transposed once.
"""
from __future__ import annotations

import torch

from layers.ops.ascendc import runtime

_PREPARE, _BWD_PREPARE, _FINALIZE = "chunk_kda_fwd_prepare", "chunk_kda_bwd_prepare", "chunk_kda_bwd_finalize"
_SLOT = {name: i for i, name in enumerate(("gk", "Aqk", "Akk", "w", "u", "qg", "kg", "qg_scaled", "q_hat", "k_hat",
                                           "q_rstd", "k_rstd", "beta_eff"))}


def check_kda(q, v) -> None:
    K, V = q.shape[-1], v.shape[-1]
    if K != 128 or V != 128:
        raise ValueError(f"backend='ascendc' KDA supports K=V=128 (fla-npu's prepare/finalize), got K={K}, V={V}")


def token_view(x, packed: bool):
    """Our [B,T,...] tensor as the kernels' token-major input: BSND, or rank-3 TND when packed (B = 1)."""
    return x[0] if packed else x


def head_major(x, packed: bool):
    """[B,T,N,D] -> BNSD [B,N,T,D], or packed -> NTD [N,T,D]."""
    return x[0].transpose(0, 1).contiguous() if packed else x.transpose(1, 2).contiguous()


def batch4(x, packed: bool):
    """Head-major rank-3 (packed NTD) -> rank 4 with B = 1, as the 4-D-only operators want."""
    return x.unsqueeze(0) if packed else x


def kda_prepare(ops, q, k, v, g, beta, A_log, dt_bias, meta):
    """Run chunk_kda_fwd_prepare in "save" mode and return its slots by name."""
    packed = meta["packed"]
    result = ops.chunk_kda_fwd_prepare(
        token_view(q, packed), token_view(k, packed), token_view(v, packed), token_view(g, packed),
        token_view(beta, packed), meta["scale"], runtime.CHUNK, layout=meta["layout"], cu_seqlens=meta["cu"],
        safe_gate=meta["safe_gate"], lower_bound=meta["lower_bound"], use_gate_in_kernel=meta["gate"],
        A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=meta["l2norm"],
        use_beta_sigmoid_in_kernel=meta["beta_sigmoid"], use_exp2=True, backward_mode="save")
    required = tuple(_SLOT[n] for n in ("gk", "Aqk", "Akk", "w", "u", "qg", "kg", "qg_scaled", "q_hat", "k_hat",
                                        "beta_eff")) + ((10, 11) if meta["l2norm"] else ())
    return dict(zip(_SLOT, runtime.slots(_PREPARE, result, 13, required)))


def kda_local_backward(ops, saved, do_hm, dht, h0, meta):
    """Staged native backward for one local run; ``do_hm`` head-major, ``dht`` [N,HV,K,V] or None.

    Returns (dq, dk, dv token-major-layout tensors per meta["layout"], dbeta [..,HV,T], dg [..,HV,T,K], dA_log,
    ddt_bias, dh0)."""
    packed, cu, scale = meta["packed"], meta["cu"], meta["scale"]
    result = ops.chunk_kda_bwd_prepare(saved["Aqk"], saved["v_new"], do_hm, saved["h"], scale=scale,
                                       chunk_size=runtime.CHUNK, layout="NTD" if packed else "BNSD", cu_seqlens=cu)
    d_aqk, dv_local, dq_raw = runtime.slots(_BWD_PREPARE, result, 3, (0, 1, 2))
    qg = saved["qg"]
    dht = None if dht is None else dht.to(qg.dtype)  # fla-npu's dhu takes the terminal gradient in model dtype
    dh, dh0, dv_scan = runtime.slots("chunk_gated_delta_rule_bwd_dhu", ops.chunk_gated_delta_rule_bwd_dhu(
        batch4(qg, packed), batch4(saved["kg"], packed), batch4(saved["w"], packed), batch4(do_hm, packed),
        batch4(dv_local, packed), scale, runtime.CHUNK, gK=batch4(saved["gk"], packed), h0=h0, dht=dht,
        cu_seqlens=cu, use_exp2=True), 3, (0, 2) + ((1,) if h0 is not None else ()))
    grads = ops.chunk_kda_bwd_finalize(
        saved["q_hat"], saved["k_hat"], saved["v_hm"], saved["gk"], saved["g_hm"], saved["beta_eff"],
        saved["A_log"], saved["dt_bias"], saved["Akk"], saved["v_new"], saved["h"], dh,
        dv_scan[0] if packed else dv_scan, d_aqk, dq_raw, q_rstd=saved["q_rstd"], k_rstd=saved["k_rstd"],
        scale=scale, chunk_size=runtime.CHUNK, use_exp2=True, use_qk_l2norm_in_kernel=meta["l2norm"],
        use_gate_in_kernel=meta["gate"], use_beta_sigmoid_in_kernel=meta["beta_sigmoid"],
        safe_gate=meta["safe_gate"], lower_bound=meta["lower_bound"], output_layout=meta["layout"], cu_seqlens=cu)
    required = (0, 1, 2, 3, 4) + ((5,) if meta["gate"] and saved["A_log"] is not None else ()) \
        + ((6,) if meta["gate"] and saved["dt_bias"] is not None else ())
    dq, dk, dv, dbeta, dg, da_log, ddt = runtime.slots(_FINALIZE, grads, 7, required)
    return dq, dk, dv, dbeta, dg, da_log, ddt, dh0


def untoken(x, packed: bool):
    """Kernel output in BSND / rank-3 TND -> our [B,T,...]."""
    return x.unsqueeze(0) if packed else x


def token_major_scalars(dbeta, dg, packed: bool):
    """Head-major dbeta [..,HV,T] and dg [..,HV,T,K] -> [B,T,HV] and [B,T,HV,K]."""
    if packed:
        return dbeta.transpose(0, 1)[None], dg.transpose(0, 1)[None]
    return dbeta.transpose(1, 2), dg.transpose(1, 2)


class AscendCKimiDeltaAttention(torch.autograd.Function):
    """(q, k, v, g, beta, A_log, dt_bias, initial_state) -> (o, final_state) through the staged kernels."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, meta):
        ops = runtime.require_api("kda")
        packed = meta["packed"]
        p = kda_prepare(ops, q, k, v, g, beta, A_log, dt_bias, meta)
        result = ops.chunk_fwd_h(p["kg"], p["w"], p["u"], gk=p["gk"], initial_state=initial_state,
                                 output_final_state=meta["output_final_state"], chunk_size=runtime.CHUNK,
                                 cu_seqlens=meta["cu"], use_exp2=True)
        h, v_new, final = runtime.slots("chunk_fwd_h", result, 3, (0, 1) + ((2,) if meta["output_final_state"] else ()))
        o = ops.chunk_kda_fwd_finalize(p["qg_scaled"], p["Aqk"], v_new, h, output_layout=meta["layout"],
                                       cu_seqlens=meta["cu"])
        saved = {n: p[n] for n in ("gk", "Aqk", "Akk", "w", "qg", "kg", "q_hat", "k_hat", "q_rstd", "k_rstd",
                                   "beta_eff")}
        saved.update(v_new=v_new, h=h, v_hm=head_major(v, packed), g_hm=head_major(g, packed), A_log=A_log,
                     dt_bias=dt_bias, h0=initial_state)
        ctx.names = tuple(saved)
        ctx.save_for_backward(*saved.values())
        ctx.meta = meta
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
        return untoken(o, packed), final

    @staticmethod
    def backward(ctx, do, dfinal):
        ops = runtime.require_api("kda")
        meta = ctx.meta
        packed = meta["packed"]
        saved = dict(zip(ctx.names, ctx.saved_tensors))
        dq, dk, dv, dbeta, dg, da_log, ddt, dh0 = kda_local_backward(
            ops, saved, head_major(do, packed), dfinal, saved["h0"], meta)
        dbeta, dg = token_major_scalars(dbeta, dg, packed)
        qd, kd, vd, gd, bd = ctx.dtypes
        return (untoken(dq, packed).to(qd), untoken(dk, packed).to(kd), untoken(dv, packed).to(vd), dg.to(gd),
                dbeta.to(bd), da_log, None if ddt is None else ddt.reshape(-1), dh0, None)


def kda_meta(q, *, scale, output_final_state, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
             use_gate_in_kernel, lower_bound, safe_gate, cu_seqlens):
    packed = cu_seqlens is not None
    return {"scale": float(scale), "cu": runtime.host_offsets(cu_seqlens), "packed": packed,
            "layout": "TND" if packed else "BSND", "output_final_state": output_final_state,
            "l2norm": use_qk_l2norm_in_kernel, "beta_sigmoid": use_beta_sigmoid_in_kernel,
            "gate": use_gate_in_kernel, "lower_bound": lower_bound, "safe_gate": safe_gate}


def chunk_kda(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
              use_beta_sigmoid_in_kernel, use_gate_in_kernel, A_log, dt_bias, cu_seqlens, lower_bound=None,
              safe_gate=False):
    """Backend entry (inputs validated by layers/ops/delta_rule.py)."""
    runtime.check_dtype("kda", q=q, k=k, v=v)
    runtime.soc(q.device)
    check_kda(q, v)
    meta = kda_meta(q, scale=scale, output_final_state=output_final_state,
                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                    lower_bound=lower_bound, safe_gate=safe_gate, cu_seqlens=cu_seqlens)
    state = None if initial_state is None else initial_state.float().contiguous()
    A = None if A_log is None or not use_gate_in_kernel else A_log.float()
    dtb = None if dt_bias is None or not use_gate_in_kernel else dt_bias.float()
    return AscendCKimiDeltaAttention.apply(q, k, v, g, beta, A, dtb, state, meta)
