"""``python -m hp_megatron.selfcheck``: arguments, the run, the printed tables, the exit status."""
from __future__ import annotations

import argparse
import sys

from hp_megatron.selfcheck.cp import WORLD, plan
from hp_megatron.selfcheck.device import (DEVICE_TYPES, accelerator_count, comm_backend, describe,
                                          resolve)
from hp_megatron.selfcheck.report import (DTYPE_NAMES, TOLERANCES, dtype_name, format_details, format_requirements,
                                          format_results, summary)
from hp_megatron.selfcheck.select import selector
from layers.base.choices import BACKENDS
from layers.ops import requirements

DEFAULT_DTYPES = "bf16"
VERSIONS = "versions (layers/ops/requirements.py):"
KERNELS = "kernels:"


def parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m hp_megatron.selfcheck",
        description="Run every op of a kernel backend (forward, backward, packed, decode, CP on 2 ranks) against the "
                    "eager backend on the same device; print one table and the installed versions; exit 0 only when "
                    "everything passes.")
    p.add_argument("--backend", required=True, choices=BACKENDS)
    p.add_argument("--device", default="auto", choices=DEVICE_TYPES,
                   help="auto: npu for ascendc, cuda for triton (cpu when no GPU: Triton's interpreter), else the "
                        "first of cuda / npu / cpu")
    p.add_argument("--dtype", default=DEFAULT_DTYPES,
                   help=f"comma list of {', '.join(DTYPE_NAMES)} (default {DEFAULT_DTYPES}; fla-npu's kernels take "
                        f"bf16)")
    p.add_argument("--only", default="", help="comma list of substrings of '<op> <case>' selecting rows (e.g. "
                                              "'chunk_kda', 'CP2 p2p'); default: all")
    p.add_argument("--no-cp", action="store_true", help="skip the rows that spawn the 2 CP ranks")
    p.add_argument("--verbose", action="store_true", help="print the traceback of every ERROR row after the table")
    p.add_argument("--cp-timeout", type=float, default=900.0,
                   help="seconds the 2 CP ranks may take in all, start-up, kernel compilation and every CP row "
                        "included (default 900); past it their rows are ERRORs")
    args = p.parse_args(argv)
    try:
        args.dtypes = [DTYPE_NAMES[name.strip()] for name in args.dtype.split(",") if name.strip()]
    except KeyError as error:
        p.error(f"--dtype takes {', '.join(DTYPE_NAMES)}, got {error.args[0]!r}")
    if not args.dtypes:
        p.error("--dtype names no dtype")
    args.patterns = [s for s in args.only.split(",") if s.strip()]
    return args


def _soc(backend, device):
    if backend != "ascendc":
        return None
    try:
        from layers.ops.ascendc import runtime

        return runtime.soc(device)
    except (RuntimeError, ValueError):
        return None


def kernels(backend: str) -> str:
    """The kernels ``backend`` runs here, in one line (the triton backend: FLA's Triton kernels, or what FLA's
    backend dispatch may pick when the user turned it on; layers/ops/triton/runtime.py)."""
    if backend == "triton":
        from layers.ops.triton.runtime import kernels_in_use

        return kernels_in_use()
    return {"eager": "pure PyTorch (layers/ops/eager)",
            "ascendc": "fla-npu's Ascend C / triton-ascend kernels (layers/ops/ascendc)"}[backend]


def _prepare(backend, requested):
    """(device, limits) or RuntimeError naming why the backend cannot run here."""
    from hp_megatron.selfcheck.limits import probe
    from layers.ops.backends import get_backend

    device = resolve(backend, requested)
    get_backend(backend)
    return device, probe(backend, device)


def main(argv=None, *, rank_setup=None) -> int:
    """Run the self-check; returns the exit status (0: every row passed or is not available, and every
    requirement is met; 1 otherwise). ``rank_setup``: a picklable callable each spawned CP rank runs first, before
    any backend is imported (for test harnesses: a stand-in or Triton's interpreter; users leave it None)."""
    args = parse(argv)
    out = sys.stdout
    print(f"hp_megatron self-check: backend={args.backend}, against backend=eager on the same device", file=out)
    try:
        device, limits = _prepare(args.backend, args.device)
    except (RuntimeError, ValueError) as error:
        checks = requirements.check(args.backend, requirements.installed(args.backend))
        print(f"\nbackend={args.backend} cannot run here: {error}\n\n{VERSIONS}\n{format_requirements(checks)}",
              file=out)
        print("\nFAILED: the backend is not available", file=out)
        return 1
    count = accelerator_count(device.type)
    comm = comm_backend(device.type, count)
    checks = requirements.check(args.backend, requirements.installed(args.backend), _soc(args.backend, device))
    tolerances = ", ".join(f"{dtype_name(d)} {TOLERANCES[d]:.0e}" for d in args.dtypes)
    print(f"device: {describe(device)}; dtypes: {', '.join(dtype_name(d) for d in args.dtypes)}; "
          f"tolerance (relative L2, largest over the row's tensors): {tolerances}", file=out, flush=True)
    print(f"{KERNELS} {kernels(args.backend)}", file=out, flush=True)

    from hp_megatron.selfcheck.single import single_rows
    from hp_megatron.selfcheck.spawn import run_cp

    wanted = selector(args.patterns)
    rows = []
    for dtype in args.dtypes:
        rows += single_rows(args.backend, device, dtype, limits, wanted)
    planned = [] if args.no_cp else plan(wanted)
    if planned:
        where = (f"{WORLD} ranks on {device.type}" if device.type == "cpu" or count >= 2 else
                 f"{WORLD} ranks sharing {device}, gloo with host staging")
        print(f"CP: {where}, {comm}", file=out, flush=True)
        rows += run_cp(planned, world=WORLD, device_type=device.type, count=count, comm=comm,
                       backend=args.backend, dtypes=args.dtypes, patterns=args.patterns, rank_setup=rank_setup,
                       timeout_s=args.cp_timeout)
    status, line = summary(rows, checks)
    details = format_details(rows) if args.verbose else ""
    print(f"\n{format_results(rows)}\n" + (f"\nERROR details:\n{details}\n" if details else "")
          + f"\n{VERSIONS}\n{format_requirements(checks)}\n\n{line}", file=out, flush=True)
    return status
