"""``register_cp_subgroups_from_args`` with ``--hybrid-context-parallel`` (one spawn of 8 gloo ranks, no model).

megatron-core 0.16's hybrid CP hands each micro-batch a DP x CP group of some power-of-two size
(``PackedSeqParams.cp_group``; ``parallel_state.create_hybrid_dp_cp_groups``). At DP = 8, CP = 1 these are the
pairs, the blocks of 4 and the whole world. A hybrid Ulysses(2) x p2p context on a block of 4 needs its sub-groups
registered: without it, it raises on every member; after the flags' collective registration it works on every
hybrid group (an all_reduce over each sub-group gives the members the rank arithmetic says).
"""
from __future__ import annotations

from argparse import Namespace

import pytest
import torch.distributed as dist

from tests.support.dist import case_started, members_sum, run_distributed

WORLD = 8
CASE_TIMEOUT_S = 120
SIZES = (2, 4, 8)   # megatron's hybrid group sizes at DP x CP = 8: 2 .. 2**(log2 8 - 1), and 8 itself
FLAGS = Namespace(hybrid_context_parallel=True, context_parallel_size=1, hp_cp_method="p2p", hp_cp_ulysses_degree=2,
                  hp_cp_group_size=None)


def _worker(rank, world_size):
    from megatron.core import parallel_state

    from hp_megatron.training.cp_subgroup_registration import register_cp_subgroups_from_args
    from layers.cp import build_cp_context

    case_started("initialize")
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=1, hybrid_context_parallel=True)
    groups = {size: parallel_state.get_hybrid_data_context_parallel_groups(group_size=size) for size in SIZES}
    out = {"groups": {size: sorted(dist.get_process_group_ranks(g)) for size, g in groups.items()}}

    case_started("unregistered")
    try:
        build_cp_context(groups[4], method="p2p", layout="zigzag", ulysses_degree=2)
        out["unregistered"] = "built"
    except RuntimeError as err:
        out["unregistered"] = str(err)

    case_started("register")
    out["registered"] = register_cp_subgroups_from_args(FLAGS)
    for size, group in groups.items():
        case_started(f"context on {size}")
        ctx = build_cp_context(group, method="p2p", layout="zigzag", ulysses_degree=2)
        out[size] = {"ulysses": members_sum(ctx.ulysses_group), "state": members_sum(ctx.state_group)}
    parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, WORLD, timeout=CASE_TIMEOUT_S)


def test_megatron_hybrid_groups_are_the_sizes_registered(results):
    for rank, out in enumerate(results):
        assert out["groups"] == {size: list(range(rank // size * size, rank // size * size + size)) for size in SIZES}


def test_unregistered_hybrid_block_raises_on_every_member(results):
    for rank, out in enumerate(results):
        assert "register_cp_subgroups" in out["unregistered"], (rank, out["unregistered"])


def test_registration_covers_every_hybrid_group_size(results):
    made = results[0]["registered"]
    assert all(out["registered"] == made for out in results)
    # U = 2 on the blocks of 4: neighbour pairs and every-other pairs (the pairs themselves need none; on the
    # world, a CP group every rank holds, sub-groups are created on demand)
    assert {(0, 1), (2, 3), (4, 5), (6, 7), (0, 2), (1, 3), (4, 6), (5, 7)} <= set(made), made


@pytest.mark.parametrize("size", SIZES)
def test_contexts_on_every_hybrid_group_work(results, size):
    for rank, out in enumerate(results):
        cp = out["groups"][size]
        i = cp.index(rank)
        ulysses, state = cp[2 * (i // 2):2 * (i // 2) + 2], cp[i % 2::2]
        assert out[size] == {"ulysses": [sum(ulysses), ulysses], "state": [sum(state), state]}, (rank, size, out[size])
