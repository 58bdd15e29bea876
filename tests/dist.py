"""Spawn gloo process groups on CPU for multi-rank tests.

One spawn should serve many cases: a worker loops over its cases and returns all results, and the
test module turns them into parametrized assertions (see ``tests/test_cp_*.py``).
"""
from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank, world_size, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # report every failure to the parent, then exit non-zero
        queue.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 900.0):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results indexed by rank.

    ``fn`` must be importable at module level (spawned processes re-import it). Any rank's exception
    is re-raised here with its traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    import queue as queue_module
    import time
    deadline = time.monotonic() + timeout
    for _ in range(world_size):
        while True:
            try:
                rank, status, payload = queue.get(timeout=2.0)
                break
            except queue_module.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    for p in procs:
                        p.kill()
                    raise RuntimeError(f"distributed workers died or timed out (exit codes "
                                       f"{[p.exitcode for p in procs]})")
        if status == "ok":
            results[rank] = payload
        else:
            errors.append(f"rank {rank}:\n{payload}")
            break
    for p in procs:
        p.join(timeout=5 if errors else timeout)
        if p.is_alive():
            p.kill()
    if errors:
        raise RuntimeError("distributed worker failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]


_SPAWNS: dict = {}


def run_distributed_once(fn, world_size: int, *args):
    """:func:`run_distributed`, spawned once per ``(fn, world_size, args)`` in this process: every test that
    asks again gets the cached per-rank results (``args`` must be hashable)."""
    key = (fn, world_size, args)
    if key not in _SPAWNS:
        _SPAWNS[key] = run_distributed(fn, world_size, *args)
    return _SPAWNS[key]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative L2 error ||a - e|| / max(||e||, tiny), computed in float64."""
    a, e = actual.detach().double(), expected.detach().double()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))
