"""causal_conv1d under context parallelism: the halo of W-1 tokens before each local piece, in chain order.

Rank-local outputs and gradients (x; weight and bias summed over ranks) must equal the single-rank run of the
same global input, on gloo ranks P = 2, 3, 4 (one spawn per P, shared by the CP modules), for zigzag and contiguous
layouts, BSHD rows and packed THD documents (spanning ranks, ending inside ranks, shorter than the kernel).
"""
import itertools

import pytest
import torch

from tests.support.dist import share_spawn
from tests.support.reference import rel_err

D = 5


def _thd_lengths(layout, P):
    """Document lengths: zigzag needs multiples of 2P (parts of 1..3 tokens); contiguous is arbitrary."""
    if layout == "zigzag":
        return [2 * P, 6 * P, 4 * P, 2 * P]
    lengths = [1, 2, 7, 3 * P + 1, 1, 2]
    lengths[-1] += (-sum(lengths)) % P
    return lengths


def _cases(P):
    """(name, layout, method, batch, seq_len, cu_seqlens, W, with_bias, activation)."""
    cases = []
    for layout in ("zigzag", "contiguous"):
        per_rank = 2 * P if layout == "zigzag" else P
        cases += [
            (f"{layout}-bshd", layout, "p2p", 2, per_rank * 3, None, 4, True, "silu"),
            (f"{layout}-bshd-short", layout, "allgather", 2, per_rank, None, 4, False, None),  # pieces of 1 < W-1
            (f"{layout}-bshd-ulysses", layout, "ulysses", 1, per_rank * 2, None, 3, True, None),
            (f"{layout}-bshd-w1", layout, "p2p", 1, per_rank, None, 1, True, "silu"),
        ]
        cu = [0] + list(itertools.accumulate(_thd_lengths(layout, P)))
        cases += [
            (f"{layout}-thd", layout, "p2p", 1, cu[-1], cu, 4, True, "silu"),
            (f"{layout}-thd-ulysses", layout, "ulysses", 1, cu[-1], cu, 2, False, "silu"),
        ]
    return cases


def _worker(rank, world_size):
    import torch.distributed as dist

    from layers.cp import build_cp_context, shard
    from layers.ops import causal_conv1d

    results = {}
    for case in _cases(world_size):
        name, layout, method, B, T, cu, W, with_bias, activation = case
        gen = torch.Generator().manual_seed(len(results))
        x = torch.randn(B, T, D, generator=gen)
        weight = torch.randn(D, W, generator=gen) / W ** 0.5
        bias = torch.randn(D, generator=gen) if with_bias else None
        grad_out = torch.randn(B, T, D, generator=gen)

        # single-rank run of the global input (every rank computes it; it is tiny)
        leaves = [t.clone().requires_grad_(True) for t in (x, weight) + ((bias,) if with_bias else ())]
        y_ref = causal_conv1d(leaves[0], leaves[1], leaves[2] if with_bias else None, activation, cu_seqlens=cu)
        ref_grads = torch.autograd.grad(y_ref, leaves, grad_out)

        ctx = build_cp_context(None, method=method, layout=layout,
                               cu_seqlens=None if cu is None else torch.tensor(cu))
        ctx.stats.reset()
        x_local = shard(x, ctx, 1).requires_grad_(True)
        local = [x_local] + [t.clone().requires_grad_(True) for t in (weight,) + ((bias,) if with_bias else ())]
        y = causal_conv1d(local[0], local[1], local[2] if with_bias else None, activation, cp_context=ctx)
        forward_bytes = ctx.stats.totals(phase="forward")["bytes_received"]
        grads = torch.autograd.grad(y, local, shard(grad_out, ctx, 1))
        param_grads = [g.clone() for g in grads[1:]]
        for g in param_grads:
            dist.all_reduce(g)
        results[name] = {
            "y": rel_err(y, shard(y_ref, ctx, 1)),
            "dx": rel_err(grads[0], shard(ref_grads[0], ctx, 1)),
            "dparams": [rel_err(g, r) for g, r in zip(param_grads, ref_grads[1:])],
            "dtype": y.dtype == x.dtype and y.shape == x_local.shape,
            "forward_bytes": forward_bytes,
            "B": B, "W": W,
        }
    return results


_results = share_spawn(_worker, (2, 3, 4))  # one spawn per P for the CP modules (tests/support/dist.py)


@pytest.mark.parametrize("P", [2, 3, 4])
def test_cp_conv_matches_single_rank(P):
    per_rank = _results(P)
    failures = []
    for name, *_ in _cases(P):
        for rank, res in enumerate(per_rank):
            r = res[name]
            if not r["dtype"] or r["y"] > 1e-5 or r["dx"] > 1e-4 or any(e > 1e-4 for e in r["dparams"]):
                failures.append((name, rank, r))
    assert not failures, failures


@pytest.mark.parametrize("P", [2, 3, 4])
def test_halo_bytes_closed_form(P):
    """Long pieces: contiguous rank r > 0 receives W-1 tokens per row from r-1; zigzag rank r receives them
    for part r from rank r-1 (r > 0) and for part 2P-1-r from rank r+1 (r < P-1; rank P-1 has it locally)."""
    per_rank = _results(P)
    for rank, res in enumerate(per_rank):
        for layout, messages in (("contiguous", int(rank > 0)), ("zigzag", int(rank > 0) + int(rank < P - 1))):
            r = res[f"{layout}-bshd"]
            assert r["forward_bytes"] == messages * r["B"] * (r["W"] - 1) * D * 4, (layout, rank, r)
        assert res["zigzag-bshd-w1"]["forward_bytes"] == 0


def _simulate(layout, P, B, T, cu, W):
    """All ranks in one process: deliver every rank's sends by hand, then compare each rank's local conv."""
    from layers.cp.halo import halo_pattern
    from layers.cp.plan import build_chain_plan
    from layers.ops.eager.conv import causal_conv1d as eager_conv

    gen = torch.Generator().manual_seed(P * 100 + W)
    x = torch.randn(B, T, 2, generator=gen, dtype=torch.float64)
    weight = torch.randn(2, W, generator=gen, dtype=torch.float64)
    cu_t = None if cu is None else torch.tensor(cu)
    y_global = eager_conv(x, weight, cu_seqlens=cu_t)
    plans = [build_chain_plan(P, r, layout, batch=B, seq_len=T, cu_seqlens=cu) for r in range(P)]
    patterns = [halo_pattern(plan, cu_t, W) for plan in plans]
    x_local = [x[:, plan.seq_index].reshape(-1, 2) for plan in plans]
    for r in range(P):
        arrived = []
        for p in range(P):
            offset, n = sum(patterns[p].send_counts[:r]), patterns[p].send_counts[r]
            assert n == patterns[r].recv_counts[p]
            arrived.append(x_local[p][patterns[p].send_index[offset:offset + n]])
        table = torch.cat([x_local[r]] + arrived + [x.new_zeros(1, 2)])
        index = patterns[r].history_index
        history = table[index.reshape(-1)].reshape(index.shape[0], W - 1, 2)
        y = eager_conv(x_local[r][None], weight, cu_seqlens=patterns[r].piece_cu_seqlens, history=history)
        expected = y_global[:, plans[r].seq_index].reshape(-1, 2)
        assert rel_err(y[0], expected) <= 1e-12, (layout, P, B, T, cu, W, r)


@pytest.mark.parametrize("P", [1, 2, 3, 5])
def test_halo_pattern_single_process(P):
    """The exchange pattern alone, for many shapes (pieces far shorter than W-1 reach back over several ranks)."""
    for W in (1, 2, 4, 7):
        for B in (1, 2):
            _simulate("zigzag", P, B, 2 * P, None, W)
            _simulate("zigzag", P, B, 6 * P, None, W)
            _simulate("contiguous", P, B, P, None, W)
            _simulate("contiguous", P, B, 4 * P, None, W)
        _simulate("zigzag", P, 1, 10 * P, [0, 2 * P, 4 * P, 10 * P], W)
        lengths = [1, 2, 5, 3, 1, 6]
        lengths[-1] += (-sum(lengths)) % P
        _simulate("contiguous", P, 1, sum(lengths), [0] + list(itertools.accumulate(lengths)), W)
        _simulate("contiguous", P, 1, 2 * P, [0, 1, 2 * P], W)
