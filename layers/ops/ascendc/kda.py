"""KDA over fla-npu's staged Ascend C kernels, as one autograd Function.

Forward: ``chunk_kda_fwd_prepare`` (13 slots: gates, L2 norm, beta, WY tensors; the in-kernel gate and
sigmoid run here) -> ``chunk_fwd_h`` (state pass, per-channel log2 gate ``gk``) -> ``chunk_kda_fwd_finalize``.
Backward: ``chunk_kda_bwd_prepare`` (3 slots) -> ``chunk_gated_delta_rule_bwd_dhu`` (reverse state pass with
the initial state and terminal gradient) -> ``chunk_kda_bwd_finalize`` (7 slots, every input gradient). On
Ascend 950 the staged path is used instead of fla-npu's monolithic ``chunk_kda_bwd`` because that one rejects
``initial_state`` and ``dht``, which initial states, final-state gradients and state-passing CP need; on 910B /
910_93, where the staged backward's op-defs are not registered, the backward is that monolithic op
(``layers/ops/ascendc/kda_fused.py``, its limits checked up front).

Layouts: token-major ``[B,T,H,D]`` inputs are ``BSND`` (packed: rank-3 ``TND`` views ``[T,H,D]``); every
intermediate is head-major (``BNSD`` / packed ``NTD``), so the upstream gradient is transposed once.
``chunk_fwd_h`` and the dhu op take rank-4 tensors only (packed runs add B = 1), with ``chunk_indices``.

fla-npu facts handled here (docs/backends.md): the KDA backward stages are exported only by revisions after
the pinned one (``runtime.require_api("kda_bwd")`` names them; the forward needs only "kda") and run on Ascend
950 only (checked up front); the dhu op ignores ``dht`` in every revision checked (``(void)dht;`` in its kernel),
so the terminal gradient enters through two dummy chunks appended to every sequence (``layers/ops/ascendc/
terminal.py``: q = I, d_o = dht / scale, k = w = dv = gate = 0), as fla-npu's own CP examples do; the chunk
states h / dh are chunk-first ``[B, NT, HV, K, V]`` in builds after the h/dh migration and head-first
``[B, HV, NT, K, V]`` before it: h is passed between the kernels as it comes, and the one place that cuts
chunks (the dummy chunks' dh) reads the chunk axis off the shapes (:func:`chunk_axis`); the kernel's in-kernel
gate is the sigmoid form only with ``safe_gate`` (bound in [-5, 0)) and needs ``A_log`` fp32 ``[HV]``, so any
other combination runs ``layers.ops.gates.kda_gate`` in PyTorch before the kernels. ``dq_raw`` comes back fp32
and goes to the finalize as it is; the finalize takes the raw gate ``g`` in fp32.
"""
from __future__ import annotations

import torch

from layers.ops.ascendc import runtime
from layers.ops.ascendc.kda_fused import check_fused_backward, fused_backward, pre_transforms
from layers.ops.ascendc.terminal import Extension
from layers.ops.gates import kda_gate

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
        chunk_indices=meta["chunk_indices"], safe_gate=meta["safe_gate"], lower_bound=meta["lower_bound"],
        use_gate_in_kernel=meta["gate"], A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=meta["l2norm"],
        use_beta_sigmoid_in_kernel=meta["beta_sigmoid"], use_exp2=True, backward_mode="save")
    required = tuple(_SLOT[n] for n in ("gk", "Aqk", "Akk", "w", "u", "qg", "kg", "qg_scaled", "q_hat", "k_hat",
                                        "beta_eff")) + ((10, 11) if meta["l2norm"] else ())
    return dict(zip(_SLOT, runtime.slots(_PREPARE, result, 13, required)))


def chunk_axis(x, n_chunks: int, heads: int):
    """The chunk axis of a chunk-state tensor ``[B, ., ., K, V]``: 1 (chunk-first ``[B, NT, HV, K, V]``, builds
    after the h/dh migration) or 2 (head-first ``[B, HV, NT, K, V]``), read off its shape; None when NT == HV."""
    if n_chunks == heads:
        return None
    dims = tuple(x.shape[1:3])
    if dims == (n_chunks, heads):
        return 1
    if dims == (heads, n_chunks):
        return 2
    raise RuntimeError(f"fla-npu returned a chunk-state tensor of shape {list(x.shape)}; expected "
                       f"[B, {n_chunks}, {heads}, K, V] (chunk-first) or [B, {heads}, {n_chunks}, K, V] (head-first)")


def dhu_with_terminal(ops, qg, kg, w, do, dv, gk, h0, dht, scale, cu, h):
    """``chunk_gated_delta_rule_bwd_dhu`` on rank-4 head-major inputs with the terminal gradient ``dht``
    [N,HV,K,V] entering through two dummy chunks per sequence (the dhu ignores ``dht``; see
    ``layers/ops/ascendc/terminal.py``). ``h``: the forward's chunk states (their layout decides the chunk axis
    when the extended dh cannot). Returns (dh, dh0, dv2) on the real chunks / tokens, dh in the build's layout."""
    C = runtime.CHUNK
    B, HV, T, K = qg.shape
    h0 = None if h0 is None else h0.to(qg.dtype)  # only selects dh0 (which does not depend on its value)
    required = (0, 2) + ((1,) if h0 is not None else ())
    if dht is None:
        return runtime.slots("chunk_gated_delta_rule_bwd_dhu", ops.chunk_gated_delta_rule_bwd_dhu(
            qg, kg, w, do, dv, scale, C, gK=gk, h0=h0, dht=None, cu_seqlens=cu,
            chunk_indices=runtime.chunk_indices(cu), use_exp2=True), 3, required)
    if K != 2 * C or scale == 0:
        raise ValueError(f"backend='ascendc' KDA terminal gradient needs K = {2 * C} and scale != 0, "
                         f"got K={K}, scale={scale}")
    ext = Extension.of(cu, T, True, C, K)
    eye = torch.eye(K, dtype=qg.dtype, device=qg.device).expand(B, HV, K, K)
    dht_tail = (lambda n: dht[n:n + 1] / scale) if cu is not None else (lambda n: dht / scale)  # noqa: E731
    q_e, k_e, w_e, dv_e = (ext.extend(x, 2, tail=(lambda n: eye) if x is qg else None) for x in (qg, kg, w, dv))
    do_e = ext.extend(do, 2, tail=lambda n: dht_tail(n).float())
    gk_e = ext.extend(gk, 2, hold_last=True)
    dh, dh0, dv2 = runtime.slots("chunk_gated_delta_rule_bwd_dhu", ops.chunk_gated_delta_rule_bwd_dhu(
        q_e, k_e, w_e, do_e, dv_e, scale, C, gK=gk_e, h0=h0, dht=None, cu_seqlens=ext.cu,
        chunk_indices=runtime.chunk_indices(ext.cu), use_exp2=True), 3, required)
    chunks = ext.chunk_index(dh.device)
    n_ext = -(-ext.tokens // C) if cu is None else sum(-(-L // C) for L in ext.ext_lengths)
    n_real = -(-T // C) if cu is None else sum(-(-L // C) for L in ext.lengths)
    axis = chunk_axis(dh, n_ext, HV) or chunk_axis(h, n_real, HV)  # NT_ext >= NT_real + 2: one is unambiguous
    return dh.index_select(axis, chunks), dh0, ext.real(dv2, 2)


def kda_local_backward(ops, saved, do_hm, dht, h0, meta):
    """Staged native backward for one local run; ``do_hm`` head-major, ``dht`` [N,HV,K,V] or None.

    Returns (dq, dk, dv token-major-layout tensors per meta["layout"], dbeta [..,HV,T], dg [..,HV,T,K], dA_log,
    ddt_bias, dh0)."""
    packed, cu, scale = meta["packed"], meta["cu"], meta["scale"]
    result = ops.chunk_kda_bwd_prepare(saved["Aqk"], saved["v_new"], do_hm, saved["h"], scale=scale,
                                       chunk_size=runtime.CHUNK, layout="NTD" if packed else "BNSD", cu_seqlens=cu,
                                       chunk_indices=meta["chunk_indices"])
    d_aqk, dv_local, dq_raw = runtime.slots(_BWD_PREPARE, result, 3, (0, 1, 2))
    qg = saved["qg"]
    dh, dh0, dv_scan = dhu_with_terminal(
        ops, batch4(qg, packed), batch4(saved["kg"], packed), batch4(saved["w"], packed), batch4(do_hm, packed),
        batch4(dv_local, packed), batch4(saved["gk"], packed), h0, dht, scale, cu, saved["h"])
    grads = ops.chunk_kda_bwd_finalize(
        saved["q_hat"], saved["k_hat"], saved["v_hm"], saved["gk"], saved["g_hm"], saved["beta_eff"],
        saved["A_log"], saved["dt_bias"], saved["Akk"], saved["v_new"], saved["h"], dh,
        dv_scan[0] if packed else dv_scan, d_aqk, dq_raw, q_rstd=saved["q_rstd"], k_rstd=saved["k_rstd"],
        scale=scale, chunk_size=runtime.CHUNK, use_exp2=True, use_qk_l2norm_in_kernel=meta["l2norm"],
        use_gate_in_kernel=meta["gate"], use_beta_sigmoid_in_kernel=meta["beta_sigmoid"],
        safe_gate=meta["safe_gate"], lower_bound=meta["lower_bound"], output_layout=meta["layout"], cu_seqlens=cu,
        chunk_indices=meta["chunk_indices"])
    required = (0, 1, 2, 3, 4) + ((5,) if meta["gate"] and saved["A_log"] is not None else ()) \
        + ((6,) if meta["gate"] and saved["dt_bias"] is not None else ())
    dq, dk, dv, dbeta, dg, da_log, ddt = runtime.slots(_FINALIZE, grads, 7, required)
    return dq, dk, dv, dbeta, dg, da_log, ddt, dh0


def state_pass(ops, p, initial_state, meta, output_final_state):
    """chunk_fwd_h (rank-4 only) on the prepared slots; (h, v_new in the slots' rank, final_state)."""
    packed = meta["packed"]
    result = ops.chunk_fwd_h(batch4(p["kg"], packed), batch4(p["w"], packed), batch4(p["u"], packed),
                             gk=batch4(p["gk"], packed), initial_state=initial_state,
                             output_final_state=output_final_state, chunk_size=runtime.CHUNK, cu_seqlens=meta["cu"],
                             chunk_indices=meta["chunk_indices"], use_exp2=True)
    h, v_new, final = runtime.slots("chunk_fwd_h", result, 3, (0, 1) + ((2,) if output_final_state else ()))
    return h, v_new[0] if packed else v_new, final


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
        h, v_new, final = state_pass(ops, p, initial_state, meta, meta["output_final_state"])
        o = ops.chunk_kda_fwd_finalize(p["qg_scaled"], p["Aqk"], v_new, h, output_layout=meta["layout"],
                                       cu_seqlens=meta["cu"], chunk_indices=meta["chunk_indices"])
        saved = {n: p[n] for n in ("gk", "Aqk", "Akk", "w", "qg", "kg", "q_hat", "k_hat", "q_rstd", "k_rstd",
                                   "beta_eff")}
        saved.update(v_new=v_new, h=h, v_hm=head_major(v, packed), g_hm=head_major(g.float(), packed), A_log=A_log,
                     dt_bias=dt_bias, h0=initial_state)
        ctx.names = tuple(saved)
        ctx.save_for_backward(*saved.values())
        ctx.meta = meta
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
        return untoken(o, packed), final

    @staticmethod
    def backward(ctx, do, dfinal):
        meta = ctx.meta
        packed = meta["packed"]
        saved = dict(zip(ctx.names, ctx.saved_tensors))
        if meta["fused_bwd"]:  # off Ascend 950: fla-npu's monolithic ChunkKdaBwd (kda_fused.py)
            # autograd hands an unused final state zeros; only a nonzero terminal gradient needs dht (one sync)
            if dfinal is not None and bool(dfinal.ne(0).any()):
                raise RuntimeError("backend='ascendc' KDA off Ascend 950: a final-state gradient arrived, but "
                                   "fla-npu's monolithic ChunkKdaBwd takes no dht: do not differentiate the final "
                                   "state there, or use Ascend 950 / backend='eager'")
            dq, dk, dv, dbeta, dg = fused_backward(runtime.require_api("kda_fused_bwd"), saved,
                                                   head_major(do, packed), meta)
            da_log = ddt = dh0 = None
        else:
            dq, dk, dv, dbeta, dg, da_log, ddt, dh0 = kda_local_backward(
                runtime.require_api("kda_bwd"), saved, head_major(do, packed), dfinal, saved["h0"], meta)
        dbeta, dg = token_major_scalars(dbeta, dg, packed)
        qd, kd, vd, gd, bd = ctx.dtypes
        dh0 = None if dh0 is None else dh0.float()
        return (untoken(dq, packed).to(qd), untoken(dk, packed).to(kd), untoken(dv, packed).to(vd), dg.to(gd),
                dbeta.to(bd), da_log, None if ddt is None else ddt.reshape(-1), dh0, None)


def kda_meta(q, *, scale, output_final_state, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
             use_gate_in_kernel, lower_bound, safe_gate, cu_seqlens, fused_bwd=False):
    packed = cu_seqlens is not None
    cu = runtime.host_offsets(cu_seqlens)
    return {"scale": float(scale), "cu": cu, "chunk_indices": runtime.chunk_indices(cu), "packed": packed,
            "layout": "TND" if packed else "BSND", "output_final_state": output_final_state,
            "l2norm": use_qk_l2norm_in_kernel, "beta_sigmoid": use_beta_sigmoid_in_kernel,
            "gate": use_gate_in_kernel, "lower_bound": lower_bound, "safe_gate": safe_gate, "fused_bwd": fused_bwd}


def kernel_gate_matches(A_log, lower_bound, safe_gate: bool) -> bool:
    """fla-npu's in-kernel KDA gate equals ours: A_log given (passed as fp32 [HV]) and either safe_gate with an
    explicit lower_bound in [-5, 0) (the kernels reject other bounds; sigmoid form) or neither (softplus form)."""
    if A_log is None or (lower_bound is not None) != bool(safe_gate):
        return False
    return lower_bound is None or -5.0 <= lower_bound < 0.0


def resolve_gate(g, A_log, dt_bias, use_gate_in_kernel, lower_bound, safe_gate):
    """(g, A_log, dt_bias, gate_in_kernel): the kernel's gate when it matches ours (:func:`kernel_gate_matches`;
    A_log / dt_bias go as fp32, the dtype the kernels demand), otherwise the gate runs here in PyTorch (fp32,
    differentiable) and the kernel gets the log gate."""
    if not use_gate_in_kernel:
        return g, None, None, False
    if kernel_gate_matches(A_log, lower_bound, safe_gate):
        return g, A_log.float(), None if dt_bias is None else dt_bias.float(), True
    return kda_gate(g.float(), A_log, dt_bias, lower_bound), None, None, False


def needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def require_backward_api(device_name: str, *tensors):
    """When a gradient will be needed: check the staged KDA backward's exports and SoC up front (one clear error,
    no wasted forward)."""
    if needs_grad(*tensors):
        runtime.check_soc_features(device_name, kda_backward=True)
        runtime.require_api("kda_bwd")


def chunk_kda(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
              use_beta_sigmoid_in_kernel, use_gate_in_kernel, A_log, dt_bias, cu_seqlens, lower_bound=None,
              safe_gate=False):
    """Backend entry (inputs validated by layers/ops/delta_rule.py)."""
    runtime.check_dtype("kda", q=q, k=k, v=v)
    device_name = runtime.soc(q.device)
    check_kda(q, v)
    runtime.require_api("kda")
    fused = needs_grad(q, k, v, g, beta, A_log, dt_bias, initial_state) and not device_name.startswith(
        runtime.A5_SOCS)
    if fused:  # off Ascend 950 the backward is the monolithic ChunkKdaBwd (kda_fused.py): its limits up front
        check_fused_backward(device_name, initial_state, safe_gate)
        runtime.require_api("kda_fused_bwd")
        q, k, beta, g = pre_transforms(q, k, beta, g, A_log, dt_bias, lower_bound, use_qk_l2norm_in_kernel,
                                       use_beta_sigmoid_in_kernel, use_gate_in_kernel)
        use_qk_l2norm_in_kernel = use_beta_sigmoid_in_kernel = use_gate_in_kernel = False
    else:
        require_backward_api(device_name, q, k, v, g, beta, A_log, dt_bias, initial_state)
    g, A, dtb, gate = resolve_gate(g, A_log, dt_bias, use_gate_in_kernel, lower_bound, safe_gate)
    meta = kda_meta(q, scale=scale, output_final_state=output_final_state,
                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, use_gate_in_kernel=gate,
                    lower_bound=lower_bound, safe_gate=safe_gate, cu_seqlens=cu_seqlens, fused_bwd=fused)
    state = None if initial_state is None else initial_state.float().contiguous()
    return AscendCKimiDeltaAttention.apply(q, k, v, g, beta, A, dtb, state, meta)
