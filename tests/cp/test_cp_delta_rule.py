"""GDN/KDA through ``cp_context``: every method x layout x format on gloo ranks equals the single-rank run.

Each rank builds the same global problem, runs it whole (the reference) and its shard under CP, and
compares its shard of the outputs and input gradients (relative L2 <= 1e-5 / 1e-4); gate parameter
gradients are summed over ranks first (as Megatron's DP x CP gradient reduction does).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.dist import share_spawn
from tests.support.reference import rel_err

METHODS = [("p2p", {}), ("allgather", {}), ("grouped_allgather_p2p", {"group_size": "half"}),
           ("recursive_doubling", {}), ("ulysses", {}), ("allgather", {"ulysses_degree": 2})]


def _problem(kind, fmt, layout, P, seed):
    gen = torch.Generator().manual_seed(seed)
    H, HV, K, V = P, 2 * P, 8, 4
    if fmt == "bshd":
        B, T, cu = 2, 8 * P, None
    elif layout == "zigzag":
        B, cu = 1, [0, 4 * P, 6 * P, 12 * P]
        T = cu[-1]
    else:   # contiguous packed stream: documents span ranks and end inside them
        B, T = 1, 12 * P
        cu = [0, 5, 5 + 3 * P, 7 + 5 * P, 12 * P]
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    t = {"q": r(B, T, H, K), "k": r(B, T, H, K), "v": r(B, T, HV, V), "beta": r(B, T, HV),
         "g": r(B, T, HV) if kind == "gdn" else r(B, T, HV, K),
         "A_log": r(HV) * 0.5, "dt_bias": r(HV) if kind == "gdn" else r(HV * K)}
    return t, cu


def _run(kind, t, cu, ctx=None):
    from layers.ops import chunk_gated_delta_rule, chunk_kda

    fn = chunk_gated_delta_rule if kind == "gdn" else chunk_kda
    o, _ = fn(t["q"], t["k"], t["v"], t["g"], t["beta"], use_qk_l2norm_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True, A_log=t["A_log"], dt_bias=t["dt_bias"],
              cu_seqlens=None if ctx is not None else (None if cu is None else torch.tensor(cu)), cp_context=ctx)
    return o


def _worker(rank, P, cases):
    from layers.cp import build_cp_context, shard

    out = []
    for i, (kind, fmt, layout, method, extra) in enumerate(cases):
        half = P // 2 if P % 2 == 0 and P >= 4 else P   # groups of 2 at P=4; one group otherwise
        extra = {k: (half if v == "half" else v) for k, v in extra.items()}
        if extra.get("ulysses_degree", 1) > 1 and P % extra["ulysses_degree"]:
            continue
        t, cu = _problem(kind, fmt, layout, P, seed=1000 + i)
        ref = {n: x.clone().requires_grad_() for n, x in t.items()}
        o_ref = _run(kind, ref, cu)
        d_o = torch.randn(o_ref.shape, generator=torch.Generator().manual_seed(7 + i))
        (o_ref * d_o).sum().backward()
        ctx = build_cp_context(dist.group.WORLD, method=method, layout=layout, cu_seqlens=cu, **extra)
        seq_inputs = ("q", "k", "v", "g", "beta")
        loc = {n: (shard(x, ctx, seq_dim=1) if n in seq_inputs else x).detach().clone().requires_grad_()
               for n, x in t.items()}
        o = _run(kind, loc, cu, ctx)
        (o * shard(d_o, ctx, seq_dim=1)).sum().backward()
        errs = {"o": rel_err(o, shard(o_ref, ctx, seq_dim=1))}
        for n in seq_inputs:
            errs["d" + n] = rel_err(loc[n].grad, shard(ref[n].grad, ctx, seq_dim=1))
        for n in ("A_log", "dt_bias"):
            g = loc[n].grad.clone()
            dist.all_reduce(g)
            errs["d" + n] = rel_err(g, ref[n].grad)
        out.append(((kind, fmt, layout, method, tuple(sorted(extra.items()))), errs))
    return out


CASES = [(kind, fmt, layout, m, e) for kind in ("gdn", "kda") for fmt in ("bshd", "thd")
         for layout in ("zigzag", "contiguous") for m, e in METHODS]
_results = share_spawn(_worker, (2, 3, 4), CASES)  # one spawn per P for the CP modules (tests/support/dist.py)


@pytest.mark.parametrize("P", [2, 3, 4])
def test_cp_equals_single_rank(P):
    results = _results(P)
    assert results[0], "no case ran"
    bad = []
    for rank, res in enumerate(results):
        for case, errs in res:
            for name, err in errs.items():
                tol = 1e-5 if name == "o" else 1e-4
                if not err <= tol:
                    bad.append(f"rank {rank} {case} {name}: {err:.2e}")
    assert not bad, "\n".join(bad[:40])
