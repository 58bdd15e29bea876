"""layers.base.compat: each private torch API the project uses still behaves as relied on (one test each)."""
from __future__ import annotations

import torch
import pytest
import torch.distributed as dist

from layers.base import compat
from layers.base.compat import (in_backward, own_state_dict, process_group_alive, refill_storage, storage_key,
                                tensor_version)
from tests.support.dist import run_distributed_once


def test_in_backward_is_true_only_inside_a_backward_pass():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(("forward", in_backward()))
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(("backward", in_backward()))
            return g

    Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen == [("forward", False), ("backward", True)] and not in_backward()


def test_tensor_version_counts_in_place_changes_shared_with_detach():
    t = torch.zeros(3)
    v0 = tensor_version(t)
    t.add_(1)
    assert tensor_version(t) == v0 + 1
    d = t.detach()
    d.mul_(2)
    assert tensor_version(t) == tensor_version(d) == v0 + 2


def _groups_worker(rank, world_size):
    group = dist.new_group([0, 1])
    alive = process_group_alive(group)
    dist.destroy_process_group(group)
    return alive, process_group_alive(group), process_group_alive(dist.group.WORLD)


def test_process_group_alive_until_destroyed():
    for alive, after, world in run_distributed_once(_groups_worker, 2):
        assert (alive, after, world) == (True, False, True)


def test_storage_key_is_shared_by_views_and_survives_freeing():
    t = torch.arange(6.0)
    key = storage_key(t.untyped_storage())
    assert storage_key(t[2:].untyped_storage()) == storage_key(t.view(2, 3).untyped_storage()) == key
    assert storage_key(torch.arange(6.0).untyped_storage()) != key
    t.untyped_storage().resize_(0)
    assert storage_key(t.untyped_storage()) == key


@pytest.mark.parametrize("swap", [True, False], ids=["pointer_swap", "copy_fallback"])
def test_refill_storage_gives_a_freed_storage_the_new_bytes(monkeypatch, swap):
    """Both paths leave the freed tensor holding the new values; only the swap moves no bytes and reports True."""
    if swap and not compat.STORAGE_SWAP:
        pytest.skip(f"torch {torch.__version__} has no UntypedStorage._swap_data_ptr_")
    monkeypatch.setattr(compat, "STORAGE_SWAP", swap)
    kept, new = torch.zeros(2, 3), torch.arange(6.0).view(2, 3)
    view = kept[1]
    kept.untyped_storage().resize_(0)
    new_ptr = new.untyped_storage().data_ptr()
    assert refill_storage(kept.untyped_storage(), new.untyped_storage()) is swap
    assert torch.equal(kept, torch.arange(6.0).view(2, 3)) and torch.equal(view, torch.arange(3.0, 6.0))
    assert (kept.untyped_storage().data_ptr() == new_ptr) is swap


def test_own_state_dict_holds_the_modules_own_entries_as_they_are():
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.ones(2))
    module.register_buffer("kept", torch.zeros(1))
    module.register_buffer("scratch", torch.zeros(1), persistent=False)
    module.child = torch.nn.Linear(2, 2)
    own = own_state_dict(module)
    assert list(own) == ["weight", "kept"] and own["weight"] is module.weight
