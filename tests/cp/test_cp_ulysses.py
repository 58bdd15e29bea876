"""Ulysses token exchange on gloo ranks (P = 2, 3, 4; in the spawns the CP modules share).

Each global tensor encodes (batch, token, head) in its values, so the exchanged tensor can be checked against
the definition: after ``seq_to_heads`` rank r holds head slice ``r % U`` of the tokens that its state rank
``r // U`` owns in the inner (P/U-rank) layout, in that layout's order (natural order when U = P). Also: the
round trip, gradients (each rank's gradient is its own tokens' upstream gradient, all heads), the byte
counts, and the head-divisibility error.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.dist import share_spawn

H = 12          # divisible by U = 2, 3, 4


def _reference_tokens(P, U, rank, layout, T, cu):
    """Global token indices the rank holds after seq_to_heads, from the layout definitions."""
    Q, q = P // U, rank // U
    if Q == 1:
        return list(range(T))
    if layout == "contiguous":
        c = T // Q
        return list(range(q * c, (q + 1) * c))
    docs = [(0, T)] if cu is None else list(zip(cu[:-1], cu[1:]))
    out = []
    for a, b in docs:
        part = (b - a) // (2 * Q)
        for j in (q, 2 * Q - 1 - q):
            out += list(range(a + j * part, a + (j + 1) * part))
    return out


def _configs(P):
    cfgs = []
    for layout in ("zigzag", "contiguous"):
        for U in sorted({P, 2} if P % 2 == 0 else {P}):
            method = "ulysses" if U == P else "allgather"
            cfgs.append((layout, method, U, None, 2, 4 * P))
            cu = [0, 2 * P, 6 * P, 8 * P] if layout == "zigzag" else [0, 1, 3 * P - 1, 3 * P, 4 * P]
            cfgs.append((layout, method, U, cu, 1, cu[-1]))
    return cfgs


def _worker(rank, P):
    import torch.distributed as dist

    from layers.cp import build_cp_context, heads_to_seq, seq_to_heads, shard

    results = []
    for layout, method, U, cu, B, T in _configs(P):
        ctx = build_cp_context(None, method=method, layout=layout, cu_seqlens=cu,
                               ulysses_degree=U if method != "ulysses" else None)
        # value = 1000 * b + 10 * t + h / 100 identifies (b, t, h); a trailing dim of 2 copies
        b = torch.arange(B).view(B, 1, 1, 1)
        t = torch.arange(T).view(1, T, 1, 1)
        h = torch.arange(H).view(1, 1, H, 1)
        x = (1000.0 * b + 10.0 * t + h / 100.0).expand(B, T, H, 2).double().contiguous()
        xl = shard(x, ctx, 1).clone().requires_grad_(True)
        y = seq_to_heads(xl, ctx, head_dim=2)
        toks = _reference_tokens(P, U, rank, layout, T, cu)
        u = rank % U
        want = x[:, toks][:, :, u * (H // U):(u + 1) * (H // U)]
        # gradient: upstream weights w at the (token, head) entries this rank holds after the exchange
        w = torch.randn(B, T, H, 2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        (y * w[:, toks][:, :, u * (H // U):(u + 1) * (H // U)]).sum().backward()
        back = heads_to_seq(y.detach(), ctx, head_dim=2)
        # 3-D tensors ([B, T, channels]) split along the channel dim
        x3 = x[..., 0]
        y3 = seq_to_heads(shard(x3, ctx, 1), ctx, head_dim=-1)
        stats = [r.as_dict() for r in ctx.stats.records]
        results.append(dict(cfg=(layout, method, U, cu), exchange_ok=torch.equal(y, want),
                            roundtrip_ok=torch.equal(back, xl.detach()),
                            grad_ok=torch.allclose(xl.grad, shard(w, ctx, 1)),
                            three_d_ok=torch.equal(y3, want[..., 0]), stats=stats,
                            local_bytes=xl.numel() * 8, U=U))
    ctx = build_cp_context(None, method="ulysses", layout="zigzag")
    try:
        seq_to_heads(torch.zeros(1, 2, P + 1, 2), ctx)
        err = None
    except ValueError as e:
        err = str(e)
    dist.barrier()
    return results, err


_results = share_spawn(_worker, (2, 3, 4))  # one spawn per P for the CP modules (tests/support/dist.py)


@pytest.mark.parametrize("P", [2, 3, 4])
def test_seq_to_heads_gives_inner_layout_order(P):
    for rank, (res, _) in enumerate(_results(P)):
        for c in res:
            assert c["exchange_ok"], (P, rank, c["cfg"])
            assert c["three_d_ok"], (P, rank, c["cfg"])


@pytest.mark.parametrize("P", [2, 3, 4])
def test_round_trip_and_gradients(P):
    for rank, (res, _) in enumerate(_results(P)):
        for c in res:
            assert c["roundtrip_ok"], (P, rank, c["cfg"])
            assert c["grad_ok"], (P, rank, c["cfg"])


@pytest.mark.parametrize("P", [2, 3, 4])
def test_ulysses_bytes(P):
    for _rank, (res, _) in enumerate(_results(P)):
        for c in res:
            U, n = c["U"], c["local_bytes"]
            recs = [r for r in c["stats"] if r["name"].startswith("ulysses.")]
            # forward seq_to_heads, backward heads_to_seq, then the explicit heads_to_seq
            assert [(r["name"], r["phase"]) for r in recs[:3]] == [
                ("ulysses.seq_to_heads", "forward"), ("ulysses.heads_to_seq", "backward"),
                ("ulysses.heads_to_seq", "forward")]
            for r in recs[:3]:
                assert r["bytes_sent"] == r["bytes_received"] == (U - 1) * n // U and r["steps"] == 1


@pytest.mark.parametrize("P", [2, 3, 4])
def test_heads_not_divisible(P):
    err = _results(P)[0][1]
    assert err is not None and f"divisible by the Ulysses degree U={P}" in err and f"size {P + 1}" in err
