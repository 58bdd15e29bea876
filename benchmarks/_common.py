"""Pieces the benchmark scripts share: run metadata, CPU peak memory, relative error, and the marked sections
of docs/benchmarks.md. Import it as ``benchmarks._common`` after the script has put the repo root on sys.path."""
from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks.md"
NEW_DOCS = "# Benchmarks\n\nTables measured by the scripts in `benchmarks/`.\n"


def run_meta(script: str, argv=None) -> dict:
    """The command line (``argv``, default ``sys.argv[1:]``) and the software versions a table states."""
    import megatron.core
    import transformers

    return dict(command=f"python benchmarks/{script} " + " ".join(argv if argv is not None else sys.argv[1:]),
                torch=torch.__version__, threads=torch.get_num_threads(), megatron_core=megatron.core.__version__,
                transformers=transformers.__version__, python=platform.python_version())


def cpu_memory_of(run) -> tuple:
    """``(result, peak, retained)`` of ``result = run()``: the peak of PyTorch's running total of allocated CPU bytes
    while it executes and the total still allocated at its end (while ``result`` is alive), both above what existed
    before it (the ``[memory]`` events of ``torch.profiler`` with ``profile_memory=True``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = run()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text())["traceEvents"]
    memory = sorted((e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0),
                    key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))
    total = peak = 0
    for event in memory:
        total += event["args"]["Bytes"]
        peak = max(peak, total)
    return result, peak, total


def cpu_peak_bytes(run) -> int:
    """Peak of PyTorch's running total of allocated CPU bytes while ``run()`` executes, above what existed before it
    (:func:`cpu_memory_of`)."""
    return cpu_memory_of(run)[1]


def rel_err(a, b) -> float:
    """Relative L2 difference ||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def marked_section(name: str, body: str) -> str:
    """``body`` between the markers ``<!-- name:begin -->`` and ``<!-- name:end -->``, one line each."""
    return f"<!-- {name}:begin -->\n{body}\n<!-- {name}:end -->"


def write_docs_section(section: str, path=DOCS, heading: str | None = None) -> None:
    """Put a :func:`marked_section` into the markdown file ``path``: it replaces what the same markers held,
    or, where they are missing, it is appended (after the line ``heading``, outside the markers, when given).
    A missing file is created."""
    begin, end = section.split("\n", 1)[0], section.rsplit("\n", 1)[-1]
    if not (begin.startswith("<!-- ") and begin.endswith(":begin -->") and end == begin.replace(":begin", ":end")):
        raise ValueError(f"section must start and end with <!-- name:begin/end --> markers, got {begin!r} ... {end!r}")
    path = Path(path)
    text = path.read_text(encoding="utf-8") if path.exists() else NEW_DOCS
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + (f"{heading}\n\n" if heading else "") + section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def add_output_args(parser) -> None:
    """``--write-docs`` and ``--json PATH``, the outputs :func:`publish` writes."""
    parser.add_argument("--write-docs", action="store_true", help=f"write the table into {DOCS.relative_to(ROOT)}")
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON results to this file")


def publish(result, table: str, args, docs_name: str, docs_title: str) -> None:
    """Print ``result`` as JSON and the markdown ``table``; with ``args.json`` write the JSON there, with
    ``args.write_docs`` put the table under ``docs_title`` into the ``docs_name`` section of docs/benchmarks.md."""
    text = json.dumps(result, indent=1)
    print(text)
    print(table)
    if args.json:
        Path(args.json).write_text(text, encoding="utf-8")
    if args.write_docs:
        write_docs_section(marked_section(docs_name, f"{docs_title}\n\n{table}"), DOCS)
        print(f"wrote {DOCS}")


def _gloo_entry(rank, world_size, port, fn, args, queue):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        queue.put((rank, fn(rank, world_size, *args)))
    finally:
        dist.destroy_process_group()


def spawn_gloo(fn, world_size: int, *args, timeout: float = 3600.0, exit_timeout: float = 300.0) -> list:
    """Run ``fn(rank, world_size, *args)`` (a module-level function) on ``world_size`` spawned gloo CPU ranks
    with one thread each; returns the results by rank. A rank that fails, or is still running ``exit_timeout``
    seconds after all results arrived, makes this raise."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gloo_entry, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=timeout) for _ in range(world_size))
    finally:
        for p in procs:
            p.join(timeout=exit_timeout)
            if p.is_alive():
                p.kill()
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"benchmark ranks exited with {bad}")
    return [results[r] for r in range(world_size)]
