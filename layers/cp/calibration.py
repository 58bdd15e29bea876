"""Calibration of the CP cost model on a real CP group: time its collectives, the fold matmul and the kernels.

``calibrate(group)`` times, on every rank of the group at once, the all-gather, the send/recv ring shift and the
all-to-all of ``layers.cp.collectives`` at three message sizes, and the fp32 fold matmul at two sizes; the
per-rank medians are max-reduced over the group (so every rank fits the same numbers), and a line
t = alpha * steps + bytes / beta is fitted per collective (least squares, residual = RMS relative error).
``calibrate_kernel`` adds the fit of one delta-rule op shape (forward + backward) and of the dense projections.
``load_or_calibrate(group, path)`` reuses a saved calibration from the JSON file ``path`` (keyed by the world
layout and hardware, ``layout_key``) or measures one and saves it there. A calibration takes about a second.
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

from layers.cp.collectives import all_gather_raw, all_to_all_raw, exchange, global_rank, group_rank, group_size
from layers.cp.cost_model import Calibration, LinearFit

MESSAGE_BYTES = (16 << 10, 256 << 10, 2 << 20)       # per-rank payload of each timed collective
REPEATS = 9
_CACHE: dict = {}                                      # layout key -> Calibration (this process)


def group_device(group) -> torch.device:
    """Device the group's collectives run on: CUDA for NCCL, NPU for HCCL, else CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if "hccl" in backend:
        return torch.device("npu", torch.npu.current_device())   # noqa: attribute added by torch_npu
    return torch.device("cpu")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def _median_seconds(fn, device, repeats=REPEATS) -> float:
    fn()                                               # warm-up (connections, allocations)
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _max_over_group(values: list, group, device) -> list:
    t = torch.tensor(values, dtype=torch.float64, device=device if device.type != "cpu" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()


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
    torch version. Collective over the group (an all-gather of each rank's host and device)."""
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
            f"{'+'.join(sorted({n for _, n in everyone}))}|torch={torch.__version__.split('+')[0]}")


def calibrate(group=None, *, message_bytes=MESSAGE_BYTES, repeats: int = REPEATS, key: str = "") -> Calibration:
    """Measure the collective fits and the fold FLOP/s on ``group`` (collective: every member must call it)."""
    group = dist.GroupMember.WORLD if group is None else group
    P, r = group_size(group), group_rank(group)
    device = group_device(group)
    times, points = [], []
    for nbytes in message_bytes:
        n = max(nbytes // 4 // P * P, P)
        x = torch.randn(n, device=device)
        recv = torch.empty_like(x)
        nxt, prv = (r + 1) % P, (r - 1) % P
        a2a_in = x.view(P, -1)
        times += [_median_seconds(lambda: all_gather_raw(x, group), device, repeats),
                  _median_seconds(lambda: exchange([(x, nxt)], [(recv, prv)], group), device, repeats),
                  _median_seconds(lambda: all_to_all_raw(a2a_in, group), device, repeats)]
        points.append(n * 4)
    fold = []
    for heads in (2, 16):
        K = 64
        M, E = torch.randn(heads, K, K, device=device), torch.randn(heads, K, 2 * K, device=device)
        fold.append((2 * heads * K * K * 2 * K, _median_seconds(lambda: M @ E, device, repeats)))
    times = _max_over_group(times + [t for _, t in fold], group, device)
    by_type = {c: times[i:3 * len(points):3] for i, c in enumerate(("all_gather", "send_recv", "all_to_all"))}
    recv_bytes = {"all_gather": [(P - 1) * b for b in points], "send_recv": list(points),
                  "all_to_all": [(P - 1) * b / P for b in points]}
    steps = {"all_gather": math.ceil(math.log2(P)) if P > 1 else 1, "send_recv": 1, "all_to_all": 1}
    fits = {c: fit_line(recv_bytes[c], by_type[c], steps[c]) for c in by_type}
    fold_fit = fit_line([f for f, _ in fold], times[3 * len(points):])
    return Calibration(collectives=fits, fold_flops=fold_fit.beta, key=key)


def _delta_inputs(kind, tokens, heads, K, V, dtype, device, gen):
    """Raw q, k, v, gate, beta and the in-kernel flags the GDN/KDA mixers use (l2norm, sigmoid beta, gate)."""
    q, k = (torch.randn(1, tokens, heads, K, generator=gen).to(device, dtype) for _ in range(2))
    v = torch.randn(1, tokens, heads, V, generator=gen).to(device, dtype)
    g = torch.randn((1, tokens, heads) + ((K,) if kind == "kda" else ()), generator=gen).to(device, dtype)
    beta = torch.randn(1, tokens, heads, generator=gen).to(device, dtype)
    flags = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
                 A_log=torch.zeros(heads, device=device, dtype=dtype),
                 dt_bias=torch.zeros(heads * (K if kind == "kda" else 1), device=device, dtype=dtype))
    return [t.requires_grad_(True) for t in (q, k, v, g, beta)], flags


def _gemm_points(device, dtype, hidden) -> list:
    """(FLOPs, seconds) of a [tokens, hidden] x [hidden, hidden] matmul forward + backward at two sizes."""
    points = []
    for tokens in (128, 512):
        x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(hidden, hidden, device=device, dtype=dtype, requires_grad=True)
        points.append((3 * 2 * tokens * hidden * hidden,
                       _median_seconds(lambda: (x @ w).float().sum().backward(), device, 3)))
    return points


def calibrate_kernel(calibration: Calibration, group, *, kind: str, backend: str, k_dim: int, v_dim: int,
                     dtype: torch.dtype, hidden: int = 256) -> dict:
    """Add ``calibration.kernels[kernel_key]`` = {"op": the delta-rule op forward + backward with the mixers'
    in-kernel flags (FLOPs as ``cost_model.delta_flops`` x 3), "summary": the generic summary pass (values
    [v | 0_K], FLOPs at width K + V), "gemm": a dense matmul forward + backward} (collective)."""
    from layers.cp.cost_model import delta_flops, kernel_key
    from layers.ops import chunk_gated_delta_rule, chunk_kda
    from layers.ops.summary import segment_summary

    group = dist.GroupMember.WORLD if group is None else group
    device = group_device(group)
    key = kernel_key(kind, backend, k_dim, v_dim, str(dtype).replace("torch.", ""))
    if key in calibration.kernels:
        return calibration.kernels[key]
    fn = chunk_gated_delta_rule if kind == "gdn" else chunk_kda
    gen = torch.Generator().manual_seed(0)
    heads, op_points, summary_points = 2, [], []
    for tokens in (128, 512):
        (q, k, v, g, beta), flags = _delta_inputs(kind, tokens, heads, k_dim, v_dim, dtype, device, gen)

        def run_op():
            o, _ = fn(q, k, v, g, beta, backend=backend, **flags)
            o.float().sum().backward()

        def run_summary():           # the generic CP path's extra pass: final states of [v | 0] from [0 | I]
            M, E = segment_summary(kind, k, v, g, beta, backend=backend, **flags)
            (M.sum() + E.sum()).backward()
        op_points.append((3 * delta_flops(tokens, heads, k_dim, v_dim), _median_seconds(run_op, device, 3)))
        summary_points.append((3 * delta_flops(tokens, heads, k_dim, k_dim + v_dim),
                               _median_seconds(run_summary, device, 3)))
    gemm_points = _gemm_points(device, dtype, hidden)
    ts = _max_over_group([t for _, t in op_points + summary_points + gemm_points], group, device)
    fits = {"op": fit_line([f for f, _ in op_points], ts[:2]),
            "summary": fit_line([f for f, _ in summary_points], ts[2:4]),
            "gemm": fit_line([f for f, _ in gemm_points], ts[4:])}
    calibration.kernels[key] = fits
    return fits


def calibrate_gemm(calibration: Calibration, group, key: str, dtype: torch.dtype, hidden: int = 256) -> dict:
    """Add ``calibration.kernels[key] = {"gemm": ...}`` (dense matmul forward + backward; collective)."""
    group = dist.GroupMember.WORLD if group is None else group
    if key in calibration.kernels:
        return calibration.kernels[key]
    device = group_device(group)
    points = _gemm_points(device, dtype, hidden)
    ts = _max_over_group([t for _, t in points], group, device)
    calibration.kernels[key] = {"gemm": fit_line([f for f, _ in points], ts)}
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


def load_or_calibrate(group=None, path: str | None = None) -> tuple[Calibration, str]:
    """(calibration, source) for ``group``: this process's cached one, the entry of ``path`` for this world
    layout (read by group rank 0 and broadcast), or a fresh measurement (then saved to ``path`` by group rank 0).
    ``source`` says which: ``"cached" | "loaded from PATH" | "measured in X s"``. Collective over the group."""
    group = dist.GroupMember.WORLD if group is None else group
    key = layout_key(group)
    if key in _CACHE:
        return _CACHE[key], "cached"
    entry = broadcast_from_rank0(lambda: _read(path).get(key) if path else None, group)
    if entry is not None:
        cal, source = Calibration.from_json(entry), f"loaded from {path}"
    else:
        t0 = time.perf_counter()
        cal = calibrate(group, key=key)
        source = f"measured in {time.perf_counter() - t0:.2f} s"
        persist(cal, group, path)
    _CACHE[key] = cal
    return cal, source


def broadcast_from_rank0(fn, group):
    """``fn()`` evaluated on group rank 0 and broadcast to every rank (collective). An exception on rank 0 is
    broadcast too and re-raised on every rank, so no rank is left waiting."""
    box = [None]
    if group_rank(group) == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as err:   # noqa: BLE001 (re-raised below on every rank)
            box[0] = ("error", err)
    dist.broadcast_object_list(box, src=global_rank(group, 0), group=group)
    status, value = box[0]
    if status == "error":
        raise value
    return value


def persist(calibration: Calibration, group, path: str | None) -> None:
    """Save to ``path`` from group rank 0 (no-op without a path)."""
    if path and group_rank(group) == 0:
        save(calibration, path)
