"""Collectives per training step of the example at TP2 with gradient accumulation: where the TP sum of the GDN / KDA
output-norm weight gradients goes (layers/shared/tp_replicated_grads.py).

Two gloo ranks run one iteration of ``examples/pretrain/pretrain_hybrid.py`` (TP2, micro-batch 1, global batch
``--micro`` micro-batches, layers ``--pattern``) with and without ``--sequence-parallel``, once with the example's
``finalize_model_grads_func`` (ours: the TP sum once per step) and once with megatron-core's (the hook sums each
micro-batch). Every ``torch.distributed`` collective called through the module's attribute inside the step's
``forward_backward_func`` call (forward, backward and ``finalize_model_grads``; not the optimizer's gradient-norm
reduction) is counted by kind and by group (TP or other), with the bytes this rank contributes; megatron-core's SP
all-gathers / reduce-scatters go through aliases bound at its import and are not seen, so the table shows the
all-reduces. ``--repo DIR`` runs another checkout's code (e.g. the
tree before this change) with this script's counting.

Usage: ``python benchmarks/tp_replicated_grads.py [--micro 4] [--pattern GKGK] [--repo DIR] [--label NAME]
[--write-docs] [--json out.json]``. Data: ``--data-dir`` (default out/data/pydoc, built by the example on first use).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks._common import ROOT, add_output_args, publish, run_meta, spawn_gloo  # noqa: E402

KINDS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "_reduce_scatter_base",
         "_all_gather_base", "broadcast", "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_to_all_single")


def _argv(args, sp: bool) -> list:
    data = Path(args.data_dir)
    return ["--num-layers", str(len(args.pattern)), "--hidden-size", "32", "--num-attention-heads", "4",
            "--ffn-hidden-size", "64", "--seq-length", "32", "--micro-batch-size", "1",
            "--global-batch-size", str(args.micro), "--lr", "1e-3", "--lr-warmup-iters", "0",
            "--hp-layer-pattern", args.pattern, "--train-iters", "1", "--no-progress", "--split", "100,0,0",
            "--data-path", str(data / "pydoc_text_document"), "--tokenizer", str(data / "tokenizer.json"),
            "--tensor-model-parallel-size", "2"] + (["--sequence-parallel"] if sp else [])


def _count_step(counts: Counter, volume: Counter):
    """Patch torch.distributed's collectives to count into ``counts`` / ``volume`` while ``counting[0]``."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    counting = [False]

    def wrap(name, original):
        def counted(*a, **kw):
            if counting[0]:
                group = kw.get("group")
                if group is None:
                    group = next((x for x in a[1:] if isinstance(x, dist.ProcessGroup)), None)
                where = "TP" if group is parallel_state.get_tensor_model_parallel_group() else "other"
                counts[(name, where)] += 1
                tensor = a[0] if a and hasattr(a[0], "numel") else None
                volume[(name, where)] += 0 if tensor is None else tensor.numel() * tensor.element_size()
            return original(*a, **kw)
        return counted

    for name in KINDS:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))
    return counting


def _rank(rank, world, repo, argv_no_sp, argv_sp, finalize):
    sys.path[:0] = [repo, os.path.join(repo, "examples", "pretrain")]
    import megatron.core.pipeline_parallel as pp

    import pretrain_hybrid

    if finalize == "megatron":   # the example installs ours; megatron-core's leaves the sum to the per-step hook
        from megatron.core.distributed import finalize_model_grads

        import layers.shared.tp_replicated_grads as ours

        ours.finalize_model_grads = finalize_model_grads
    counts, volume = Counter(), Counter()
    counting = _count_step(counts, volume)
    original = pp.get_forward_backward_func

    def counted_forward_backward_func(*a, **kw):
        fwd_bwd = original(*a, **kw)

        def run(*args, **kwargs):
            counting[0] = not kwargs.get("forward_only", False)
            try:
                return fwd_bwd(*args, **kwargs)
            finally:
                counting[0] = False
        return run

    pp.get_forward_backward_func = counted_forward_backward_func
    out = {}
    for label, argv in (("no SP", argv_no_sp), ("SP", argv_sp)):
        counts.clear()
        volume.clear()
        history = pretrain_hybrid.train(pretrain_hybrid.parse_args(argv))
        out[label] = {"counts": {f"{k}@{w}": n for (k, w), n in sorted(counts.items())},
                      "bytes": {f"{k}@{w}": n for (k, w), n in sorted(volume.items())},
                      "grad_norm": history[0]["grad_norm"], "lm_loss": history[0]["lm_loss"]}
    return out


def measure(args) -> dict:
    repo = str(Path(args.repo).resolve()) if args.repo else str(ROOT)
    runs = {}
    for finalize in (("ours", "megatron") if not args.repo else ("example's",)):
        per_rank = spawn_gloo(_rank, 2, repo, _argv(args, False), _argv(args, True),
                              "megatron" if finalize == "megatron" else "example", exit_timeout=600.0)
        runs[finalize] = per_rank[0]
    return {"meta": run_meta("tp_replicated_grads.py"), "repo": args.label or ("this tree" if not args.repo else repo),
            "micro": args.micro,
            "pattern": args.pattern, "runs": runs}


def table(result) -> str:
    lines = [f"Per training step, rank 0 of 2 (TP2, {result['micro']} micro-batches, layers `{result['pattern']}`, "
             f"code: {result['repo']}): `torch.distributed.all_reduce` calls on the TP group and their bytes, issued "
             "by forward, backward and finalize_model_grads; the first iteration's gradient norm.",
             "", "| layout | finalize_model_grads_func | TP all-reduces | TP all-reduce bytes | grad norm |",
             "|---|---|---|---|---|"]
    for finalize, per_layout in result["runs"].items():
        for layout, run in per_layout.items():
            c, b = run["counts"], run["bytes"]
            lines.append(f"| {layout} | {finalize} | {c.get('all_reduce@TP', 0)} | {b.get('all_reduce@TP', 0)} | "
                         f"{run['grad_norm']:.6f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--micro", type=int, default=4, help="micro-batches per step (the global batch size)")
    p.add_argument("--pattern", default="GKGK", help="--hp-layer-pattern (G: GDN, K: KDA, M: MLA, A: attention)")
    p.add_argument("--data-dir", default=str(ROOT / "out" / "data" / "pydoc"))
    p.add_argument("--repo", default=None, help="run this checkout's layers / hp_megatron / example instead")
    p.add_argument("--label", default=None, help="what to call the code in the table (default: its path)")
    add_output_args(p)
    args = p.parse_args(argv)
    result = measure(args)
    name = "tp_replicated_grads" + ("_" + "".join(ch for ch in args.label if ch.isalnum()) if args.label else "")
    publish(result, table(result), args, name, f"### {args.label or 'This tree'}")


if __name__ == "__main__":
    main()
