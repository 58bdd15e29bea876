"""Where our triton ops spend time beyond bare flash-linear-attention (issue 16): interleaved timing + profile.

For GDN and KDA at each shape and mode, FLA's public op (``gpu_layers.py`` section a) and ours
(``layers.ops`` with ``backend="triton"``, section b) run on the same inputs and flags. Timing alternates windows
of the two (``gpu_layers.measure_pair``: ``--rounds`` rounds, each window lasting at least ``--window-ms``), so
clock and thermal drift hit both alike; each side's median window is reported, with the host (enqueue) time per
step. ``torch.profiler``
then records ``--profile-steps`` steps of each: the CUDA kernels (name, calls, device time) and the CPU time of
the call; kernels or copies that ours launches beyond FLA's are listed, so an extra cast, copy or host sync
shows by name.

    python benchmarks/gpu_profile.py --out out/profile --docs docs/benchmarks.md

``--device cpu --dims 4,16,16,64 --shapes B1T64`` is a smoke run through Triton's interpreter (the caller must
enable it before FLA is imported; see tests/backends/test_gpu_layers_smoke.py); CPU times mean nothing.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_layers  # noqa: E402
from benchmarks._common import marked_section, write_docs_section  # noqa: E402


def _sync():
    if gpu_layers.DEVICE == "cuda":
        torch.cuda.synchronize()


def _device_us(event) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, attr, None)
        if value is not None:
            return float(value)
    return 0.0


def kernel_profile(step, steps: int) -> dict:
    """Kernels (name -> [calls, device us per step]) and CPU ms per step of ``steps`` profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu_layers.DEVICE == "cuda" else [])
    step()
    _sync()
    with profile(activities=activities) as prof:
        h0 = time.perf_counter()
        for _ in range(steps):
            step()
        _sync()
        wall = (time.perf_counter() - h0) * 1e3 / steps
    kernels, aten = {}, {}
    for event in prof.key_averages():
        device_type = str(getattr(event, "device_type", "")).rsplit(".", 1)[-1]
        if device_type == "CUDA":
            kernels[event.key] = [event.count // steps, round(_device_us(event) / steps, 1)]
        elif event.key.startswith("aten::") and event.key in ("aten::copy_", "aten::to", "aten::_to_copy",
                                                              "aten::contiguous", "aten::item",
                                                              "aten::_local_scalar_dense", "aten::clone",
                                                              "aten::cat", "aten::empty_strided"):
            aten[event.key] = event.count // steps
    device_us = round(sum(us for _, us in kernels.values()), 1)
    return {"kernels": kernels, "device_us": device_us, "wall_ms": round(wall, 3), "aten": aten}


def _diff(ours: dict, fla: dict) -> list[str]:
    lines = []
    for name, (calls, us) in sorted(ours["kernels"].items(), key=lambda kv: -kv[1][1]):
        base = fla["kernels"].get(name)
        if base is None:
            lines.append(f"extra kernel {name}: {calls} call(s), {us} us")
        elif base[0] != calls or abs(base[1] - us) > max(5.0, 0.05 * base[1]):
            lines.append(f"{name}: {calls} call(s) {us} us vs FLA {base[0]} call(s) {base[1]} us")
    for name in fla["kernels"]:
        if name not in ours["kernels"]:
            lines.append(f"FLA-only kernel {name}")
    for op, calls in sorted(ours["aten"].items()):
        if calls != fla["aten"].get(op, 0):
            lines.append(f"{op}: {calls} per step vs FLA {fla['aten'].get(op, 0)}")
    return lines


def run_case(kind: str, B: int, T: int, mode: str, rounds: int, window_ms: float, profile_steps: int) -> dict:
    tensors, flags = gpu_layers.op_inputs(kind, B, T)
    steps = {"fla": gpu_layers._op_step(gpu_layers._op_fn(kind, "a"), tensors, flags, mode),
             "ours": gpu_layers._op_step(gpu_layers._op_fn(kind, "b"), tensors, flags, mode)}
    timing = gpu_layers.measure_pair({name: (lambda step=step: step) for name, step in steps.items()}, B * T, 3,
                                     max(rounds // 2, 1), min_window_s=window_ms / 1e3)
    profiles = {name: kernel_profile(step, profile_steps) for name, step in steps.items()}
    ratio = timing["ours"]["ms"] / timing["fla"]["ms"]
    return {"kind": kind, "shape": f"B{B} T{T}", "mode": mode, "timing": timing,
            "overhead_pct": round((ratio - 1) * 100, 1),
            "device_us": {name: p["device_us"] for name, p in profiles.items()},
            "profile_wall_ms": {name: p["wall_ms"] for name, p in profiles.items()},
            "diff": _diff(profiles["ours"], profiles["fla"]),
            "kernels": {name: p["kernels"] for name, p in profiles.items()}}


def render(report: dict) -> str:
    meta = report["meta"]
    lines = [f"Measured {meta['date']} on {meta.get('gpu', '?')}; torch {meta.get('torch')}, triton "
             f"{meta.get('triton')}, flash-linear-attention {meta.get('fla')}. Command: `{meta['command']}`. "
             f"Interleaved windows (ABBA, {meta['rounds']} rounds); device ms from CUDA events; "
             "`kernel us` is the sum of profiled kernel time per step.", "",
             "| op | mode | shape | FLA ms | ours ms | overhead | FLA host ms | ours host ms | FLA kernel us | "
             "ours kernel us | differences (ours vs FLA) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        if "error" in row:
            lines.append(f"| {row['kind']} | {row['mode']} | {row['shape']} | | | | | | | | {row['error']} |")
            continue
        t = row["timing"]
        diff = "; ".join(row["diff"]) or "none: same kernels, same calls"
        lines.append(f"| {row['kind']} | {row['mode']} | {row['shape']} | {t['fla']['ms']} | {t['ours']['ms']} | "
                     f"{row['overhead_pct']:+.1f}% | {t['fla']['host_ms']} | {t['ours']['host_ms']} | "
                     f"{row['device_us']['fla']} | {row['device_us']['ours']} | {diff.replace('|', '/')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="gdn,kda")
    parser.add_argument("--shapes", default="B8T4096,B1T16384")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--window-ms", type=float, default=60.0)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=120.0, help="stop starting cases after this")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dims", default=None, help="H,K,V,HIDDEN (smoke runs)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--docs", type=Path, default=None)
    parser.add_argument("--render", type=Path, default=None, help="re-render a saved profile.json into --docs")
    args = parser.parse_args(argv)
    if args.render is not None:
        report = json.loads(args.render.read_text(encoding="utf-8"))
        _publish(report, None, args.docs)
        return 0
    if args.rounds < 1 or args.window_ms <= 0 or args.profile_steps < 1:
        parser.error(f"--rounds and --profile-steps must be >= 1 and --window-ms > 0; got {args.rounds}, "
                     f"{args.profile_steps}, {args.window_ms}")
    gpu_layers.DEVICE = args.device
    gpu_layers.DTYPE = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.dims:
        gpu_layers.H, gpu_layers.K, gpu_layers.V, gpu_layers.HIDDEN = (int(x) for x in args.dims.split(","))
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_profile.py needs a CUDA GPU", file=sys.stderr)
        return 2
    meta = {"date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/gpu_profile.py " +
            " ".join(argv if argv is not None else sys.argv[1:]), "rounds": args.rounds, "torch": torch.__version__}
    try:
        import fla
        import triton

        meta.update(triton=triton.__version__, fla=getattr(fla, "__version__", "?"))
    except ImportError as error:
        meta["import_error"] = str(error)
    if args.device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(0)
    deadline = time.monotonic() + args.budget_s
    report = {"meta": meta, "rows": []}
    for mode in args.modes.split(","):
        for kind in args.kinds.split(","):
            for B, T in gpu_layers.parse_shapes(args.shapes):
                if time.monotonic() > deadline:
                    report["rows"].append({"kind": kind, "shape": f"B{B} T{T}", "mode": mode,
                                           "error": "not run: time budget exhausted"})
                    continue
                try:
                    row = run_case(kind, B, T, mode, args.rounds, args.window_ms, args.profile_steps)
                except Exception as error:  # noqa: BLE001 - recorded in the table
                    row = {"kind": kind, "shape": f"B{B} T{T}", "mode": mode,
                           "error": f"{type(error).__name__}: {error}"[:300].replace("\n", " ")}
                report["rows"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                if args.out:
                    args.out.mkdir(parents=True, exist_ok=True)
                    (args.out / "profile.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    _publish(report, args.out, args.docs)
    return 0


def _publish(report: dict, out: Path | None, docs: Path | None) -> None:
    markdown = render(report)
    if out:
        (out / "profile.md").write_text(markdown, encoding="utf-8")
    if docs:
        write_docs_section(marked_section("gpu-profile", markdown), docs,
                           heading="## GPU: our triton ops against bare FLA, interleaved and profiled "
                                   "(benchmarks/gpu_profile.py)")
    print(markdown)


if __name__ == "__main__":
    sys.exit(main())
