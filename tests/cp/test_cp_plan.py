"""Layouts, chain plans, contexts, shard/unshard.

Single-process: plans against megatron-core's ``get_batch_on_this_cp_rank`` (BSHD zigzag), an independent
reference of Transformer Engine's ``thd_get_partitioned_indices`` (THD zigzag) and token-level document ids
(pieces, links, transitions). Multi-rank (gloo, P = 2, 3, 4, in the spawns the CP modules share): shard/unshard
on real groups, unshard gradients, and the ValueErrors of bad contexts.
"""
from __future__ import annotations

import random

import pytest
import torch

from layers.cp import build_chain_plan, local_seq_index
from layers.cp.plan import chain_owners
from tests.support.dist import share_spawn
from tests.support.helpers import FakeGroup, torch_distributed_answers_fake_groups


def _megatron_zigzag(x, P, r, monkeypatch):
    from layers.base.megatron_compat import megatron_cp_batch

    torch_distributed_answers_fake_groups(monkeypatch)
    return megatron_cp_batch({"tokens": x.clone()}, cp_group=FakeGroup(P, r))["tokens"]


def _te_thd_reference(cu, P, r):
    """thd_get_partitioned_indices by definition: every (padded) document cut into 2P equal parts; rank r keeps
    parts r and 2P-1-r of each document, documents in order."""
    out = []
    for a, b in zip(cu[:-1], cu[1:]):
        part = (b - a) // (2 * P)
        for j in (r, 2 * P - 1 - r):
            out += list(range(a + j * part, a + (j + 1) * part))
    return out


def test_zigzag_example_from_megatron_docs():
    got = [local_seq_index(4, r, "zigzag", 16).tolist() for r in range(4)]
    assert got == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 6])
def test_bshd_zigzag_equals_megatron(P, monkeypatch):
    T, B = 4 * P, 2
    x = torch.arange(B * T).reshape(B, T) * 10
    for r in range(P):
        want = _megatron_zigzag(x, P, r, monkeypatch)
        plan = build_chain_plan(P, r, "zigzag", batch=B, seq_len=T)
        assert torch.equal(x.index_select(1, plan.seq_index), want)
        assert torch.equal(x.reshape(-1)[plan.local_token_ids], want.reshape(-1))


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_thd_zigzag_equals_te_partition(P):
    rng = random.Random(P)
    cu = [0]
    for _ in range(5):
        cu.append(cu[-1] + 2 * P * rng.randint(1, 3))
    for r in range(P):
        plan = build_chain_plan(P, r, "zigzag", batch=1, seq_len=cu[-1], cu_seqlens=cu)
        assert plan.seq_index.tolist() == _te_thd_reference(cu, P, r)
        assert plan.num_chains == 5 and plan.chain_length == 2 * P
        assert plan.own_positions == (r, 2 * P - 1 - r)


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_contiguous_layout(P):
    T = 3 * P
    for r in range(P):
        assert local_seq_index(P, r, "contiguous", T).tolist() == list(range(3 * r, 3 * r + 3))
    assert chain_owners(P, "contiguous") == tuple(range(P))
    assert chain_owners(P, "zigzag") == tuple(range(P)) + tuple(reversed(range(P)))


def _doc_ids(cu, T, batch):
    """Document (chain) id of every global flat token."""
    if cu is None:
        return torch.arange(batch).repeat_interleave(T)
    ids = torch.zeros(T, dtype=torch.int64)
    for d, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        ids[a:b] = d
    return ids


def _position_of(P, layout, T, cu, batch):
    """Chain position of every global flat token, from the definition of the layouts."""
    if cu is None:
        t = torch.arange(T).repeat(batch)
        parts = 2 * P if layout == "zigzag" else P
        return t // (T // parts)
    pos = torch.zeros(T, dtype=torch.int64)
    if layout == "contiguous":
        return torch.arange(T) // (T // P)
    for a, b in zip(cu[:-1], cu[1:]):
        pos[a:b] = (torch.arange(b - a) // ((b - a) // (2 * P))) if b > a else 0
    return pos


def _configs():
    out = []
    for P in (1, 2, 3, 4):
        out.append((P, "zigzag", None, 2, 4 * P))
        out.append((P, "contiguous", None, 2, 2 * P))
        out.append((P, "zigzag", [0, 2 * P, 6 * P, 8 * P], 1, 8 * P))
        out.append((P, "contiguous", [0, 1, 3 * P - 1, 3 * P, 4 * P], 1, 4 * P))
        out.append((P, "contiguous", [0, P, 2 * P, 3 * P], 1, 3 * P))       # documents start at rank starts
        out.append((P, "contiguous", [0, 5 * P], 1, 5 * P))                 # one document over all ranks
    return out


@pytest.mark.parametrize("P,layout,cu,batch,T", _configs())
def test_plan_pieces_links_transitions(P, layout, cu, batch, T):
    """Check every plan field against token-level document ids and positions."""
    doc = _doc_ids(cu, T, batch)
    pos = _position_of(P, layout, T, cu, batch)
    seen = []
    for r in range(P):
        plan = build_chain_plan(P, r, layout, batch=batch, seq_len=T, cu_seqlens=cu)
        ids = plan.local_token_ids
        seen.append(ids)
        ldoc, lpos = doc[ids], pos[ids]
        assert set(lpos.tolist()) == set(plan.own_positions)
        assert all(plan.owners[t] == r for t in plan.own_positions)
        cuts = plan.local_cu_seqlens.tolist()
        assert cuts[0] == 0 and cuts[-1] == ids.numel()
        for a, b in zip(cuts[:-1], cuts[1:]):          # a piece never crosses a document or a position
            assert b > a
            assert ldoc[a:b].unique().numel() == 1 and lpos[a:b].unique().numel() == 1
            assert torch.equal(ids[a:b], torch.arange(int(ids[a]), int(ids[a]) + b - a))
        for a, _b in zip(cuts[1:-1], cuts[2:]):          # consecutive pieces differ in document or position
            prev = cuts[cuts.index(a) - 1]
            assert (ldoc[prev], lpos[prev]) != (ldoc[a], lpos[a])
        D = plan.num_chains
        for d in range(D):
            for s, t in enumerate(plan.own_positions):
                lo, hi = plan.segment_bounds[d, s].tolist()
                if cu is None or layout == "zigzag":
                    sel = ((ldoc == d) & (lpos == t)).nonzero().reshape(-1)
                else:
                    sel = (lpos == t).nonzero().reshape(-1)
                assert (lo, hi) == (int(sel[0]), int(sel[-1]) + 1)
                assert cuts[int(plan.entry_piece[d, s])] == lo and cuts[int(plan.exit_piece[d, s]) + 1] == hi
                # the state leaving the segment depends on the entering one iff one document covers it
                assert bool(plan.exit_has_transition[d, s]) == bool(ldoc[lo] == ldoc[hi - 1])
    allids = torch.cat(seen).sort().values
    assert torch.equal(allids, torch.arange(batch * T))       # the ranks partition the tokens
    # link t -> t+1 exists iff the last token of position t and the first of t+1 are in one document
    plan0 = build_chain_plan(P, 0, layout, batch=batch, seq_len=T, cu_seqlens=cu)
    for d in range(plan0.num_chains):
        for t in range(plan0.chain_length):
            if t == plan0.chain_length - 1:
                want = False
            else:
                in_chain = (doc == d) if (cu is None or layout == "zigzag") else torch.ones_like(doc, dtype=torch.bool)
                last = (in_chain & (pos == t)).nonzero().reshape(-1)[-1]
                first = (in_chain & (pos == t + 1)).nonzero().reshape(-1)[0]
                want = bool(doc[last] == doc[first])
            assert bool(plan0.link_mask[d, t]) == want, (d, t)


def test_plan_errors():
    with pytest.raises(ValueError, match="layout must be one of"):
        build_chain_plan(2, 0, "ring", batch=1, seq_len=8)
    with pytest.raises(ValueError, match=r"divisible by 2\*P=4"):
        build_chain_plan(2, 0, "zigzag", batch=1, seq_len=6)
    with pytest.raises(ValueError, match=r"every document length divisible by 2\*P=4.*\(1, 6\)"):
        build_chain_plan(2, 0, "zigzag", batch=1, seq_len=10, cu_seqlens=[0, 4, 10])
    with pytest.raises(ValueError, match="divisible by P=3"):
        build_chain_plan(3, 0, "contiguous", batch=1, seq_len=10, cu_seqlens=[0, 4, 10])
    with pytest.raises(ValueError, match="batch == 1"):
        build_chain_plan(2, 0, "contiguous", batch=2, seq_len=8, cu_seqlens=[0, 4, 8])
    with pytest.raises(ValueError, match="rank must be in"):
        build_chain_plan(2, 2, "contiguous", batch=1, seq_len=8)


# ---- multi-rank ------------------------------------------------------------------------------------------
def _catch(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _worker(rank, P):
    import torch.distributed as dist

    from layers.cp import build_cp_context, shard, unshard

    out = {}
    T, B, H = 4 * P, 2, 3
    x = torch.randn(B, T, H, generator=torch.Generator().manual_seed(0))
    ctx = build_cp_context(None, method="allgather", layout="zigzag")
    # by definition (megatron-core's split is checked in-process above): 2P parts, keep r and 2P-1-r
    parts = x.reshape(B, 2 * P, T // (2 * P), H)
    out["bshd_zigzag"] = torch.equal(shard(x, ctx, 1), torch.cat([parts[:, rank], parts[:, 2 * P - 1 - rank]], 1))
    # THD zigzag shard vs the TE definition; contiguous THD shard; round trips and unshard gradients
    cu = [0, 2 * P, 6 * P, 8 * P]
    xt = torch.randn(1, cu[-1], H, generator=torch.Generator().manual_seed(1))
    ctx_thd = build_cp_context(None, method="p2p", layout="zigzag", cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    out["thd_te"] = torch.equal(shard(xt, ctx_thd, 1), xt[:, _te_thd_reference(cu, P, rank)])
    roundtrips = []
    for c, glob, dim in ((ctx, x, 1), (ctx_thd, xt, 1),
                         (build_cp_context(None, method="p2p", layout="contiguous"), x.transpose(0, 1), 0),
                         (build_cp_context(None, method="p2p", layout="contiguous", cu_seqlens=[0, 1, 4 * P]),
                          xt[:, :4 * P], 1)):
        roundtrips.append(torch.equal(unshard(shard(glob, c, dim), c, dim), glob))
    out["roundtrips"] = roundtrips
    w = torch.randn(B, T, H, generator=torch.Generator().manual_seed(2))
    grads = {}
    for mode in ("sum", "owner"):
        xl = shard(x, ctx, 1).clone().requires_grad_(True)
        (unshard(xl, ctx, 1, grad=mode) * w).sum().backward()
        grads[mode] = (xl.grad, shard(w, ctx, 1))
    out["grad_sum"] = torch.allclose(grads["sum"][0], P * grads["sum"][1], atol=1e-6)
    out["grad_owner"] = torch.allclose(grads["owner"][0], grads["owner"][1], atol=1e-6)
    ag = [r for r in ctx.stats.records if r.name == "all_gather"]
    out["unshard_bytes"] = (ag[-1].bytes_received, (P - 1) * B * (T // P) * H * 4)

    # bad contexts
    odd = [0, 2 * P, 2 * P + 2]              # second document of length 2, not divisible by 2P >= 4
    out["errors"] = {
        "method": _catch(lambda: build_cp_context(None, method="ring", layout="zigzag")),
        "layout": _catch(lambda: build_cp_context(None, method="p2p", layout="striped")),
        "thd_zigzag": _catch(lambda: build_cp_context(None, method="p2p", layout="zigzag", cu_seqlens=odd)),
        "thd_total": _catch(lambda: build_cp_context(None, method="p2p", layout="contiguous",
                                                     cu_seqlens=[0, 3, P * 4 + 1])),
        "bshd_total": _catch(lambda: shard(torch.zeros(1, P + 1), build_cp_context(None, method="p2p",
                                                                                    layout="contiguous"), 1)),
        "group_size": _catch(lambda: build_cp_context(None, method="grouped_allgather_p2p", layout="zigzag",
                                                      group_size=P + 1)),
        "group_size_missing": _catch(lambda: build_cp_context(None, method="grouped_allgather_p2p",
                                                              layout="zigzag")),
        "group_size_other": _catch(lambda: build_cp_context(None, method="p2p", layout="zigzag", group_size=1)),
        "ulysses_degree": _catch(lambda: build_cp_context(None, method="p2p", layout="zigzag",
                                                          ulysses_degree=P + 1)),
        "heads": _catch(lambda: build_cp_context(None, method="ulysses", layout="zigzag").check_heads(H=P + 1,
                                                                                                     HV=2 * P)),
    }
    dist.barrier()
    return out


_results = share_spawn(_worker, (2, 3, 4))  # one spawn per P for the CP modules (tests/support/dist.py)


@pytest.mark.parametrize("P", [2, 3, 4])
def test_shard_unshard_on_ranks(P):
    for rank, out in enumerate(_results(P)):
        assert out["bshd_zigzag"], rank
        assert out["thd_te"], rank
        assert all(out["roundtrips"]), (rank, out["roundtrips"])
        assert out["grad_sum"] and out["grad_owner"], rank
        got, want = out["unshard_bytes"]
        assert got == want


@pytest.mark.parametrize("P", [2, 3, 4])
def test_bad_contexts_raise_value_errors(P):
    err = _results(P)[0]["errors"]
    assert "method must be one of" in err["method"] and "'ring'" in err["method"]
    assert "layout must be one of" in err["layout"]
    assert f"every document length divisible by 2*P={2 * P}" in err["thd_zigzag"]
    assert f"divisible by P={P}" in err["thd_total"]
    assert f"divisible by P={P}" in err["bshd_total"]
    assert f"group_size={P + 1} must divide" in err["group_size"]
    assert "needs group_size" in err["group_size_missing"]
    assert "only used by method='grouped_allgather_p2p'" in err["group_size_other"]
    assert f"ulysses_degree U={P + 1} must divide the CP size P={P}" in err["ulysses_degree"]
    assert f"divisible by the Ulysses degree U={P}" in err["heads"] and f"H={P + 1}" in err["heads"]
