"""CP sub-groups are created collectively (the whole partition, one order), so ranks with different group
histories still meet: rank 0 joins an extra local group and ranks 0-1 alone build a context on their own pair
before every rank builds hybrid Ulysses x state and grouped all-gather contexts on the world. Before, sub-groups
were named from how many groups each member had joined (torch's hashed local names): rank 0 and rank 1 named
their Ulysses group differently and hung."""
from __future__ import annotations

import torch
import torch.distributed as dist

from dist import run_distributed

WORLD = 4


def _members_sum(group) -> list:
    """All-reduce of each member's global rank over ``group``: the sum of its members, if the group works."""
    x = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(x, group=group)
    return [int(x.item()), sorted(dist.get_process_group_ranks(group))]


def _worker(rank, world_size):
    from layers.cp import build_cp_context

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]   # megatron's way: every rank, every group
    if rank == 0:
        dist.new_group([0], use_local_synchronization=True)   # a history the other ranks do not share
    pair = pairs[rank // 2]
    out = {}
    if rank < 2:                                              # asymmetric use: only ranks 0 and 1 take part
        out["pair"] = build_cp_context(pair, method="allgather", layout="zigzag").world_size
    hybrid = build_cp_context(None, method="p2p", layout="zigzag", ulysses_degree=2)
    out["ulysses"] = _members_sum(hybrid.ulysses_group)
    out["state"] = _members_sum(hybrid.state_group)
    grouped = build_cp_context(None, method="grouped_allgather_p2p", layout="contiguous", group_size=2)
    out["gather"] = _members_sum(grouped.gather_group)
    again = build_cp_context(None, method="p2p", layout="zigzag", ulysses_degree=2)   # cached: no new groups
    out["cached"] = again.ulysses_group is hybrid.ulysses_group and again.state_group is hybrid.state_group
    return out


def test_subgroups_meet_despite_different_histories():
    results = run_distributed(_worker, WORLD, timeout=400)
    for rank, out in enumerate(results):
        u = [2 * (rank // 2), 2 * (rank // 2) + 1]
        s = [rank % 2, rank % 2 + 2]
        assert out["ulysses"] == [sum(u), u] and out["state"] == [sum(s), s], (rank, out)
        assert out["gather"] == [sum(u), u], (rank, out)     # P=4, g=2: gather groups {0,1}, {2,3}
        assert out["cached"] is True
        assert out.get("pair") == (2 if rank < 2 else None)
