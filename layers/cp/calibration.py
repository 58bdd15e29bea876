"""Calibration of the CP cost model on a real CP group: time its collectives, the fold matmul and the kernels.

Every timing runs the same call on every rank of the group at the same time, as a layer run does
(``time_concurrently``): each repeat starts at a group barrier and the slowest rank's time counts. Compute
windows last at least ``MIN_WINDOW_S`` (back-to-back calls), so on a host with more ranks than cores (or
anything else sharing the device) the fits see the time slicing the layer run suffers; timing one rank while
the others idle, or short unsynchronized calls, measures a core a rank never gets in a layer run.

``calibrate(group)`` times the all-gather, the send/recv ring shift, the relay (sequential hand-overs) and the
all-to-all of ``layers.cp.collectives`` at three message sizes, and the fp32 fold matmul at two sizes, and fits a line
t = alpha * steps + bytes / beta per collective (least squares, residual = RMS relative error); and the straggler
cost of a synchronization after a compute phase (``calibrate_sync``).
``calibrate_kernel`` adds the fits of one delta-rule op shape (forward + backward; the generic CP pass or the
native summary pass) and of the dense projections.
``load_or_calibrate(group, path)`` reuses a saved calibration from the JSON file ``path`` (keyed by the world
layout and hardware, ``layout_key``) or measures one and saves it there. A calibration takes a few seconds.
This module keeps no state: ``layers.cp.auto.AutoTuner`` holds the calibrations of a process.
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

from layers.cp.collectives import all_gather_raw, all_to_all_raw, broadcast_from_rank0, exchange, group_rank, group_size
from layers.cp.cost_model import COLLECTIVES, Calibration, LinearFit
from layers.ops.kinds import delta_kind

MESSAGE_BYTES = (16 << 10, 256 << 10, 2 << 20)       # per-rank payload of each timed collective
REPEATS = 9                                            # timed repeats of a collective
COMPUTE_REPEATS = 3                                    # timed windows of a compute point
MIN_WINDOW_S = 0.04                                    # shortest compute window (several scheduler slices)
SYNC_PHASES_S = (0.002, 0.01)                          # compute phases before a synchronization (``sync`` fit)
OP_POINTS = ((128, 2), (512, 4), (2048, 4))            # (tokens, heads) at which a delta-rule op is timed
GEMM_WIDTH = 256                                       # the timed dense matmul: [tokens, 256] x [256, 256]
FORMAT = "cal3"  # what is measured how (part of the layout key); cal3: concurrent windows, relay fit,
                 # the generic CP pass timed apart, op points up to 2048 tokens


def group_device(group) -> torch.device:
    """Device the group's collectives run on: CUDA for NCCL, NPU for HCCL, else CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if "hccl" in backend:
        return torch.device("npu", torch.npu.current_device())   # attribute added by torch_npu
    return torch.device("cpu")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def _max_over_group(values: list, group, device) -> list:
    t = torch.tensor(values, dtype=torch.float64, device=device if device.type != "cpu" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()


def _timed(fn, device, calls: int = 1) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return time.perf_counter() - t0


def time_concurrently(fns, group, device, repeats: int = COMPUTE_REPEATS, min_window: float = MIN_WINDOW_S) -> list:
    """Seconds per call of each of ``fns`` with every rank of ``group`` running the same call at the same time.

    Per fn: an untimed warm-up call (allocations, connections), one synchronized call that sizes the window
    (n calls, so that n x the slowest rank's call >= ``min_window``; n = 1 without a ``min_window``), then
    ``repeats`` windows, each started at a group barrier and timed on every rank; the result is the median
    over the windows of the slowest rank's window / n. The windows run round-robin (repeat r times every fn
    once), so a change of load on the host hits every fn alike. Collective; every rank gets the same numbers.
    """
    for fn in fns:
        fn()
    _sync(device)
    calls = [1] * len(fns)
    if min_window > 0:
        sizing = []
        for fn in fns:
            dist.barrier(group=group)
            sizing.append(_timed(fn, device))
        sizing = _max_over_group(sizing, group, device)
        calls = [max(1, math.ceil(min_window / max(t, 1e-9))) for t in sizing]
    windows = []
    for _ in range(repeats):
        for fn, n in zip(fns, calls):
            dist.barrier(group=group)
            windows.append(_timed(fn, device, n) / n)
    windows = _max_over_group(windows, group, device)
    return [statistics.median(windows[i::len(fns)]) for i in range(len(fns))]


def fit_line(xs, ts, steps: float = 1.0) -> LinearFit:
    """Relative least squares t = a + b x (weights 1/t^2: the sizes span orders of magnitude), alpha = a / steps,
    beta = 1 / b; a and b are clamped >= 0 (noise can make either negative). residual = RMS relative error."""
    w = [1.0 / (t * t) for t in ts]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, xs)) / sw
    mt = sum(wi * t for wi, t in zip(w, ts)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs))
    b = sum(wi * (x - mx) * (t - mt) for wi, x, t in zip(w, xs, ts)) / sxx if sxx > 0 else 0.0
    a = mt - b * mx
    if b <= 0:                                   # no measurable bandwidth term: latency only
        b, a = 1e-15, mt
    if a < 0:                                    # no measurable latency: bandwidth through the origin
        a, b = 0.0, sum(wi * x * t for wi, x, t in zip(w, xs, ts)) / sum(wi * x * x for wi, x in zip(w, xs))
    residual = math.sqrt(sum(((a + b * x - t) / t) ** 2 for x, t in zip(xs, ts)) / len(xs))
    return LinearFit(alpha=a / steps, beta=1.0 / b, residual=residual)


def layout_key(group) -> str:
    """World layout and hardware of the group: P, hosts x ranks per host, process-group backend, device names,
    torch version, and the calibration's ``FORMAT`` (a file from an older calibration is not reused).
    Collective over the group (an all-gather of each rank's host and device)."""
    device = group_device(group)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    elif device.type == "npu":
        name = "npu"
    else:
        name = f"cpu:{platform.machine()}:{os.cpu_count()}cores:{torch.get_num_threads()}threads"
    mine = (platform.node(), name)
    everyone = [None] * group_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    hosts = {}
    for host, _ in everyone:
        hosts[host] = hosts.get(host, 0) + 1
    per_host = sorted(set(hosts.values()))
    return (f"P={len(everyone)}|hosts={len(hosts)}x{'/'.join(map(str, per_host))}|{dist.get_backend(group)}|"
            f"{'+'.join(sorted({n for _, n in everyone}))}|torch={torch.__version__.split('+')[0]}|{FORMAT}")


def calibrate(group=None, *, message_bytes=MESSAGE_BYTES, repeats: int = REPEATS, key: str = "") -> Calibration:
    """Measure the collective fits and the fold FLOP/s on ``group`` of P >= 2 ranks (collective: every member
    must call it). ``send_recv`` is the ring shift (every rank sends and receives at once: recursive doubling's
    rounds), ``relay`` one message handed along the ranks 0 -> 1 -> ... -> P-1 (the sequential hand-overs of
    ``p2p``: one pair active, the others waiting), per hop."""
    group = dist.GroupMember.WORLD if group is None else group
    P, r = group_size(group), group_rank(group)
    if P < 2:
        raise ValueError(f"calibrate needs a CP group of at least 2 ranks, got P={P}")
    device = group_device(group)
    nxt, prv = (r + 1) % P, (r - 1) % P

    def relay(x, recv):
        if r > 0:
            exchange([], [(recv, prv)], group)
        if r < P - 1:
            exchange([(x, nxt)], [], group)
    calls, points = [], []
    for nbytes in message_bytes:
        n = max(nbytes // 4 // P * P, P)
        x = torch.randn(n, device=device)
        recv = torch.empty_like(x)
        a2a_in = x.view(P, -1)
        calls += [lambda x=x: all_gather_raw(x, group),
                  lambda x=x, recv=recv: exchange([(x, nxt)], [(recv, prv)], group),
                  lambda a2a_in=a2a_in: all_to_all_raw(a2a_in, group),
                  lambda x=x, recv=recv: relay(x, recv)]
        points.append(n * 4)
    times = time_concurrently(calls, group, device, repeats, min_window=0.0)
    fold_flops, fold_calls = [], []
    for heads in (2, 16):
        K = 64
        M, E = torch.randn(heads, K, K, device=device), torch.randn(heads, K, 2 * K, device=device)
        fold_flops.append(2 * heads * K * K * 2 * K)
        fold_calls.append(lambda M=M, E=E: M @ E)
    fold_times = time_concurrently(fold_calls, group, device)
    n_types = len(COLLECTIVES)
    by_type = {c: times[i::n_types] for i, c in enumerate(COLLECTIVES)}
    recv_bytes = {"all_gather": [(P - 1) * b for b in points], "send_recv": list(points),
                  "all_to_all": [(P - 1) * b / P for b in points], "relay": [(P - 1) * b for b in points]}
    steps = {"all_gather": math.ceil(math.log2(P)), "send_recv": 1, "all_to_all": 1, "relay": P - 1}
    fits = {c: fit_line(recv_bytes[c], by_type[c], steps[c]) for c in COLLECTIVES}
    return Calibration(collectives=fits, fold_flops=fit_line(fold_flops, fold_times).beta, key=key,
                       sync=calibrate_sync(group, device))


def calibrate_sync(group, device, phases_s=SYNC_PHASES_S) -> LinearFit:
    """The straggler cost of one synchronization after a compute phase (collective).

    Every rank runs compute phases of about c seconds (a matmul loop) back to back, once with a one-element
    all-reduce after each phase and once without; sync(c) = the difference per phase, the slowest rank's
    (``time_concurrently``). A layer's collective waits for the slowest rank of the compute before it, and
    ranks drift apart within a phase (time slicing, clocks, noise). Fit: sync(c) = alpha + c / beta, with x =
    the phase's measured seconds (alpha: the wake-up and latency of a synchronization; 1 / beta: the fraction
    of a phase the slowest rank lags)."""
    a = torch.randn(128, 128, device=device)
    flag = torch.zeros(1, device=device)
    (matmul,) = _max_over_group([_timed(lambda: a @ a, device, 20) / 20], group, device)
    calls = []
    for c in phases_s:
        n = max(1, round(c / matmul))

        def phase(n=n):
            for _ in range(n):
                a @ a

        def synced(phase=phase):
            phase()
            dist.all_reduce(flag, group=group)
        calls += [phase, synced]
    ts = time_concurrently(calls, group, device)
    lengths = ts[0::2]
    return fit_line(lengths, [max(s - c, 1e-7) for c, s in zip(lengths, ts[1::2])])


def _delta_inputs(kind, tokens, heads, K, V, dtype, device, gen):
    """Raw q, k, v, gate, beta and the in-kernel flags the GDN/KDA mixers use (l2norm, sigmoid beta, gate)."""
    q, k = (torch.randn(1, tokens, heads, K, generator=gen).to(device, dtype) for _ in range(2))
    v = torch.randn(1, tokens, heads, V, generator=gen).to(device, dtype)
    g = torch.randn((1, tokens) + kind.gate_shape(heads, K), generator=gen).to(device, dtype)
    beta = torch.randn(1, tokens, heads, generator=gen).to(device, dtype)
    flags = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
                 A_log=torch.zeros(heads, device=device, dtype=dtype),
                 dt_bias=torch.zeros(kind.dt_bias_shape(heads, K), device=device, dtype=dtype))
    return [t.requires_grad_(True) for t in (q, k, v, g, beta)], flags


def _gemm_calls(device, dtype) -> tuple[list, list]:
    """(FLOPs, calls) of a [tokens, GEMM_WIDTH] x [GEMM_WIDTH, GEMM_WIDTH] matmul forward + backward at two sizes."""
    flops, calls, hidden = [], [], GEMM_WIDTH
    for tokens in (128, 512):
        x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(hidden, hidden, device=device, dtype=dtype, requires_grad=True)
        flops.append(3 * 2 * tokens * hidden * hidden)
        calls.append(lambda x=x, w=w: (x @ w).float().sum().backward())
    return flops, calls


def calibrate_kernel(calibration: Calibration, group, *, kind: str, backend: str, k_dim: int, v_dim: int,
                     dtype: torch.dtype) -> dict:
    """Add ``calibration.kernels[kernel_key]``, each fit timed on all ranks at once (``time_concurrently``;
    collective) at the ``OP_POINTS`` (FLOPs as ``cost_model.delta_flops`` x 3 at the pass's value width):

    - "op": the delta-rule op forward + backward with the mixers' in-kernel flags (values V wide);
    - "augmented" (generic backends): the generic CP path's one pass (``layers.ops.summary.augmented_pass``:
      values [v | 0_K], initial states [0 | I_K], two pieces as ``cu_seqlens`` like a zigzag rank's);
    - "summary" (backends with native CP summaries, ``NATIVE_CP``): their summary pass (width K + V);
    - "gemm": a dense matmul forward + backward.

    The augmented pass has its own fit because its cost is not the op's at K + V FLOPs: on the eager CPU
    kernels the value width costs far less than the FLOP count says (+5-18 % for 2x the width).
    """
    from layers.cp.cost_model import delta_flops, kernel_key
    from layers.cp.state_parallel import NATIVE_CP
    from layers.ops.backends import get_backend
    from layers.ops.delta_rule import chunk_op
    from layers.ops.summary import augmented_pass, segment_summary

    group = dist.GroupMember.WORLD if group is None else group
    device = group_device(group)
    kind = delta_kind(kind)
    key = kernel_key(kind.name, backend, k_dim, v_dim, str(dtype).replace("torch.", ""))
    if key in calibration.kernels:
        return calibration.kernels[key]
    fn = chunk_op(kind)
    gen = torch.Generator().manual_seed(0)
    native = backend in NATIVE_CP

    def run_op(q, k, v, g, beta, flags):
        o, _ = fn(q, k, v, g, beta, backend=backend, **flags)
        o.float().sum().backward()

    def run_augmented(q, k, v, g, beta, flags):          # two pieces, as on a zigzag rank
        n = q.shape[1]
        cu = torch.tensor([0, n // 2, n], dtype=torch.int32, device=q.device)
        o, final = augmented_pass(kind, get_backend(backend), q, k, v, g, beta, cu, k_dim ** -0.5, flags)
        (o.float().sum() + final.float().sum()).backward()

    def run_summary(q, k, v, g, beta, flags):            # final states of [v | 0] from [0 | I]
        M, E = segment_summary(kind, k, v, g, beta, backend=backend, **flags)
        (M.sum() + E.sum()).backward()

    second = ("summary", run_summary) if native else ("augmented", run_augmented)
    names, calls, flops = [], [], []
    for tokens, heads in OP_POINTS:
        inputs, flags = _delta_inputs(kind, tokens, heads, k_dim, v_dim, dtype, device, gen)
        for name, run, width in (("op", run_op, v_dim), (*second, k_dim + v_dim)):
            names.append(name)
            calls.append(lambda run=run, inputs=inputs, flags=flags: run(*inputs, flags))
            flops.append(3 * delta_flops(tokens, heads, k_dim, width))
    gemm_flops, gemm_calls = _gemm_calls(device, dtype)
    ts = time_concurrently(calls + gemm_calls, group, device)
    fits = {name: fit_line([f for f, n in zip(flops, names) if n == name],
                           [t for t, n in zip(ts, names) if n == name]) for name in ("op", second[0])}
    fits["gemm"] = fit_line(gemm_flops, ts[len(calls):])
    calibration.kernels[key] = fits
    return fits


def calibrate_gemm(calibration: Calibration, group, key: str, dtype: torch.dtype) -> dict:
    """Add ``calibration.kernels[key] = {"gemm": ...}`` (dense matmul forward + backward, all ranks at once;
    collective)."""
    group = dist.GroupMember.WORLD if group is None else group
    if key in calibration.kernels:
        return calibration.kernels[key]
    device = group_device(group)
    flops, calls = _gemm_calls(device, dtype)
    calibration.kernels[key] = {"gemm": fit_line(flops, time_concurrently(calls, group, device))}
    return calibration.kernels[key]


def _read(path: str) -> dict:
    if not path or not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"calibration file {path} must hold a JSON object keyed by world layout, got "
                         f"{type(data).__name__}")
    return data


def save(calibration: Calibration, path: str) -> None:
    """Merge ``calibration`` under its key into the JSON file ``path`` (atomic replace)."""
    data = _read(path)
    data[calibration.key] = calibration.to_json()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def load_or_calibrate(group=None, path: str | None = None, key: str | None = None) -> tuple[Calibration, str]:
    """(calibration, source) for ``group``: the entry of ``path`` for this world layout ``key`` (default
    ``layout_key(group)``; read by group rank 0 and broadcast), or a fresh measurement (then saved to ``path`` by
    group rank 0). ``source`` says which: ``"loaded from PATH" | "measured in X s"``. Collective over the group.
    Stateless: ``layers.cp.auto.AutoTuner`` keeps one per layout and process."""
    group = dist.GroupMember.WORLD if group is None else group
    key = layout_key(group) if key is None else key
    entry = broadcast_from_rank0(lambda: _read(path).get(key) if path else None, group)
    if entry is not None:
        return Calibration.from_json(entry), f"loaded from {path}"
    t0 = time.perf_counter()
    cal = calibrate(group, key=key)
    source = f"measured in {time.perf_counter() - t0:.2f} s"
    persist(cal, group, path)
    return cal, source


def persist(calibration: Calibration, group, path: str | None) -> None:
    """Save to ``path`` from group rank 0 (no-op without a path)."""
    if path and group_rank(group) == 0:
        save(calibration, path)
