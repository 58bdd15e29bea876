"""Two CP ranks as spawned processes: start, per-rank setup, results back through files, a deadline.

The parent starts ``WORLD`` processes (``torch.multiprocessing``, start method "spawn": safe with CUDA / NPU) that
join one process group through a file store, run :func:`hp_megatron.selfcheck.cp.cp_rows` and pickle their rows to
a temporary directory. A rank that raises outside a case (its result says so at once), or ranks that outlive
``timeout_s`` (the whole spawn's budget; also each collective's timeout), turn every planned CP row into an ERROR
naming the cause; live ranks are then terminated, so the check never hangs.
"""
from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp

from hp_megatron.selfcheck.report import Row


def _rank_main(rank, world, store, out_dir, device_type, count, comm, backend, dtypes, patterns, rank_setup,
               timeout_s):
    """A CP rank: the harness's setup first (before any backend is imported), then the process group and the cases."""
    try:
        if rank_setup is not None:
            rank_setup()
        import torch
        import torch.distributed as dist

        from hp_megatron.selfcheck.cp import cp_rows
        from hp_megatron.selfcheck.device import rank_device
        from hp_megatron.selfcheck.gloo import accept_stacked_all_gather_on_gloo, install_gloo_device_staging
        from hp_megatron.selfcheck.limits import probe
        from hp_megatron.selfcheck.select import selector

        torch.set_num_threads(1)
        device = rank_device(device_type, rank, count)
        dist.init_process_group(comm, init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        if comm == "gloo":
            accept_stacked_all_gather_on_gloo()
            if device.type != "cpu":
                install_gloo_device_staging()
        try:
            rows = cp_rows(backend, device, dtypes, probe(backend, device), selector(patterns))
            dist.barrier()   # no rank tears its process group down while a peer still sends to it
        finally:
            dist.destroy_process_group()
        result = {"rows": rows}
    except BaseException:  # noqa: BLE001 - reported to the parent, which marks the rows
        result = {"error": traceback.format_exc()}
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    with open(path + ".part", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".part", path)   # the parent reads only whole results
    _exit_without_teardown()


def _exit_without_teardown():
    """End a rank once its result is on disk, skipping the interpreter's teardown: gloo's and the backends' C++
    destructors racing their own threads at exit aborted a rank (SIGABRT) now and then after a complete result, and
    the parent then had to report every CP row as an ERROR. Python's output is flushed first."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def _rank_error(out_dir, world):
    """The first rank's failure outside the cases, once its result is written (the others are then stopped)."""
    for rank in range(world):
        path = os.path.join(out_dir, f"rank{rank}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                result = pickle.load(f)
            if "error" in result:
                return f"CP rank {rank}: {result['error']}"
    return None


def _failed(planned, dtypes, why):
    """ERROR rows for every planned CP row: the cause's last line as the note, all of it as the detail."""
    note = why.strip().splitlines()[-1][:300] if why.strip() else "failed"
    return [Row(op, case, phase, dtype, status="ERROR", note=note, detail=why)
            for dtype in dtypes for op, case, phases in planned for phase in phases]


def run_cp(planned, *, world, device_type, count, comm, backend, dtypes, patterns, rank_setup, timeout_s) -> list[Row]:
    """Rows of the CP cases from rank 0, a row's status the worse of the ranks' (their errors are equal)."""
    with tempfile.TemporaryDirectory(prefix="hp_selfcheck_") as tmp:
        store = os.path.join(tmp, "store")
        args = (world, store, tmp, device_type, count, comm, backend, dtypes, patterns, rank_setup, timeout_s)
        deadline = time.monotonic() + timeout_s
        context = None
        try:
            context = mp.start_processes(_rank_main, args=args, nprocs=world, join=False, start_method="spawn")
            while not context.join(timeout=0.5):
                failure = _rank_error(tmp, world)
                if failure is not None:
                    raise RuntimeError(failure)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {world} CP ranks did not finish within {timeout_s:g} s (--cp-timeout)")
        except Exception as error:  # noqa: BLE001 - a rank failed or died, or the deadline passed
            for process in (context.processes if context is not None else ()):
                if process.is_alive():
                    process.terminate()
                process.join(10)
                if process.is_alive():
                    process.kill()
            return _failed(planned, dtypes, str(error) if isinstance(error, RuntimeError) else
                           f"{type(error).__name__}: {error}")
        results = []
        for rank in range(world):
            path = os.path.join(tmp, f"rank{rank}.pkl")
            if not os.path.exists(path):
                return _failed(planned, dtypes, f"CP rank {rank} wrote no result")
            with open(path, "rb") as f:
                results.append(pickle.load(f))
    for rank, result in enumerate(results):
        if "error" in result:
            return _failed(planned, dtypes, f"CP rank {rank}: {result['error']}")
    return _merge([r["rows"] for r in results])


_ORDER = {"pass": 0, "n/a": 1, "FAIL": 2, "ERROR": 3}


def _merge(per_rank):
    rows = per_rank[0]
    for other in per_rank[1:]:
        for i, (row, theirs) in enumerate(zip(rows, other)):
            if _ORDER[theirs.status] > _ORDER[row.status]:
                rows[i] = theirs
    return rows
