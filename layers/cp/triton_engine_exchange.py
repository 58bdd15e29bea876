"""State-passing CP on flash-linear-attention's kernels with the engine's exchange, for every method and layout.

(``layers/cp/triton.py`` runs FLA's own KCP path instead where it applies: ``allgather``, one row, FLA's
partition.) The fold shared with the other native backends is ``layers/cp/native.py``.

FLA 0.6's summary kernels (``fla.ops.cp``: ``chunk_cp_fwd_h``, ``chunk_cp_bwd_dh``) with our exchange. Forward:
FLA's gate cumsum and WY step, ``[E | M]`` of every local piece from those factors (one launch, no outputs), the
engine's exclusive fold into the entry pieces' initial states, then FLA's state pass and output kernels from those
states. Backward: the reverse summaries ``dS_loc`` of the entry pieces, the reverse fold into the exit pieces'
terminal gradients, then FLA's own backward with that ``dht`` (KDA: ``chunk_kda_bwd`` on the factors computed
here; GDN: its stages, as FLA's ``chunk_gated_delta_rule_bwd`` runs them). q/k L2 norm and beta sigmoid run in
FLA's kernels around it. These are FLA's internal functions; :func:`load_internals` checks they exist and raises
``RuntimeError`` naming FLA's version otherwise.
"""
from __future__ import annotations

import importlib
import inspect
import types
from functools import lru_cache

import torch

from layers.cp.native import entry_windows, initial_states, terminal_gradients
from layers.ops.kinds import GDN, KDA, delta_kind
from layers.ops.triton.runtime import PACKAGES, device_cu_seqlens, load_fla

CHUNK = 64
_INTERNALS = {
    "fla.modules.norm.l2norm": ("l2norm_fwd", "l2norm_bwd"),
    "fla.ops.common.gate": ("fused_beta_sigmoid", "fused_beta_sigmoid_bwd"),
    "fla.ops.common.chunk_delta_h": ("chunk_gated_delta_rule_fwd_h", "chunk_gated_delta_rule_bwd_dhu"),
    "fla.ops.common.chunk_o": ("chunk_fwd_o", "chunk_bwd_dv_local", "chunk_bwd_dqkwg"),
    "fla.ops.cp.chunk_fwd": ("chunk_cp_fwd_h",),
    "fla.ops.cp.chunk_bwd": ("chunk_cp_bwd_dh",),
    "fla.ops.gated_delta_rule.chunk_fwd": ("chunk_gated_delta_rule_fwd_intra",),
    "fla.ops.gated_delta_rule.gate": ("gdn_gate_chunk_cumsum", "gdn_gate_bwd"),
    "fla.ops.gated_delta_rule.wy_fast": ("prepare_wy_repr_bwd", "recompute_w_u_fwd"),
    "fla.ops.gla.chunk": ("chunk_gla_fwd_o_gk",),
    "fla.ops.kda.chunk_intra": ("chunk_kda_fwd_intra",),
    "fla.ops.kda.chunk_bwd": ("chunk_kda_bwd", "chunk_kda_bwd_dAv"),
    "fla.ops.kda.gate": ("kda_gate_chunk_cumsum",),
    "fla.ops.kda.wy_fast": ("recompute_w_u_fwd",),
    "fla.ops.utils": ("chunk_local_cumsum", "prepare_chunk_indices"),
    "fla.ops.utils.constant": ("RCP_LN2",),
}


# keywords this module passes to each internal function (tests/backends/test_fla_pins.py keeps this table equal
# to the calls)
KEYWORDS = {
    "chunk_bwd_dqkwg": ("chunk_indices", "chunk_size", "cu_seqlens", "dh", "do", "dv", "g", "h", "k", "q", "scale",
                        "v", "w"),
    "chunk_bwd_dv_local": ("chunk_indices", "chunk_size", "cu_seqlens", "do", "g", "k", "q", "scale"),
    "chunk_cp_bwd_dh": ("chunk_size", "cu_seqlens", "dhm", "do", "dv", "k", "q", "scale", "w"),
    "chunk_cp_fwd_h": ("chunk_size", "cu_seqlens", "hm", "k", "multi_seqs", "u", "w"),
    "chunk_fwd_o": ("chunk_indices", "chunk_size", "cu_seqlens", "g", "h", "k", "q", "scale", "v"),
    "chunk_gated_delta_rule_bwd_dhu": ("chunk_indices", "chunk_size", "cu_seqlens", "dht", "do", "dv", "g", "h0",
                                       "k", "q", "scale", "w"),
    "chunk_gated_delta_rule_fwd_h": ("chunk_indices", "chunk_size", "cu_seqlens", "initial_state", "k",
                                     "output_final_state", "u", "w"),
    "chunk_gated_delta_rule_fwd_intra": ("beta", "chunk_indices", "chunk_size", "cu_seqlens", "g", "k", "v"),
    "chunk_gla_fwd_o_gk": ("A", "chunk_indices", "chunk_size", "cu_seqlens", "g", "h", "q", "scale", "v"),
    "chunk_kda_bwd": ("A_log", "Akk", "Aqk", "beta", "chunk_indices", "chunk_size", "cu_seqlens", "dht",
                      "disable_recompute", "do", "dt_bias", "g", "g_org", "h", "initial_state", "k", "kg",
                      "lower_bound", "q", "qg", "safe_gate", "scale", "u", "use_gate_in_kernel", "v", "v_new", "w"),
    "chunk_kda_bwd_dAv": ("A", "chunk_indices", "chunk_size", "cu_seqlens", "do", "k", "q", "scale", "v"),
    "chunk_kda_fwd_intra": ("beta", "chunk_indices", "chunk_size", "cu_seqlens", "disable_recompute", "gk", "k", "q",
                            "safe_gate", "scale", "v"),
    "chunk_local_cumsum": ("chunk_indices", "chunk_size", "cu_seqlens", "reverse", "scale"),
    "fused_beta_sigmoid": ("scale",),
    "fused_beta_sigmoid_bwd": ("scale",),
    "gdn_gate_bwd": ("A_log", "dt_bias", "dyg", "g"),
    "gdn_gate_chunk_cumsum": ("A_log", "chunk_indices", "chunk_size", "cu_seqlens", "dt_bias", "g", "scale"),
    "kda_gate_chunk_cumsum": ("A_log", "chunk_indices", "chunk_size", "cu_seqlens", "dt_bias", "g", "lower_bound",
                              "scale"),
    "kda_recompute_w_u": ("A", "beta", "chunk_indices", "cu_seqlens", "gk", "k", "q", "v"),
    "l2norm_bwd": (),
    "l2norm_fwd": (),
    "prepare_chunk_indices": ("cu_seqlens_cpu",),
    "prepare_wy_repr_bwd": ("A", "beta", "chunk_indices", "cu_seqlens", "du", "dw", "g", "k", "v"),
    "recompute_w_u_fwd": ("A", "beta", "chunk_indices", "cu_seqlens", "g", "k", "v"),
}


def check_signatures(found: dict, fla_version: str) -> None:
    """RuntimeError naming FLA's version and the function when an internal function no longer takes the keywords
    this module passes (FLA moved it: these are not FLA's public API)."""
    for name, keywords in KEYWORDS.items():
        fn = found.get(name)
        if fn is None or not callable(fn):
            raise RuntimeError(f"backend='triton' CP: flash-linear-attention {fla_version} lacks {name}; this "
                               f"backend's CP is written against FLA 0.6's kernels; need {PACKAGES}")
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):   # a builtin without a signature: nothing to check
            continue
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            continue
        missing = sorted(set(keywords) - set(params))
        if missing:
            raise RuntimeError(f"backend='triton' CP: flash-linear-attention {fla_version}'s {name} no longer takes "
                               f"{missing} (its parameters: {list(params)}); this backend's CP is written against "
                               f"FLA 0.6's kernels; need {PACKAGES}")


@lru_cache(maxsize=1)
def load_internals() -> types.SimpleNamespace:
    """FLA's internal stages this module calls (``kda_recompute_w_u`` for KDA's variant); RuntimeError naming FLA's
    version if any is missing or its signature moved (they are not FLA's public API)."""
    fla_version = ".".join(map(str, load_fla().fla_version))
    found = {}
    for module_name, names in _INTERNALS.items():
        try:
            module = importlib.import_module(module_name)
            for name in names:
                key = "kda_recompute_w_u" if module_name == "fla.ops.kda.wy_fast" else name
                found[key] = getattr(module, name)
        except (ImportError, AttributeError) as error:
            raise RuntimeError(f"backend='triton' CP: flash-linear-attention {fla_version} lacks {module_name} "
                               f"({error}); this backend's CP is written against FLA 0.6's kernels; need "
                               f"{PACKAGES}") from error
    check_signatures(found, fla_version)
    return types.SimpleNamespace(**found)


def _prologue(q, k, g, beta, meta, gate_cumsum):
    """In-kernel q/k L2 norm, beta sigmoid, and the gate's chunk-local cumsum (log2; with the gate activation when
    it runs in kernel: ``gate_cumsum()``, the kind's FLA kernel) -> (q, q_rstd, k, k_rstd, beta, g_cum)."""
    fi, cu, idx = meta["fi"], meta["cu"], meta["chunk_indices"]
    q_rstd = k_rstd = None
    if meta["l2norm"]:
        q, q_rstd = fi.l2norm_fwd(q)
        k, k_rstd = fi.l2norm_fwd(k)
    if meta["beta_sigmoid"]:
        beta = fi.fused_beta_sigmoid(beta, scale=1.0)
    if not meta["gate"]:
        g_cum = fi.chunk_local_cumsum(g, chunk_size=CHUNK, scale=fi.RCP_LN2, cu_seqlens=cu, chunk_indices=idx)
    else:
        g_cum = gate_cumsum()
    return q, q_rstd, k, k_rstd, beta, g_cum


def _epilogue(saved, meta, dq, dk, dv, dg, db, dA_log, ddt_bias):
    """Backward of the prologue's norm and sigmoid; the op's gradients in the input dtypes."""
    fi = meta["fi"]
    if meta["l2norm"]:
        dq = fi.l2norm_bwd(saved["q"], saved["q_rstd"], dq)
        dk = fi.l2norm_bwd(saved["k"], saved["k_rstd"], dk)
    if meta["beta_sigmoid"]:
        db = fi.fused_beta_sigmoid_bwd(saved["beta_raw"], db, scale=1.0)
    return (dq.to(saved["q"].dtype), dk.to(saved["k"].dtype), dv.to(saved["v"].dtype), dg.to(saved["g_raw"].dtype),
            db.to(saved["beta_raw"].dtype), dA_log, ddt_bias, None)


def _summaries(fi, k, w, u, cu, n_pieces, **gate):
    """``[E | M]`` of every piece ``[n_pieces, HV, K, V+K]`` fp32 in one launch."""
    HV, V = u.shape[2:]
    K = k.shape[-1]
    hm = k.new_zeros(n_pieces, HV, K, V + K, dtype=torch.float32)
    fi.chunk_cp_fwd_h(k=k, w=w, u=u, hm=hm, cu_seqlens=cu, chunk_size=CHUNK, multi_seqs=True, **gate)
    return hm


def _reverse_summaries(fi, plan, cu, q, k, w, do, dv, scale, **gate):
    """dS_loc ``[D, n_own, HV, K, V]`` of the entry pieces (first V columns of FLA's ``[dS_loc | M^T]``)."""
    HV, V = do.shape[2:]
    K = q.shape[-1]
    out = []
    for p, (start, end) in zip(plan.entry_piece.reshape(-1).tolist(), entry_windows(plan)):
        dhm = q.new_zeros(HV, K, V + K, dtype=torch.float32)
        if end > start:
            fi.chunk_cp_bwd_dh(q=q, k=k, w=w, do=do, dv=dv, dhm=dhm, scale=scale, cu_seqlens=cu[p:p + 2],
                               chunk_size=CHUNK, **gate)
        out.append(dhm[..., :V])
    D, n_own = plan.entry_piece.shape
    return torch.stack(out, 0).view(D, n_own, HV, K, V)


def _state_pass(fi, k, w, u, init, cu, idx, **gate):
    """FLA's chunked state pass from the given initial states -> (h per chunk, v_new)."""
    h, v_new, _ = fi.chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, initial_state=init, output_final_state=False,
                                                  cu_seqlens=cu, chunk_indices=idx, chunk_size=CHUNK, **gate)
    return h, v_new


def _cp_state_pass(fi, meta, k, w, u, **gate):
    """The forward exchange around FLA's state pass: ``[E | M]`` of every local piece, the engine's fold into the
    entry pieces' initial states, FLA's state pass from them -> (M, initial states, h per chunk, v_new)."""
    plan, cu = meta["plan"], meta["cu"]
    hm = _summaries(fi, k, w, u, cu, plan.num_pieces, **gate)
    M, init = initial_states(meta["ctx"], plan, hm)
    h, v_new = _state_pass(fi, k, w, u, init, cu, meta["chunk_indices"], **gate)
    return M, init, h, v_new


def _cp_terminal_gradients(fi, meta, saved, q, k, w, do, dv, **gate):
    """The backward exchange: dS_loc of the entry pieces, the engine's reverse fold -> ``dht`` of every piece."""
    plan, cu = meta["plan"], meta["cu"]
    dS_loc = _reverse_summaries(fi, plan, cu, q, k, w, do, dv, meta["scale"], **gate)
    return terminal_gradients(meta["ctx"], plan, saved["M"], dS_loc, saved["init"].shape[0], do.device)


def _save_forward(ctx, meta, raw, prologue, M, init, **factors):
    """Saves what backward reads: the raw inputs ``(v, g, beta, A_log, dt_bias)``, the prologue's outputs, the CP
    states ``M`` / ``init``, the kind's intra-chunk ``factors``, and ``meta``."""
    v, g, beta, A_log, dt_bias = raw
    qn, q_rstd, kn, k_rstd, b, g_cum = prologue
    _save(ctx, q=qn, q_rstd=q_rstd, k=kn, k_rstd=k_rstd, v=v, g_cum=g_cum, g_raw=g, beta_raw=beta, beta=b,
          init=init, M=M, A_log=A_log, dt_bias=dt_bias, **factors)
    ctx.meta = meta


def _unpack(ctx):
    """Backward's view of the forward: (meta, saved tensors, internals, cu, chunk indices, scale)."""
    meta = ctx.meta
    return meta, _saved(ctx), meta["fi"], meta["cu"], meta["chunk_indices"], meta["scale"]


def _save(ctx, **tensors):
    ctx.names = tuple(tensors)
    ctx.save_for_backward(*tensors.values())


def _saved(ctx) -> dict:
    return dict(zip(ctx.names, ctx.saved_tensors))


class _GDNNativeCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, meta):
        fi, cu, idx = meta["fi"], meta["cu"], meta["chunk_indices"]
        prologue = _prologue(q, k, g, beta, meta, lambda: fi.gdn_gate_chunk_cumsum(
            g=g, A_log=A_log, chunk_size=CHUNK, scale=fi.RCP_LN2, dt_bias=dt_bias, cu_seqlens=cu, chunk_indices=idx))
        qn, _, kn, _, b, g_cum = prologue
        w, u, A = fi.chunk_gated_delta_rule_fwd_intra(k=kn, v=v, g=g_cum, beta=b, cu_seqlens=cu, chunk_indices=idx,
                                                      chunk_size=CHUNK)
        M, init, h, v_new = _cp_state_pass(fi, meta, kn, w, u, g=g_cum)
        o = fi.chunk_fwd_o(q=qn, k=kn, v=v_new, h=h, g=g_cum, scale=meta["scale"], cu_seqlens=cu,
                           chunk_indices=idx, chunk_size=CHUNK)
        _save_forward(ctx, meta, (v, g, beta, A_log, dt_bias), prologue, M, init, A=A)
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        meta, s, fi, cu, idx, scale = _unpack(ctx)
        do = do.contiguous()
        q, k, v, g_cum, b, A = s["q"], s["k"], s["v"], s["g_cum"], s["beta"], s["A"]
        w, u = fi.recompute_w_u_fwd(k=k, v=v, beta=b, A=A, g=g_cum, cu_seqlens=cu, chunk_indices=idx)
        h, v_new = _state_pass(fi, k, w, u, s["init"], cu, idx, g=g_cum)
        dv = fi.chunk_bwd_dv_local(q=q, k=k, g=g_cum, do=do, scale=scale, cu_seqlens=cu, chunk_indices=idx,
                                   chunk_size=CHUNK)
        dht = _cp_terminal_gradients(fi, meta, s, q, k, w, do, dv, g=g_cum)
        dh, _, dv = fi.chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, g=g_cum, h0=s["init"], dht=dht, do=do, dv=dv,
                                                      scale=scale, cu_seqlens=cu, chunk_indices=idx,
                                                      chunk_size=CHUNK)
        dq, dk, dw, dg = fi.chunk_bwd_dqkwg(q=q, k=k, v=v_new, w=w, g=g_cum, h=h, dv=dv, do=do, dh=dh, scale=scale,
                                            cu_seqlens=cu, chunk_indices=idx, chunk_size=CHUNK)
        dk2, dv, db, dg2 = fi.prepare_wy_repr_bwd(k=k, v=v, beta=b, g=g_cum, A=A, dw=dw, du=dv, cu_seqlens=cu,
                                                  chunk_indices=idx)
        dk.add_(dk2)
        dg.add_(dg2)
        dg = fi.chunk_local_cumsum(dg, chunk_size=CHUNK, reverse=True, cu_seqlens=cu, chunk_indices=idx)
        dA_log = ddt_bias = None
        if meta["gate"]:
            dg, dA_log, ddt_bias = fi.gdn_gate_bwd(g=s["g_raw"], A_log=s["A_log"], dt_bias=s["dt_bias"], dyg=dg)
        return _epilogue(s, meta, dq, dk, dv, dg, db, dA_log, ddt_bias)


class _KDANativeCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, meta):
        fi, cu, idx = meta["fi"], meta["cu"], meta["chunk_indices"]
        prologue = _prologue(q, k, g, beta, meta, lambda: fi.kda_gate_chunk_cumsum(
            g=g, A_log=A_log, dt_bias=dt_bias, scale=fi.RCP_LN2, chunk_size=CHUNK, cu_seqlens=cu, chunk_indices=idx,
            lower_bound=meta["lower_bound"]))
        qn, _, kn, _, b, g_cum = prologue
        w, u, _, kg, Aqk, Akk = fi.chunk_kda_fwd_intra(q=qn, k=kn, v=v, gk=g_cum, beta=b, scale=meta["scale"],
                                                       cu_seqlens=cu, chunk_size=CHUNK, chunk_indices=idx,
                                                       safe_gate=meta["safe_gate"], disable_recompute=False)
        M, init, h, v_new = _cp_state_pass(fi, meta, kg, w, u, gk=g_cum)
        o = fi.chunk_gla_fwd_o_gk(q=qn, v=v_new, g=g_cum, A=Aqk, h=h, scale=meta["scale"], cu_seqlens=cu,
                                  chunk_size=CHUNK, chunk_indices=idx)
        _save_forward(ctx, meta, (v, g, beta, A_log, dt_bias), prologue, M, init, Aqk=Aqk, Akk=Akk)
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        meta, s, fi, cu, idx, scale = _unpack(ctx)
        do = do.contiguous()
        q, k, v, g_cum, b = s["q"], s["k"], s["v"], s["g_cum"], s["beta"]
        w, u, qg, kg = fi.kda_recompute_w_u(q=q, k=k, v=v, beta=b, A=s["Akk"], gk=g_cum, cu_seqlens=cu,
                                            chunk_indices=idx)
        h, v_new = _state_pass(fi, kg, w, u, s["init"], cu, idx, gk=g_cum)
        _, dv = fi.chunk_kda_bwd_dAv(q=q, k=k, v=v_new, do=do, A=s["Aqk"], scale=scale, cu_seqlens=cu,
                                     chunk_size=CHUNK, chunk_indices=idx)
        dht = _cp_terminal_gradients(fi, meta, s, qg, kg, w, do, dv, gk=g_cum)
        dq, dk, dv, db, dg, _, dA_log, ddt_bias = fi.chunk_kda_bwd(
            q=q, k=k, v=v, beta=b, Aqk=s["Aqk"], Akk=s["Akk"], scale=scale, initial_state=s["init"], do=do,
            dht=dht, g=g_cum, g_org=s["g_raw"] if meta["gate"] else None, cu_seqlens=cu, chunk_indices=idx,
            chunk_size=CHUNK, safe_gate=meta["safe_gate"], lower_bound=meta["lower_bound"],
            use_gate_in_kernel=meta["gate"], A_log=s["A_log"], dt_bias=s["dt_bias"], disable_recompute=True,
            w=w, u=u, qg=qg, kg=kg, v_new=v_new, h=h)
        return _epilogue(s, meta, dq, dk, dv, dg, db, dA_log, ddt_bias)


# per kind: the autograd Function running its FLA stages around the engine's exchange
NATIVE = {GDN: _GDNNativeCP, KDA: _KDANativeCP}


def native_state_passing(kind, ctx, plan, q, k, v, g, beta, *, scale, flags):
    """The delta rule ``kind`` (name or descriptor) on this rank's ``[B, T_local, ...]`` shard in ``plan``'s local
    order -> o ``[B, T_local, HV, V]``."""
    fn = delta_kind(kind).pick(NATIVE, "backend='triton' CP")
    fi = load_internals()
    B, T_loc = q.shape[:2]
    HV, V = v.shape[2], v.shape[3]
    flat = lambda x: x.reshape(1, B * T_loc, *x.shape[2:]).contiguous()  # noqa: E731  pieces index flat tokens
    q1, k1, v1, g1, b1 = map(flat, (q, k, v, g, beta))
    cu, cu_cpu = device_cu_seqlens(plan.local_cu_seqlens, q.device)
    gate = flags.get("use_gate_in_kernel", False)
    meta = {"fi": fi, "plan": plan, "ctx": ctx, "cu": cu, "scale": float(scale), "gate": gate,
            "chunk_indices": fi.prepare_chunk_indices(cu, CHUNK, cu_seqlens_cpu=cu_cpu),
            "l2norm": flags.get("use_qk_l2norm_in_kernel", False),
            "beta_sigmoid": flags.get("use_beta_sigmoid_in_kernel", False),
            "safe_gate": flags.get("safe_gate", False), "lower_bound": flags.get("lower_bound")}
    A_log = flags.get("A_log") if gate else None
    dt_bias = flags.get("dt_bias") if gate else None
    return fn.apply(q1, k1, v1, g1, b1, A_log, dt_bias, meta).view(B, T_loc, HV, V)
