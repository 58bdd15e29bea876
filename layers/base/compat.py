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


# ``UntypedStorage._swap_data_ptr_`` (torch builds from March 2026 on; the pointer swap of PyTorch's CUDA-graph trees
# and FSDP): layers/shared/recompute.py refills a freed storage without moving bytes where it exists. Tests set this
# False to run the fallback (resize + copy), the only path of older torch releases (setup.py's floor is 2.6).
STORAGE_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def storage_key(storage: torch.UntypedStorage) -> int:
    """An identity of ``storage`` shared by every tensor viewing it, valid also once it is freed (``resize_(0)``,
    where ``data_ptr()`` is 0): the address of its C++ object (``_cdata``)."""
    return storage._cdata


def refill_storage(kept: torch.UntypedStorage, new: torch.UntypedStorage) -> bool:
    """Give the freed storage ``kept`` the bytes of ``new`` (same size): with :data:`STORAGE_SWAP` the two swap
    their memory (no bytes move; ``new`` then holds ``kept``'s old, empty memory) and True is returned; else
    ``kept`` is resized and ``new`` copied into it, and False is returned."""
    if STORAGE_SWAP:
        kept._swap_data_ptr_(new)
        return True
    kept.resize_(new.size())
    kept.copy_(new)
    return False


def swap_storages(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Swap the memory of two storages (only after :func:`refill_storage` returned True for them)."""
    a._swap_data_ptr_(b)


def own_state_dict(module: torch.nn.Module) -> dict:
    """``module``'s own entries of its state dict (parameters, persistent buffers, extra state; not its
    children's), tensors kept as they are (``nn.Module._save_to_state_dict`` with ``keep_vars=True``)."""
    own = {}
    module._save_to_state_dict(own, "", keep_vars=True)
    return own
