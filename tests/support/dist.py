"""Spawn gloo process groups on CPU for multi-rank tests, robust on a busy machine.

Ranks fork from a server that has imported torch and megatron-core once (``PRELOAD``), with the environment and
stdout/stderr of the spawning test; workers of modules that use Triton's interpreter spawn fresh processes.

One spawn should serve many cases: a worker loops over its cases and returns all results, and the
test module turns them into parametrized assertions (see ``tests/cp/test_cp_*.py``).

Deadlines are per case, not per spawn: a worker that calls :func:`case_started` before each case gets
``timeout`` seconds for each one, scaled by the machine's load (:func:`load_factor`); a worker that never
calls it gets ``timeout`` (scaled) for everything. A rank that exceeds its deadline, dies, or raises
stops the spawn with an error that says which rank, which case and why ("timed out" for deadlines).
Results a worker streams with :func:`case_result` survive such a failure: with
:func:`run_distributed_cases` the tests of the cases that finished still pass and only the failed
case's tests (and those never reached) fail, each with the spawn's message.
"""
from __future__ import annotations

import functools
import os
import pickle
import queue as queue_module
import shutil
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = float(os.environ.get("HP_TEST_CASE_TIMEOUT", "900"))
# Ranks are forked from one server process per pytest process that imported these once (several CPU seconds per
# rank under "spawn", which imports them again in every rank). Each rank still gets the parent's environment,
# working directory, sys.path and stdout/stderr as they are when the spawn starts (_ParentStreams, _entry).
# Workers of modules that use Triton's interpreter still spawn (_uses_triton_interpreter).
PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.parallel_state", "megatron.core.transformer",
           "megatron.core.models.gpt"]
STARTUP_S = 300.0  # start-up (imports, process group) before a worker's first case, times the load factor
POLL_S = 1.0
_QUEUE = None  # the parent's queue, in a spawned worker
_RANK = None


class DistributedTestError(RuntimeError):
    """A spawn failed; ``partial`` holds ``{rank: {key: value}}`` streamed with :func:`case_result`."""

    def __init__(self, message, partial):
        super().__init__(message)
        self.partial = partial


def load_factor() -> float:
    """How many runnable processes share each core right now (1 on an idle machine)."""
    try:
        return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    except OSError:
        return 1.0


AT_END = "end (waiting for the other ranks)"  # the pseudo-case of a rank whose fn returned, at the final barrier


def _send(queue, rank, kind, payload):
    # pickled to bytes here: torch.multiprocessing would share tensors through file descriptors that
    # vanish when this worker exits before the parent reads them
    queue.put((rank, kind, pickle.dumps(payload)))


def case_started(name: str) -> None:
    """In a worker: this rank starts case ``name``; its deadline restarts."""
    if _QUEUE is not None:
        _send(_QUEUE, _RANK, "case", name)


def case_result(key, value) -> None:
    """In a worker: send one case's result to the parent now (kept if the spawn fails later)."""
    if _QUEUE is not None:
        _send(_QUEUE, _RANK, "result", (key, value))


def run_case(results: dict, key, fn, *args, collective: bool = False, before=None) -> None:
    """In a worker: one case of a spawn that runs many. ``results[key] = fn(*args)``, or ``{"error": traceback}`` when
    it raises (a ``collective`` case then meets the other ranks at a barrier, so they stay in lockstep); ``before()``
    runs first (e.g. CPU shims); the case's deadline restarts, and its result is sent to the parent at once (kept if a
    later case fails the spawn)."""
    case_started(key)
    if before is not None:
        before()
    try:
        results[key] = fn(*args)
    except Exception:  # noqa: BLE001 - reported per case; ranks stay in lockstep
        results[key] = {"error": traceback.format_exc()}
        if collective:
            dist.barrier()
    case_result(key, results[key])


class _ParentStreams:
    """The parent's current stdout and stderr, handed to a forked rank as file descriptors: the fork server's own
    are those of the moment it started (another test's captured output under pytest)."""

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return _redirect_streams, (DupFd(1), DupFd(2))


def _redirect_streams(out, err):
    for stream, dup_fd in ((sys.stdout, out), (sys.stderr, err)):
        fd = dup_fd.detach()
        stream.flush()
        os.dup2(fd, stream.fileno())
        os.close(fd)


def _entry(rank, world_size, store_path, fn, args, queue, environ=None, streams=None):
    global _QUEUE, _RANK
    _QUEUE, _RANK = queue, rank
    if environ is not None:  # the parent's environment at the spawn, not the fork server's
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        # a file store, not a TCP port: a port picked free by the parent could be taken before rank 0 binds it
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # no rank tears its group down while a peer is still connecting or sending: a rank whose fn needs no
        # collective could exit while its peer was still in gloo's connectFullMesh ("Connection closed by peer")
        case_started(AT_END)
        dist.barrier()
        _send(queue, rank, "ok", result)
    except BaseException:  # report every failure to the parent, then exit non-zero
        _send(queue, rank, "error", traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _Ranks:
    """The parent's view of each rank: current case, when it started, its result or failure."""

    def __init__(self, world_size, timeout):
        now = time.monotonic()
        self.timeout = timeout
        self.case = {r: "start-up" for r in range(world_size)}
        self.since = {r: now for r in range(world_size)}
        self.results, self.partial = {}, {r: {} for r in range(world_size)}

    def running(self):
        return [r for r in self.case if r not in self.results]

    def describe(self, ranks):
        now = time.monotonic()
        return ", ".join(f"rank {r} in case {self.case[r]!r} for {now - self.since[r]:.0f} s" for r in ranks)

    def overdue(self):
        """(rank, limit) of a running rank past its deadline, else None; a rank in a case is named before one waiting
        at the end for it."""
        factor, now = load_factor(), time.monotonic()
        for r in sorted(self.running(), key=lambda r: self.case[r] == AT_END):
            limit = factor * (max(self.timeout, STARTUP_S) if self.case[r] == "start-up" else self.timeout)
            if now - self.since[r] > limit:
                return r, limit
        return None


def _drain(queue, ranks, wait_s=1.0):
    while True:
        try:
            rank, kind, payload = queue.get(timeout=wait_s)
            payload = pickle.loads(payload)
        except queue_module.Empty:
            return
        if kind == "result":
            ranks.partial[rank][payload[0]] = payload[1]
        elif kind == "ok":
            ranks.results[rank] = payload


_INTERPRETER = "tests.support.triton_interpreter"


def _uses_triton_interpreter(fn, args) -> bool:
    """Whether ``fn``'s module (or that of a shared job) uses tests/support/triton_interpreter.py: its ranks must
    start before anything imports triton (the fork server has, through megatron-core), so they spawn."""
    fns = [fn] + ([job for job, _ in args[0]] if fn is _run_jobs else [])
    for f in fns:
        module = sys.modules.get(getattr(f, "__module__", None) or "")
        for value in vars(module).values() if module is not None else ():
            if getattr(value, "__name__", None) == _INTERPRETER or getattr(value, "__module__", None) == _INTERPRETER:
                return True
    return False


def run_distributed(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT_S):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results indexed by rank.

    ``fn`` must be importable at module level (spawned processes re-import it). ``timeout``: seconds per
    case (see the module docstring), times :func:`load_factor`. Raises :class:`DistributedTestError`
    naming the rank and case on a rank's exception, death or deadline.
    """
    forked = not _uses_triton_interpreter(fn, args)
    ctx = mp.get_context("forkserver" if forked else "spawn")
    if forked:
        ctx.set_forkserver_preload(PRELOAD)
    queue = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="hp_dist_")
    store_path = os.path.join(store_dir, "store")
    procs = [ctx.Process(target=_entry, args=(r, world_size, store_path, fn, args, queue,
                                              *((dict(os.environ), _ParentStreams()) if forked else ())))
             for r in range(world_size)]
    for p in procs:
        p.start()
    ranks = _Ranks(world_size, timeout)
    failure = None
    while failure is None and ranks.running():
        try:
            rank, kind, payload = queue.get(timeout=POLL_S)
            payload = pickle.loads(payload)
        except queue_module.Empty:
            dead = [r for r in ranks.running() if procs[r].exitcode not in (None, 0)]
            late = ranks.overdue()
            if dead:
                failure = (f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} in case "
                           f"{ranks.case[dead[0]]!r}; {ranks.describe(ranks.running())}")
            elif late:
                rank, limit = late
                failure = (f"timed out: rank {rank} spent more than {limit:.0f} s in case {ranks.case[rank]!r} "
                           f"(per-case limit {timeout:.0f} s, start-up {max(timeout, STARTUP_S):.0f} s, times load "
                           f"factor {load_factor():.1f}); {ranks.describe(ranks.running())}")
            continue
        if kind == "case":
            ranks.case[rank], ranks.since[rank] = payload, time.monotonic()
        elif kind == "result":
            ranks.partial[rank][payload[0]] = payload[1]
        elif kind == "ok":
            ranks.results[rank] = payload
        else:
            failure = f"rank {rank} raised in case {ranks.case[rank]!r}:\n{payload}"
    if failure is not None:  # keep what the other ranks reported before the failure
        _drain(queue, ranks)
    for p in procs:
        if failure is not None:
            p.kill()
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    shutil.rmtree(store_dir, ignore_errors=True)
    if failure is not None:
        for rank, result in ranks.results.items():  # ranks that finished: their returned cases count too
            if isinstance(result, dict):
                ranks.partial[rank] = {**result, **ranks.partial[rank]}
        raise DistributedTestError("distributed test failed: " + failure, ranks.partial)
    return [ranks.results[r] for r in range(world_size)]


_SPAWNS: dict = {}


def _spawn_once(fn, world_size, args):
    key = (fn, world_size, args)
    if key not in _SPAWNS:
        try:
            _SPAWNS[key] = (run_distributed(fn, world_size, *args), None)
        except DistributedTestError as exc:
            _SPAWNS[key] = (None, exc)
    return _SPAWNS[key]


def run_distributed_once(fn, world_size: int, *args):
    """:func:`run_distributed`, spawned once per ``(fn, world_size, args)`` in this process: every test that
    asks again gets the cached per-rank results, or the spawn's error again (``args`` must be hashable).
    Declared with :func:`share_spawn`: ``fn``'s results from the spawn shared by every declared job."""
    if _shared_index(fn, world_size, args) is not None:
        return _shared_results(fn, world_size, args)
    results, error = _spawn_once(fn, world_size, args)
    if error is not None:
        raise error
    return results


_SHARED: dict = {}  # world size -> [(fn, args)] declared by the imported test modules, in import order
_SELECTED = None  # modules with tests selected in this run (tests/conftest.py); None: every declared job runs
_SHARED_SPAWNS: dict = {}


def share_spawn(fn, world_sizes, *args):
    """At a test module's import: for each ``world_size`` in ``world_sizes``, ``fn(rank, world_size, *args)`` runs
    in the one spawn of ``world_size`` ranks shared by every module that declares a job. Returns
    ``results(world_size)``: ``fn``'s per-rank results from there (as does :func:`run_distributed_once` with the
    same arguments). Saves a spawn's start-up (processes, imports, process group) per job.

    The jobs run one after the other on the same ranks in declaration order, each with its own deadline
    (:func:`case_started`), and must leave no state a later job depends on. A job that fails (raises, hangs,
    kills a rank) ends the spawn: its tests and those of the jobs not reached fail with the spawn's message,
    the jobs finished before keep their results."""
    for world_size in world_sizes:
        if _shared_index(fn, world_size, args) is None:
            _SHARED.setdefault(world_size, []).append((fn, args))
    return functools.partial(_declared_results, fn, args)


def _declared_results(fn, args, world_size):
    return run_distributed_once(fn, world_size, *args)


def select_shared_modules(modules) -> None:
    """Only the jobs of these modules (those with tests selected in this pytest run) join the shared spawns."""
    global _SELECTED
    _SELECTED = set(modules)


def _shared_jobs(world_size):
    return [(f, a) for f, a in _SHARED.get(world_size, ()) if _SELECTED is None or f.__module__ in _SELECTED]


def _shared_index(fn, world_size, args):
    return next((i for i, (f, a) in enumerate(_shared_jobs(world_size)) if f is fn and a == args), None)


def _run_jobs(rank, world_size, jobs):
    """In a worker: each job in order; its result is streamed under the job's index. A job must leave
    megatron-core's parallel state as it found it (uninitialized): the next job of another module starts there."""
    results = {}
    for index, (fn, args) in enumerate(jobs):
        case_started(f"{fn.__module__}.{fn.__qualname__}")
        results[index] = fn(rank, world_size, *args)
        _check_parallel_state_released(fn)
        case_result(index, results[index])
    return results


def _check_parallel_state_released(fn) -> None:
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None and (parallel_state.model_parallel_is_initialized()
                                       or parallel_state._GLOBAL_MEMORY_BUFFER is not None):
        raise RuntimeError(f"shared-spawn job {fn.__module__}.{fn.__qualname__} left megatron-core's parallel state "
                           "initialized; call parallel_state.destroy_model_parallel() before it returns")


def _shared_results(fn, world_size, args):
    if world_size not in _SHARED_SPAWNS:
        try:
            _SHARED_SPAWNS[world_size] = (run_distributed(_run_jobs, world_size, _shared_jobs(world_size)), None)
        except DistributedTestError as exc:
            _SHARED_SPAWNS[world_size] = (None, exc)
    results, error = _SHARED_SPAWNS[world_size]
    index = _shared_index(fn, world_size, args)
    if error is None:
        return [r[index] for r in results]
    values = [cases[index] for _, cases in sorted(error.partial.items()) if index in cases]
    if len(values) < world_size:
        raise error
    return values


def members_sum(group) -> list:
    """In a worker: all-reduce of each member's global rank over ``group``; [sum of its members, its ranks] when
    the group works (a collective over ``group``)."""
    x = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(x, group=group)
    return [int(x.item()), sorted(dist.get_process_group_ranks(group))]


def run_distributed_cases(fn, world_size: int, key, *args):
    """One case's results from a shared spawn whose worker streams them with :func:`case_result`: the list
    of values the ranks reported for ``key`` (ranks that did not report it are left out). When the spawn
    failed, the cases finished before the failure still return; any other raises the spawn's error."""
    results, error = _spawn_once(fn, world_size, args)
    if error is not None:
        values = [cases[key] for _, cases in sorted(error.partial.items()) if key in cases]
        if not values:
            raise error
        return values
    values = [r[key] for r in results if isinstance(r, dict) and key in r]
    if not values:
        raise KeyError(f"no rank reported case {key!r}")
    return values
