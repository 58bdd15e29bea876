"""CP sub-groups never hang, whatever groups each rank created before (one spawn of 8 gloo ranks, no model).

CP groups of 4 in a world of 8, both of megatron's shapes: blocks {0..3}, {4..7} and interleaved {0,2,4,6},
{1,3,5,7} (TP = 2). The ranks' histories differ on purpose: rank 0 holds an extra one-rank local group, ranks
4-5 and 1-3 local groups of the very ranks of later sub-groups, ranks 4-7 build a context on their block first.
torch names a local group (``use_local_synchronization=True``) from its ranks and how many groups the process
holds, so sub-groups made by their members alone (the code before ``register_cp_subgroups``) hang here. Now:
an unregistered hybrid context on a smaller-than-world CP group raises on every member; after the collective
``register_cp_subgroups_from_args`` (the ``--hp-*`` flags) and ``register_cp_subgroups`` (the ranks asking for
different configurations) every hybrid Ulysses x state,
grouped all-gather and Ulysses context on every CP group works (an all_reduce over each sub-group); on the whole
world the sub-groups are created on demand by every rank, also while only some ranks use another CP group.
"""
from __future__ import annotations

from argparse import Namespace

import pytest
import torch.distributed as dist

from tests.support.dist import case_started, members_sum, run_distributed

WORLD = 8
CASE_TIMEOUT_S = 120
BLOCKS = [[0, 1, 2, 3], [4, 5, 6, 7]]
INTERLEAVED = [[0, 2, 4, 6], [1, 3, 5, 7]]


def _contexts(cp_group) -> dict:
    """The sub-groups of hybrid Ulysses(2) x p2p, grouped all-gather (g=2) and Ulysses on ``cp_group``."""
    from layers.cp import build_cp_context

    hybrid = build_cp_context(cp_group, method="p2p", layout="zigzag", ulysses_degree=2)
    grouped = build_cp_context(cp_group, method="grouped_allgather_p2p", layout="contiguous", group_size=2)
    ulysses = build_cp_context(cp_group, method="ulysses", layout="zigzag")
    again = build_cp_context(cp_group, method="p2p", layout="zigzag", ulysses_degree=2)
    return {"ulysses": members_sum(hybrid.ulysses_group), "state": members_sum(hybrid.state_group),
            "gather": members_sum(grouped.gather_group), "solo_state": members_sum(ulysses.state_group),
            "cached": again.ulysses_group is hybrid.ulysses_group and again.state_group is hybrid.state_group}


def _worker(rank, world_size):
    from hp_megatron.training.cp_subgroup_registration import register_cp_subgroups_from_args
    from layers.cp import build_cp_context, register_cp_subgroups

    out = {}
    case_started("histories")
    blocks = [dist.new_group(r) for r in BLOCKS]               # megatron's way: every rank, every group
    inter = [dist.new_group(r) for r in INTERLEAVED]
    block, stride = blocks[rank // 4], inter[rank % 2]
    if rank == 0:
        dist.new_group([0], use_local_synchronization=True)
    if rank in (4, 5):
        dist.new_group([4, 5], use_local_synchronization=True)
    if rank in (1, 3):
        dist.new_group([1, 3], use_local_synchronization=True)
    if rank >= 4:                                              # other contexts first, on some ranks only
        build_cp_context(block, method="allgather", layout="zigzag")

    case_started("unregistered")
    try:
        build_cp_context(block, method="p2p", layout="zigzag", ulysses_degree=2)
        out["unregistered"] = "built"
    except RuntimeError as err:
        out["unregistered"] = str(err)

    case_started("register")
    flags = Namespace(hp_cp_method="grouped_allgather_p2p", hp_cp_group_size=2, hp_cp_ulysses_degree=None,
                      context_parallel_size=4)
    out["registered_flags"] = register_cp_subgroups_from_args(flags, cp_groups=[block])
    if rank < 4:   # the ranks ask for different things; the union is registered on every rank
        made = register_cp_subgroups([block, stride], method="auto")
    else:
        made = register_cp_subgroups(block, method="p2p", ulysses_degree=2)
    out["registered"] = made
    out["registered_again"] = register_cp_subgroups([block, stride], method="auto")
    solo = {r: dist.new_group([r]) for r in range(world_size)}[rank]     # e.g. megatron's CP group at CP = 1
    out["registered_solo"] = register_cp_subgroups(solo, method="p2p", ulysses_degree=2)
    somewhere = dict(method="p2p", ulysses_degree=3 if rank >= 4 else 2)     # invalid on ranks 4-7 only
    for name, bad in (("bad_method", dict(method="zigzag")), ("bad_degree", dict(method="p2p", ulysses_degree=3)),
                      ("bad_somewhere", somewhere)):
        try:                                       # every rank raises: none is left waiting
            register_cp_subgroups(block, **bad)
        except ValueError as err:
            out[name] = str(err)

    for name, group in (("block", block), ("interleaved", stride)):
        case_started(name)
        out[name] = _contexts(group)

    case_started("world")
    pair = dist.new_group([0, 1])                              # every rank creates it ...
    if rank < 2:                                               # ... only ranks 0 and 1 use it
        out["pair"] = build_cp_context(pair, method="allgather", layout="zigzag").world_size
    out["world"] = _contexts(None)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, WORLD, timeout=CASE_TIMEOUT_S)


def _expected(cp: list, rank: int) -> dict:
    """Sub-group members by the rank arithmetic of layers/cp/context.py on the CP group ``cp``: U = 2 (Ulysses
    pairs of neighbours, state groups of every other rank), g = 2 with U = 1, and U = P (one-rank state groups)."""
    i = cp.index(rank)
    ulysses = cp[2 * (i // 2):2 * (i // 2) + 2]
    state = cp[i % 2::2]
    gather = ulysses                                            # g = 2 consecutive state ranks (U = 1)
    return {"ulysses": [sum(ulysses), ulysses], "state": [sum(state), state], "gather": [sum(gather), gather],
            "solo_state": [rank, [rank]], "cached": True}


def test_unregistered_smaller_cp_group_raises_on_every_member(results):
    for rank, out in enumerate(results):
        assert "register_cp_subgroups" in out["unregistered"] and f"{BLOCKS[rank // 4]}" in out["unregistered"], \
            (rank, out["unregistered"])


def test_registration_is_the_union_and_the_same_on_every_rank(results):
    flags, made = results[0]["registered_flags"], results[0]["registered"]
    assert all(out["registered_flags"] == flags and out["registered"] == made for out in results)
    assert all(out["registered_again"] == [] and out["registered_solo"] == [] for out in results)
    # --hp-cp-method grouped_allgather_p2p --hp-cp-group-size 2 on both blocks: their all-gather pairs
    assert flags == [(0, 1), (2, 3), (4, 5), (6, 7)]
    members = set(made)
    assert not members & set(flags) and len(members) == len(made)   # nothing twice
    # ranks 4-7 asked only for U=2 on their block; ranks 0-3 for "auto" on {0..3} and both interleaved groups
    assert {(4, 6), (5, 7), (0, 2), (1, 3)} <= members           # block U=2 state groups
    assert {(0, 4), (2, 6), (1, 5), (3, 7)} <= members          # interleaved U=2 state groups
    assert not any(len(r) < 2 for r in members)
    assert (0, 1, 2, 3) not in members and (4, 5, 6, 7) not in members   # no sub-group is the CP group itself


@pytest.mark.parametrize("layout", ["block", "interleaved"])
def test_subgroups_of_smaller_cp_groups_work(results, layout):
    groups = BLOCKS if layout == "block" else INTERLEAVED
    for rank, out in enumerate(results):
        cp = next(g for g in groups if rank in g)
        assert out[layout] == _expected(cp, rank), (rank, layout, out[layout])


def test_world_subgroups_created_on_demand_meet(results):
    for rank, out in enumerate(results):
        assert out["world"] == _expected(list(range(WORLD)), rank), (rank, out["world"])
        assert out.get("pair") == (2 if rank < 2 else None)


def test_registration_rejects_bad_configurations(results):
    for out in results:
        assert "method must be one of" in out["bad_method"] and "'zigzag'" in out["bad_method"], out
        assert out["bad_degree"] == "ulysses_degree U=3 must divide the CP size P=4", out
    for rank, out in enumerate(results):
        assert out["bad_somewhere"] == ("ulysses_degree U=3 must divide the CP size P=4" if rank >= 4 else
                                        "register_cp_subgroups failed on rank 4: ulysses_degree U=3 must divide "
                                        "the CP size P=4"), (rank, out["bad_somewhere"])
