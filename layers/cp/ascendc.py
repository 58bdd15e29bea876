"""State-passing CP on fla-npu's native summary and merge kernels (the FLA-KCP decomposition).

The CP engine (``layers/cp/state_parallel.py``) calls :func:`state_passing_cp` instead of its generic path
when the backend module has it. On this rank's pieces (``plan.local_cu_seqlens``, flattened tokens):

forward (no autograd inside one Function):
  1. native prepare (GDN ``chunk_gated_delta_rule_fwd_prepare`` / KDA ``chunk_kda_fwd_prepare``), then
     ``pre_process_fwd_kernel_merged`` -> [E | M] of every piece (fp32); the exit pieces give the own
     positions' summaries, masked where links are cut or a document starts inside the segment;
  2. exchange: S_in of every own position (``allgather``: one all-gather, folded by ``merge_fwd_bwd_kernel``;
     ``p2p`` / ``grouped_allgather_p2p``: ``layers.cp.chain.exclusive_scan``);
  3. the local run with initial_state = S_in at the entry pieces (GDN composite forward; KDA chunk_fwd_h +
     finalize).
backward:
  1. ``pre_process_bwd_kernel_merged`` per entry piece -> dS_loc (gradient of the rank's own outputs w.r.t.
     the state entering the position);
  2. reverse exchange of (M^T, dS_loc) -> the gradient of the state leaving each own position;
  3. the local native backward with that terminal gradient (``dht``) and the saved initial states gives
     every input gradient; nothing else crosses ranks (no dh0 is sent back).
``recursive_doubling`` raises NotImplementedError (no native support yet). Ulysses is the engine's (it
re-shards heads before calling this hook). Limits: K = V = 128 (the native CP kernels). GDN on Ascend 910B /
910_93, which lack ``chunk_gated_delta_rule_fwd_prepare``, takes w / u from the composite forward's A through
``recompute_w_u_fwd`` (one more composite forward per layer) and runs the backward on the building blocks
(``layers/ops/ascendc/gdn_staged.py``); the summary and merge kernels register all three SoCs. Three fla-npu ops
reject zero-length pieces; the planner never makes one (empty documents are rejected, zigzag documents are
multiples of 2P), and the hook says so if one appears. The
backward summary takes ``gk`` in bf16/fp16 (KDA's cumulative gate is rounded to bf16 there when the model
runs in fp32) and is ``chunk_delta_h_bwd_preprocess`` or ``pre_process_bwd_kernel_merged`` by revision.
"""
from __future__ import annotations

import math

import torch

from layers.cp.native import entry_windows, initial_states, scan_exchange, terminal_gradients
from layers.ops.ascendc import runtime
from layers.ops.ascendc.gdn import (check_gdn, composite_backward, composite_forward, composite_layout,
                                    in_kernel_transforms, real_g_cumsum, staged_gdn_backward, to_layout)
from layers.ops.ascendc.kda import (batch4, check_kda, head_major, kda_local_backward, kda_meta, kda_prepare,
                                    require_backward_api, resolve_gate, state_pass, token_major_scalars, untoken)
from layers.ops.gates import gdn_gate
from layers.ops.kinds import GDN, KDA, delta_kind

SUPPORTED_METHODS = ("p2p", "allgather", "grouped_allgather_p2p")
MERGE_MAX_HEADS = 256  # merge_fwd_bwd_kernel's HV limit; chains x heads are folded in groups of this size


# ------------------------------------------------------------------------------------------- exchange
def _fold_native(ops, chain, n_fold, position, forward, K, V):
    """merge_fwd_bwd_kernel over chain summaries [L, R, K, V+K] (R = chains x heads), in head groups."""
    R = chain.shape[1]
    out = chain.new_zeros(R, K, V, dtype=torch.float32)
    if n_fold == 0:
        return out
    for r0 in range(0, R, MERGE_MAX_HEADS):
        part = out[r0:r0 + MERGE_MAX_HEADS]                 # contiguous slice of dim 0: a view merge writes into
        ops.merge_fwd_bwd_kernel(part, chain[:, r0:r0 + MERGE_MAX_HEADS].contiguous(), n_fold, position,
                                 forward=forward)
    return out


def _allgather_native(ops, ctx, plan, A, B, forward):
    """One all-gather of [B | A] (fla-npu's hm layout) of every own position, folded by the native merge."""
    from layers.cp.collectives import all_gather_raw

    D, n_own, HV, K, W = B.shape
    gathered = all_gather_raw(torch.cat([B, A], dim=-1), ctx.chain_comm.group, ctx.stats)  # [P,D,n,HV,K,W+K]
    L = plan.chain_length
    chain = torch.stack([gathered[plan.owners[t], :, plan.owner_slot[t]] for t in range(L)], 0)
    chain = chain.reshape(L, D * HV, K, W + K)
    out = torch.empty_like(B)
    for s, t in enumerate(plan.own_positions):
        n_fold = t if forward else L - 1 - t
        out[:, s] = _fold_native(ops, chain, n_fold, t, forward, K, W).view(D, HV, K, W)
    return out


def exchange(ops, ctx, plan, A, B, forward: bool):
    """Exclusive fold of (A, B) over own positions in chain order (forward) or reversed (backward)."""
    if ctx.state_method == "allgather":
        return _allgather_native(ops, ctx, plan, A, B, forward)
    return scan_exchange(ctx, plan, A, B, forward)


def _native_exchange(ops):
    return lambda ctx, plan, A, B, forward: exchange(ops, ctx, plan, A, B, forward)


# ------------------------------------------------------------------------------------------- pieces
def entry_summaries(plan, summarize, shape):
    """dS_loc ``[D, n_own, *shape]`` of the entry pieces: ``summarize(window)`` per entry window."""
    return torch.stack([summarize(w) for w in entry_windows(plan)], 0).view(*plan.entry_piece.shape, *shape)


# ---------------------------------------------------------------------------------------------- GDN
def _gdn_summary_inputs(ops, q, k, v, g, beta, meta):
    """(q_hat, k_hat BNSD, log2 chunk-cumulative gate [1,HV,T], w, u) from ``chunk_gated_delta_rule_fwd_prepare``
    (Ascend 950: its op is run by fla-npu's A5 example only)."""
    hm_in = [x.transpose(1, 2).contiguous() for x in (q, k, v)]                             # BNSD, B = 1
    prep = ops.chunk_gated_delta_rule_fwd_prepare(
        *hm_in, g.transpose(1, 2).contiguous(), beta.transpose(1, 2).contiguous(), runtime.CHUNK,
        use_qk_l2norm_in_kernel=meta["l2norm"], use_beta_sigmoid_in_kernel=meta["beta_sigmoid"],
        use_exp2=True, cu_seqlens=meta["cu"], chunk_indices=meta["chunk_indices"], output_a=False)
    q_hat, k_hat, _, _, _, g_log2, w, u, _ = runtime.slots("chunk_gated_delta_rule_fwd_prepare", prep, 9,
                                                          (0, 1, 4, 5, 6, 7))
    return q_hat, k_hat, g_log2, w, u


def _gdn_summary_inputs_staged(ops, q, k, v, g, beta, meta):
    """The same on Ascend 910B / 910_93, which lack that op: A and the cumulative gate from the composite forward
    (no initial state: its output is discarded; one more forward per layer), then ``recompute_w_u_fwd``. q / k
    arrive already L2-normalised (off Ascend 950 the in-kernel transforms run in PyTorch)."""
    layout, cu, ci = meta["layout"], meta["cu"], meta["chunk_indices"]
    result = ops.chunk_gated_delta_rule_fwd(
        to_layout(q, layout), to_layout(k, layout), to_layout(v, layout), g, beta, initial_state=None,
        output_final_state=False, chunk_size=runtime.CHUNK, cu_seqlens=cu, chunk_indices=ci, scale=meta["scale"],
        use_exp2=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
        disable_recompute=True, layout=layout)
    g_cumsum, A = runtime.slots("chunk_gated_delta_rule_fwd", result, 10, (2, 3))[2:4]
    qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))                        # BNSD, B = 1
    gc = g_cumsum.float().transpose(1, 2).contiguous()
    w, u = runtime.slots("recompute_w_u_fwd", ops.recompute_w_u_fwd(
        kh, vh, beta.transpose(1, 2).contiguous(), A, runtime.CHUNK, g=gc, cu_seqlens=cu, chunk_indices=ci), 2,
        (0, 1))
    return qh, kh, (gc / math.log(2.0)).contiguous(), w, u


class _GDNStateCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, meta):
        ops, plan, cp = meta["ops"], meta["plan"], meta["ctx"]
        cu = meta["cu"]
        q_hat, k_hat, g_log2, w, u = (_gdn_summary_inputs_staged if meta["staged"] else _gdn_summary_inputs)(
            ops, q, k, v, g, beta, meta)
        hm = ops.pre_process_fwd_kernel_merged(k_hat, w, u, g=g_log2, cu_seqlens=cu, chunk_size=runtime.CHUNK)
        M, init = initial_states(cp, plan, hm, _native_exchange(ops))
        exits = set(plan.exit_piece.reshape(-1).tolist())                # pieces whose leaving state has a gradient
        o, _, (saved, ext) = composite_forward(ops, q, k, v, g, beta, init, meta, False,
                                               tails=[p in exits for p in range(len(cu) - 1)])
        ctx.save_for_backward(*saved, q_hat, k_hat, w, g_log2, M)
        ctx.meta, ctx.ext = meta, ext
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
        return o

    @staticmethod
    def backward(ctx, do):
        meta = ctx.meta
        ops, plan, cp, cu, scale = meta["ops"], meta["plan"], meta["ctx"], meta["cu"], meta["scale"]
        saved, (q_hat, k_hat, w, g_log2, M) = ctx.saved_tensors[:10], ctx.saved_tensors[10:]
        g_cumsum = real_g_cumsum((saved, ctx.ext))
        do = do.contiguous()
        do_hm = do.transpose(1, 2).contiguous()
        dv_local = ops.chunk_bwd_dv_local(q_hat, k_hat, do_hm, g_cumsum.transpose(1, 2).contiguous(), scale,
                                          runtime.CHUNK, cu_seqlens=cu, chunk_indices=meta["chunk_indices"])
        V = do.shape[-1]
        summary = runtime.op(ops, "pre_process_bwd_kernel_merged")
        dS_loc = entry_summaries(plan, lambda window: summary(
            q_hat, k_hat, w, do_hm, dv_local, scale, runtime.CHUNK, g=g_log2, cu_seqlens=window)[..., :V],
            (do.shape[2], q_hat.shape[-1], V))
        dht = terminal_gradients(cp, plan, M, dS_loc, len(cu) - 1, do.device, _native_exchange(ops))
        dht = None if ctx.ext is None else dht
        dq, dk, dv, dbeta, dg, _ = composite_backward(ops, (saved, ctx.ext), do, dht, meta)
        qd, kd, vd, gd, bd = ctx.dtypes
        return dq.to(qd), dk.to(kd), dv.to(vd), dg.to(gd), dbeta.to(bd), None


# ---------------------------------------------------------------------------------------------- KDA
class _KDAStateCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, meta):
        ops, plan, cp, kmeta = meta["ops"], meta["plan"], meta["ctx"], meta["kda"]
        p = kda_prepare(ops, q, k, v, g, beta, A_log, dt_bias, kmeta)
        hm = ops.pre_process_fwd_kernel_merged(batch4(p["kg"], True), batch4(p["w"], True), batch4(p["u"], True),
                                               gk=batch4(p["gk"], True), cu_seqlens=kmeta["cu"],
                                               chunk_size=runtime.CHUNK)
        M, init = initial_states(cp, plan, hm, _native_exchange(ops))
        h, v_new, _ = state_pass(ops, p, init, kmeta, False)
        o = ops.chunk_kda_fwd_finalize(p["qg_scaled"], p["Aqk"], v_new, h, output_layout="TND",
                                       cu_seqlens=kmeta["cu"], chunk_indices=kmeta["chunk_indices"])
        saved = {n: p[n] for n in ("gk", "Aqk", "Akk", "w", "qg", "kg", "q_hat", "k_hat", "q_rstd", "k_rstd",
                                   "beta_eff")}
        saved.update(v_new=v_new, h=h, v_hm=head_major(v, True), g_hm=head_major(g.float(), True), A_log=A_log,
                     dt_bias=dt_bias, h0=init, M=M)
        ctx.names = tuple(saved)
        ctx.save_for_backward(*saved.values())
        ctx.meta = meta
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
        return untoken(o, True)

    @staticmethod
    def backward(ctx, do):
        meta = ctx.meta
        plan, cp, kmeta = meta["plan"], meta["ctx"], meta["kda"]
        ops = runtime.require_api("kda_bwd")
        saved = dict(zip(ctx.names, ctx.saved_tensors))
        do_hm = head_major(do, True)                                                       # NTD [HV, T, V]
        result = ops.chunk_kda_bwd_prepare(saved["Aqk"], saved["v_new"], do_hm, saved["h"], scale=kmeta["scale"],
                                           chunk_size=runtime.CHUNK, layout="NTD", cu_seqlens=kmeta["cu"],
                                           chunk_indices=kmeta["chunk_indices"])
        _, dv_local, _ = runtime.slots("chunk_kda_bwd_prepare", result, 3, (0, 1, 2))
        V = do.shape[-1]
        summary = runtime.op(ops, "pre_process_bwd_kernel_merged")
        gk = batch4(saved["gk"], True)  # the summary takes gk in bf16/fp16 only
        gk = gk.to(saved["qg"].dtype if saved["qg"].dtype in (torch.bfloat16, torch.float16) else runtime.STATE_DTYPE)
        dS_loc = entry_summaries(plan, lambda window: summary(
            batch4(saved["qg"], True), batch4(saved["kg"], True), batch4(saved["w"], True), batch4(do_hm, True),
            batch4(dv_local, True), kmeta["scale"], runtime.CHUNK, gk=gk, cu_seqlens=window)[..., :V],
            (do.shape[2], saved["qg"].shape[-1], V))
        dht = terminal_gradients(cp, plan, saved["M"], dS_loc, saved["h0"].shape[0], do.device,
                                 _native_exchange(ops))
        dq, dk, dv, dbeta, dg, da_log, ddt, _ = kda_local_backward(ops, saved, do_hm, dht, saved["h0"], kmeta)
        dbeta, dg = token_major_scalars(dbeta, dg, True)
        qd, kd, vd, gd, bd = ctx.dtypes
        return (untoken(dq, True).to(qd), untoken(dk, True).to(kd), untoken(dv, True).to(vd), dg.to(gd),
                dbeta.to(bd), da_log, None if ddt is None else ddt.reshape(-1), None)


# ------------------------------------------------------------------------------------------ per kind
def _gdn_cp(ctx, plan, inputs, flat, cu, device_name, scale, flags):
    """GDN's run: gate applied here in fp32, then ``_GDNStateCP`` on the flattened pieces -> o ``[1, n_tok, HV, V]``."""
    q, k, v, g, beta = inputs
    q1, k1, v1, g1, b1 = flat
    gate, A_log, dt_bias = flags.get("use_gate_in_kernel", False), flags.get("A_log"), flags.get("dt_bias")
    staged = staged_gdn_backward(device_name)   # A2/A3: summaries and backward from the building blocks
    features = ["gdn", "cp", "gdn_staged_bwd" if staged else "cp_gdn"]   # runtime.API groups this run calls
    ops = [runtime.require_api(f) for f in features]
    runtime.check_dtype("gdn", q=q, k=k, v=v)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, A_log, dt_bias))
    check_gdn(q, v, device_name, needs_grad)
    if gate:
        g1 = gdn_gate(g1.float(), A_log, dt_bias)
    q1, k1, b1, l2, sig = in_kernel_transforms(device_name, q1, k1, b1, flags.get("use_qk_l2norm_in_kernel", False),
                                               flags.get("use_beta_sigmoid_in_kernel", False))
    meta = {"ops": ops[0], "plan": plan, "ctx": ctx, "cu": cu, "chunk_indices": runtime.chunk_indices(cu),
            "scale": float(scale), "layout": composite_layout(device_name, True), "l2norm": l2,
            "beta_sigmoid": sig, "staged": staged}
    return _GDNStateCP.apply(q1, k1, v1, g1.float().contiguous(), b1.contiguous(), meta)


def _kda_cp(ctx, plan, inputs, flat, cu, device_name, scale, flags):
    """KDA's run: the kernels' gate where it is ours (``resolve_gate``), then ``_KDAStateCP`` -> o."""
    q, k, v, g, beta = inputs
    q1, k1, v1, g1, b1 = flat
    gate, A_log, dt_bias = flags.get("use_gate_in_kernel", False), flags.get("A_log"), flags.get("dt_bias")
    ops = runtime.require_api("kda"), runtime.require_api("cp")
    runtime.check_dtype("kda", q=q, k=k, v=v)
    check_kda(q, v)
    require_backward_api(device_name, q, k, v, g, beta, A_log, dt_bias)
    g1, A, dtb, gate = resolve_gate(g1, A_log, dt_bias, gate, flags.get("lower_bound"),
                                    flags.get("safe_gate", False))
    kmeta = kda_meta(q, scale=scale, output_final_state=False,
                     use_qk_l2norm_in_kernel=flags.get("use_qk_l2norm_in_kernel", False),
                     use_beta_sigmoid_in_kernel=flags.get("use_beta_sigmoid_in_kernel", False),
                     use_gate_in_kernel=gate, lower_bound=flags.get("lower_bound"),
                     safe_gate=flags.get("safe_gate", False), cu_seqlens=torch.tensor(cu))
    meta = {"ops": ops[0], "plan": plan, "ctx": ctx, "kda": kmeta}
    return _KDAStateCP.apply(q1, k1, v1, g1, b1, A, dtb, meta)


# per kind: its run on fla-npu's kernels (prepare, summaries, local pass differ by kind; the exchange is shared)
KIND_RUNS = {GDN: _gdn_cp, KDA: _kda_cp}


# ---------------------------------------------------------------------------------------------- hook
def state_passing_cp(kind, ctx, plan, q, k, v, g, beta, *, scale, flags):
    """CP engine hook: the delta rule ``kind`` (name or ``layers.ops.kinds`` descriptor; ``KIND_RUNS``) on this rank's
    ``[B, T_local, ...]`` shards in ``plan``'s local order.

    ``ctx``: the ``CPContext`` (uses ``state_method``, ``chain_comm``, ``stats``); ``plan``: its state-group
    ``ChainPlan`` for this shape; ``flags``: the op keywords (use_qk_l2norm_in_kernel,
    use_beta_sigmoid_in_kernel, use_gate_in_kernel, A_log, dt_bias and, for KDA, lower_bound, safe_gate).
    Returns o ``[B, T_local, HV, V]``, differentiable w.r.t. q, k, v, g, beta, A_log, dt_bias.
    """
    cp_run = delta_kind(kind).pick(KIND_RUNS, "backend='ascendc' CP")
    method = ctx.state_method
    if method == "recursive_doubling":
        raise NotImplementedError("backend='ascendc' CP: recursive_doubling has no native fla-npu support yet; "
                                  f"use one of {SUPPORTED_METHODS} or 'ulysses'")
    if method not in SUPPORTED_METHODS:
        raise ValueError(f"backend='ascendc' CP supports {SUPPORTED_METHODS}, got {method!r}")
    B, T_loc, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K != 128 or V != 128:
        raise ValueError(f"backend='ascendc' CP uses fla-npu's summary kernels, which need K=V=128; got K={K}, V={V}")
    device_name = runtime.soc(q.device)
    cu = [int(x) for x in plan.local_cu_seqlens.tolist()]
    if any(b == a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"backend='ascendc' CP: zero-length local pieces (local cu_seqlens {cu}) are rejected by "
                         "fla-npu's composite forward and CP summary kernels; use cp_method='ulysses' or "
                         "backend='eager'")
    flat = lambda x: x.reshape(1, B * T_loc, *x.shape[2:])  # noqa: E731  pieces index the flattened tokens
    inputs = (q, k, v, g, beta)
    o = cp_run(ctx, plan, inputs, tuple(map(flat, inputs)), cu, device_name, scale, flags)
    return o.view(B, T_loc, HV, V)
