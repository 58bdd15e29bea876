"""The private torch APIs the project relies on, each behind one function (tests/layers/test_compat.py checks them).

A torch release that moves one of them breaks here, in one place, with a test that names it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (``torch._C._current_graph_task_id``)."""
    return torch._C._current_graph_task_id() != -1


def tensor_version(t: torch.Tensor) -> int:
    """The version counter of ``t`` (bumped by every in-place change; shared by views and ``detach()``)."""
    return t._version


def process_group_alive(group) -> bool:
    """Whether ``group`` is still registered with torch.distributed (False once destroyed, e.g. after the world
    was re-initialized); reads ``distributed_c10d._world.pg_map``."""
    return group in dist.distributed_c10d._world.pg_map
