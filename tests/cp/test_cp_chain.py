"""State chain scans on gloo ranks (P = 2, 3, 4): every method x layout against a sequential fold.

Per world size one spawn runs every case: ``exclusive_scan`` forward and reversed order against an fp64
sequential fold of the same random affine maps, ``ChainScan`` gradients against autograd through a naive
differentiable fold (fp64, one process, on the gathered maps), and the communication counters against the
closed forms of docs/cp.md.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.support.dist import share_spawn
from tests.support.reference import rel_err

WORLD_SIZES = (2, 3, 4)
HV, K, W = 2, 3, 4


def _group_sizes(P):
    return [g for g in range(1, P + 1) if P % g == 0]


def _cases(P):
    cases = []
    for layout in ("zigzag", "contiguous"):
        for fmt in ("bshd", "thd"):
            for method in ("p2p", "allgather", "recursive_doubling"):
                cases.append((layout, fmt, method, None))
            for g in _group_sizes(P):
                cases.append((layout, fmt, "grouped_allgather_p2p", g))
    return cases


def _plan_args(P, layout, fmt):
    if fmt == "bshd":
        return dict(batch=2, seq_len=4 * P)
    if layout == "zigzag":
        cu = [0, 2 * P, 6 * P, 8 * P]                    # three documents, lengths divisible by 2P
    else:
        cu = [0, 1, 3 * P - 1, 3 * P, 4 * P]             # documents ending inside ranks and spanning them
    return dict(batch=1, seq_len=cu[-1], cu_seqlens=cu)


def _naive_fold(A, B, order):
    """X_t for every position t: fold of X <- A_j X + B_j over j before t in ``order`` (A [D,L,HV,K,K])."""
    X = torch.zeros_like(B[:, 0])
    out = [None] * A.shape[1]
    for t in order:
        out[t] = X
        X = A[:, t] @ X + B[:, t]
    return torch.stack(out, dim=1)


def _worker(rank, P):
    import torch.distributed as dist

    from layers.cp import CommStats, build_chain_plan, build_cp_context, exclusive_scan
    from layers.cp.chain import ChainScan

    results = []
    for case_id, (layout, fmt, method, g) in enumerate(_cases(P)):
        ctx = build_cp_context(None, method=method, layout=layout, group_size=g)
        plan = build_chain_plan(P, rank, layout, **_plan_args(P, layout, fmt))
        D, L = plan.num_chains, plan.chain_length
        gen = torch.Generator().manual_seed(1000 + case_id)
        # contractive random maps keep the fold well conditioned
        A = torch.randn(D, L, HV, K, K, generator=gen, dtype=torch.float64) / (2 * K)
        B = torch.randn(D, L, HV, K, W, generator=gen, dtype=torch.float64)
        G = torch.randn(D, L, HV, K, W, generator=gen, dtype=torch.float64)
        own = list(plan.own_positions)
        stats = CommStats()
        fwd = exclusive_scan(method, A[:, own].float(), B[:, own].float(), plan, range(L), stats,
                             comm=ctx.chain_comm)
        bwd = exclusive_scan(method, A[:, own].float(), B[:, own].float(), plan, reversed(range(L)), stats,
                             comm=ctx.chain_comm)
        fwd_ref = _naive_fold(A, B, range(L))[:, own]
        bwd_ref = _naive_fold(A, B, list(reversed(range(L))))[:, own]

        # ChainScan forward + backward against autograd through the naive fold
        M_own = A[:, own].float().clone().requires_grad_(True)
        E_own = B[:, own].float().clone().requires_grad_(True)
        grad_stats = CommStats()
        S_in = ChainScan.apply(M_own, E_own, method, plan, grad_stats, ctx.chain_comm)
        (S_in.double() * G[:, own]).sum().backward()
        A_ref, B_ref = A.clone().requires_grad_(True), B.clone().requires_grad_(True)
        (_naive_fold(A_ref, B_ref, range(L)) * G).sum().backward()
        results.append(dict(
            case=(layout, fmt, method, g), D=D,
            fwd_err=rel_err(fwd, fwd_ref), bwd_err=rel_err(bwd, bwd_ref),
            chain_fwd_err=rel_err(S_in, fwd_ref),
            dM_err=rel_err(M_own.grad, A_ref.grad[:, own]), dE_err=rel_err(E_own.grad, B_ref.grad[:, own]),
            stats_fwd=stats.records[0].as_dict(), stats_bwd=stats.records[1].as_dict(),
            grad_stats=[r.as_dict() for r in grad_stats.records]))

    # hybrid Ulysses(U) x state(P/U): the scan runs over the state group with the inner plan
    if P == 4:
        for method, g in (("p2p", None), ("allgather", None), ("recursive_doubling", None),
                          ("grouped_allgather_p2p", 2)):
            ctx = build_cp_context(None, method=method, layout="zigzag", ulysses_degree=2, group_size=g)
            plan = ctx.state_plan_for(2, 4)                        # local length 4 -> T = 16, Q = 2
            D, L = plan.num_chains, plan.chain_length
            gen = torch.Generator().manual_seed(7)
            A = torch.randn(D, L, HV, K, K, generator=gen, dtype=torch.float64) / (2 * K)
            B = torch.randn(D, L, HV, K, W, generator=gen, dtype=torch.float64)
            own = list(plan.own_positions)
            X = exclusive_scan(method, A[:, own].float(), B[:, own].float(), plan, range(L), ctx.stats,
                               comm=ctx.chain_comm)
            results.append(dict(case=("hybrid", method, g), fwd_err=rel_err(X, _naive_fold(A, B, range(L))[:, own]),
                                state_rank=ctx.state_rank, Q=plan.world_size,
                                received=ctx.stats.records[-1].bytes_received))
    dist.barrier()
    return results


_results = share_spawn(_worker, WORLD_SIZES)  # one spawn per P for the CP modules (tests/support/dist.py)


# ---- closed forms (docs/cp.md, "Cost of the state methods") ------------------------------------------------
def _nb(i):
    """Number of powers of two <= i (0 for i = 0): the rounds in which order index i receives."""
    return 0 if i <= 0 else int(math.floor(math.log2(i))) + 1


def _neighbours(r, n):
    """Messages a rank (or group) r of n receives in a walk 0..n-1 (contiguous) or 0..n-1, n-1..0 (zigzag)."""
    return (r > 0) + (r < n - 1)


def expected_comm(method, layout, P, r, D, g, phase):
    """(bytes_sent, bytes_received, steps) of one exclusive scan on rank r (fp32, D chains)."""
    s = 4 * D * HV * K * W                  # one running state
    m = 4 * D * HV * K * (K + W)            # one position's map [A | B]
    n_own = 2 if layout == "zigzag" else 1
    L = n_own * P
    if P == 1:
        return 0, 0, 0
    if method == "allgather":
        return (P - 1) * n_own * m, (P - 1) * n_own * m, 1
    if method == "p2p":
        if layout == "zigzag":
            k = _neighbours(r, P)
            return k * s, k * s, 2 * (P - 1)
        first, last = (r == 0, r == P - 1) if phase == "forward" else (r == P - 1, r == 0)
        return (0 if last else s), (0 if first else s), P - 1
    if method == "grouped_allgather_p2p":
        G, q = P // g, r // g
        gather = (g - 1) * n_own * m
        if layout == "zigzag":
            k = _neighbours(q, G) if G > 1 else 0
            return gather + k * s, gather + k * s, 2 * (G - 1) + (g > 1)
        first, last = (q == 0, q == G - 1) if phase == "forward" else (q == G - 1, q == 0)
        return gather + (0 if last else s), gather + (0 if first else s), G - 1 + (g > 1)
    if method == "recursive_doubling":
        steps = math.ceil(math.log2(L))
        if layout == "zigzag":
            k = _nb(r) + _nb(2 * P - 1 - r) - (r == P - 1)
            return k * m, k * m, steps
        i = r if phase == "forward" else P - 1 - r
        return _nb(P - 1 - i) * m, _nb(i) * m, steps
    raise AssertionError(method)


@pytest.mark.parametrize("P", WORLD_SIZES)
def test_exclusive_scan_matches_sequential_fold(P):
    for rank, res in enumerate(_results(P)):
        for c in res:
            if c["case"][0] == "hybrid":
                continue
            assert c["fwd_err"] < 1e-6, (P, rank, c["case"], c["fwd_err"])
            assert c["bwd_err"] < 1e-6, (P, rank, c["case"], c["bwd_err"])


@pytest.mark.parametrize("P", WORLD_SIZES)
def test_chain_scan_gradients_match_autograd(P):
    for rank, res in enumerate(_results(P)):
        for c in res:
            if c["case"][0] == "hybrid":
                continue
            assert c["chain_fwd_err"] < 1e-6, (P, rank, c["case"])
            assert c["dM_err"] < 1e-5 and c["dE_err"] < 1e-5, (P, rank, c["case"], c["dM_err"], c["dE_err"])


@pytest.mark.parametrize("P", WORLD_SIZES)
def test_comm_accounting_matches_closed_forms(P):
    for rank, res in enumerate(_results(P)):
        for c in res:
            if c["case"][0] == "hybrid":
                continue
            layout, _, method, g = c["case"]
            for phase, rec in (("forward", c["stats_fwd"]), ("backward", c["stats_bwd"])):
                want = expected_comm(method, layout, P, rank, c["D"], g, phase)
                got = (rec["bytes_sent"], rec["bytes_received"], rec["steps"])
                assert got == want, (P, rank, c["case"], phase, got, want)
            # ChainScan records one forward and one backward call with the same closed forms
            phases = [(r["phase"], r["name"]) for r in c["grad_stats"]]
            assert phases == [("forward", f"chain.{method}"), ("backward", f"chain.{method}")], phases
            for rec in c["grad_stats"]:
                want = expected_comm(method, layout, P, rank, c["D"], g, rec["phase"])
                assert (rec["bytes_sent"], rec["bytes_received"], rec["steps"]) == want


def test_hybrid_state_group_scan():
    res = _results(4)
    for rank, cases in enumerate(res):
        for c in (c for c in cases if c["case"][0] == "hybrid"):
            assert c["Q"] == 2 and c["state_rank"] == rank // 2
            assert c["fwd_err"] < 1e-6, (rank, c)
            if c["case"][1] == "allgather":                 # one partner in the state group of 2 ranks
                assert c["received"] == 2 * 4 * 2 * HV * K * (K + W)
