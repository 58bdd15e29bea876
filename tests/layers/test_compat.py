"""layers.base.compat: each private torch API the project uses still behaves as relied on (one test each)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from layers.base.compat import in_backward, process_group_alive, tensor_version
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
