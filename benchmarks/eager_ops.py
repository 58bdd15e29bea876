"""Eager GDN/KDA fwd+bwd against the pure-PyTorch references of transformers and megatron-core (CPU, fp32).

Same inputs, same process, one implementation after another:
  ours  gdn   layers.ops.chunk_gated_delta_rule(backend="eager")
  ours  kda   layers.ops.chunk_kda(backend="eager")
  hf    gdn   transformers.models.qwen3_next.modeling_qwen3_next.torch_chunk_gated_delta_rule
  mcore gdn   megatron.core.ssm.gated_delta_net.torch_chunk_gated_delta_rule
  hf    kda   transformers.models.kimi_linear.modeling_kimi_linear.chunk_kimi_delta_attention

Equivalence: q, k ``[B,T,H,K]``, v ``[B,T,H,V]`` (H value heads = H key heads, the references have no GVA),
g natural-log decay (``[B,T,H]`` GDN, ``[B,T,H,K]`` KDA), beta in (0,1), scale K**-0.5, no initial state,
final state returned, q/k l2-normalised as FLA does (x / sqrt(sum x^2 + 1e-6)): in the kernel for ours and
transformers (``use_qk_l2norm_in_kernel=True``); megatron-core's in-kernel l2norm needs FLA, so for it the same
formula is applied to q/k inside the timed region. The transformers functions are called through
``__wrapped__`` so the pure-PyTorch path runs even where FLA/hub kernels exist. Loss = sum(o * do) + sum(S * dS)
with fixed random cotangents; every implementation's output and input gradients are compared with ours
(relative L2).

Time: wall clock of forward + backward, ``--warmup`` untimed rounds then the median of ``--repeats`` rounds;
within a round the implementations alternate, so background load on a shared machine hits them alike.
Peak memory: one extra fwd+bwd under ``torch.profiler`` with ``profile_memory=True``; the allocator's
"[memory]" events give the running total of bytes allocated since the run began, and the peak of that total
is reported (memory above the inputs, including the gradients left in ``.grad``). This counts every tensor
allocation of PyTorch's CPU allocator, not the Python heap.

Usage: ``python benchmarks/eager_ops.py [--shapes B,T,H,K,V ...] [--repeats N] [--write-docs]``
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import add_output_args, cpu_peak_bytes, publish, rel_err, run_meta  # noqa: E402
from layers.ops import chunk_gated_delta_rule, chunk_kda  # noqa: E402

GOALS = {"gdn": ("hf", 2.0), "kda": ("hf", 10.0)}   # issue 2, at GOAL_SHAPE
GOAL_SHAPE = dict(B=1, T=4096, H=4, K=64, V=64)


def fla_l2norm(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def optional_function(module: str, name: str, label: str):
    """``module.name``, or None (said on stderr as skipping ``label``) where it does not import here."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        print(f"skipping {label}: {error}", file=sys.stderr)
        return None


def with_final_state_and_l2norm(fn):
    """fn(q, k, v, g, beta) -> (o, S) with the final state and FLA's in-kernel q/k l2norm."""
    return lambda q, k, v, g, b: fn(q, k, v, g, b, output_final_state=True, use_qk_l2norm_in_kernel=True)


def references():
    """name -> (kind, fn(q, k, v, g, beta) -> (o, S)) for every reference that imports here."""
    impls = {"ours_gdn": ("gdn", with_final_state_and_l2norm(chunk_gated_delta_rule)),
             "ours_kda": ("kda", with_final_state_and_l2norm(chunk_kda))}
    # transformers' functions through __wrapped__: the pure-PyTorch path even where hub kernels exist
    hf_gdn = optional_function("transformers.models.qwen3_next.modeling_qwen3_next", "torch_chunk_gated_delta_rule",
                               "transformers GDN")
    if hf_gdn is not None:
        impls["hf_gdn"] = ("gdn", with_final_state_and_l2norm(getattr(hf_gdn, "__wrapped__", hf_gdn)))
    mcore_gdn = optional_function("megatron.core.ssm.gated_delta_net", "torch_chunk_gated_delta_rule",
                                  "megatron-core GDN")
    if mcore_gdn is not None:
        impls["mcore_gdn"] = ("gdn", lambda q, k, v, g, b: mcore_gdn(
            fla_l2norm(q), fla_l2norm(k), v, g, b, output_final_state=True))
    hf_kda = optional_function("transformers.models.kimi_linear.modeling_kimi_linear", "chunk_kimi_delta_attention",
                               "transformers KDA")
    if hf_kda is not None:
        impls["hf_kda"] = ("kda", with_final_state_and_l2norm(getattr(hf_kda, "__wrapped__", hf_kda)))
    return impls


def make_inputs(kind, B, T, H, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    gshape = (B, T, H) if kind == "gdn" else (B, T, H, K)
    g = torch.nn.functional.logsigmoid(2.0 + torch.randn(gshape, generator=gen))   # mostly in (-1, 0)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    do = torch.randn(B, T, H, V, generator=gen)
    dS = torch.randn(B, H, K, V, generator=gen)
    return (q, k, v, g, beta), (do, dS)


def fwd_bwd(fn, inputs, cot):
    leaves = [x.clone().requires_grad_() for x in inputs]
    o, S = fn(*leaves)
    ((o * cot[0]).sum() + (S * cot[1]).sum()).backward()
    return o.detach(), S.detach(), [x.grad for x in leaves]


def time_interleaved(fns, inputs, cot, warmup, repeats, slow, slow_repeats):
    """Median fwd+bwd seconds per implementation, alternating implementations within each round so that
    background load hits them alike. ``slow`` implementations run only ``slow_repeats`` rounds, no warmup."""
    times = {name: [] for name in fns}
    for rnd in range(warmup + repeats):
        for name, fn in fns.items():
            if name in slow:
                if rnd < warmup or len(times[name]) >= slow_repeats:
                    continue
            start = time.perf_counter()
            fwd_bwd(fn, inputs, cot)
            elapsed = time.perf_counter() - start
            if rnd >= warmup or name in slow:
                times[name].append(elapsed)
    return {name: (statistics.median(ts), ts) for name, ts in times.items()}


def peak_bytes(fn, inputs, cot):
    """Peak of PyTorch's allocated CPU bytes during one fwd+bwd, above what existed before it."""
    return cpu_peak_bytes(lambda: fwd_bwd(fn, inputs, cot))


def run_shape(shape, impls, warmup, repeats, slow_repeats):
    B, T, H, K, V = shape
    rows = []
    for kind in ("gdn", "kda"):
        inputs, cot = make_inputs(kind, B, T, H, K, V)
        fns = {name: fn for name, (ikind, fn) in impls.items() if ikind == kind}
        o_ref, S_ref, g_ref = fwd_bwd(fns[f"ours_{kind}"], inputs, cot)
        errs = {}
        for name, fn in fns.items():
            o, S, grads = fwd_bwd(fn, inputs, cot)
            errs[name] = {"o": rel_err(o, o_ref), "final_state": rel_err(S, S_ref)}
            errs[name].update({f"d{n}": rel_err(gr, gref) for n, gr, gref in zip("q k v g beta".split(), grads, g_ref)})
        timed = time_interleaved(fns, inputs, cot, warmup, repeats, slow={"hf_kda"}, slow_repeats=slow_repeats)
        for name, fn in fns.items():
            median, times = timed[name]
            rows.append(dict(shape=dict(B=B, T=T, H=H, K=K, V=V), kind=kind, impl=name, ms=1e3 * median,
                             runs_ms=[round(1e3 * t, 1) for t in times], peak_mib=peak_bytes(fn, inputs, cot) / 2**20,
                             max_rel_err_vs_ours=max(errs[name].values()), rel_err_vs_ours=errs[name]))
            print(f"  {name:10s} {1e3 * median:9.1f} ms  peak {rows[-1]['peak_mib']:8.1f} MiB  "
                  f"max rel err vs ours {rows[-1]['max_rel_err_vs_ours']:.1e}", flush=True)
    for row in rows:
        ours = next(r for r in rows if r["impl"] == f"ours_{row['kind']}" and r["shape"] == row["shape"])
        row["speedup_of_ours"] = row["ms"] / ours["ms"]
    return rows


def markdown(rows, meta):
    lines = [f"Command: `{meta['command']}`", "",
             f"Machine: {meta['cpu_count']} CPU cores, torch {meta['torch']} (intra-op threads: {meta['threads']}), "
             f"transformers {meta['transformers']}, megatron-core {meta['megatron_core']}, fp32. "
             f"1-minute load average {meta['loadavg_before'][0]:.1f} before, {meta['loadavg_after'][0]:.1f} after "
             f"(the machine is shared; above {meta['cpu_count']} the timings are inflated). "
             f"fwd+bwd wall time is the median of {meta['repeats']} rounds after {meta['warmup']} warmup, "
             f"implementations alternating within each round "
             f"(transformers' KDA: median of {meta['slow_repeats']}, no warmup); peak memory is the peak of "
             f"PyTorch's allocated CPU bytes during one fwd+bwd above the inputs (torch.profiler memory events). "
             f"The error column is the largest relative L2 difference from ours over o, final state and the "
             f"gradients of q, k, v, g, beta.", "",
             "| shape (B,T,H,K,V) | op | implementation | fwd+bwd ms | ours is faster by | peak MiB | "
             "max rel. err vs ours |",
             "|---|---|---|---|---|---|---|"]
    names = {"ours_gdn": "ours (eager)", "ours_kda": "ours (eager)", "hf_gdn": "transformers Qwen3-Next",
             "mcore_gdn": "megatron-core", "hf_kda": "transformers Kimi-Linear"}
    for r in rows:
        s = r["shape"]
        ours = r["impl"].startswith("ours")
        speedup = "-" if ours else f"{r['speedup_of_ours']:.2f}x"
        err = "-" if ours else f"{r['max_rel_err_vs_ours']:.1e}"
        lines.append(f"| {s['B']},{s['T']},{s['H']},{s['K']},{s['V']} | {r['kind'].upper()} | {names[r['impl']]} | "
                     f"{r['ms']:.1f} | {speedup} | {r['peak_mib']:.1f} | {err} |")
    goals = []
    for kind, (ref, factor) in GOALS.items():
        for r in rows:
            if r["impl"] == f"{ref}_{kind}" and r["shape"] == GOAL_SHAPE:
                s = r["shape"]
                met = "met" if r["speedup_of_ours"] >= factor else "NOT met"
                goals.append(f"- {kind.upper()} at B{s['B']} T{s['T']} H{s['H']} K{s['K']} V{s['V']}: "
                             f"goal >= {factor:g}x faster than transformers, "
                             f"measured {r['speedup_of_ours']:.2f}x ({met}).")
    return "\n".join(lines + [""] + goals)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["1,4096,4,64,64", "2,1024,4,128,128"],
                        help="B,T,H,K,V (H value heads = key heads)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--slow-repeats", type=int, default=1, help="repeats for transformers' KDA (seconds each)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    add_output_args(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    meta = dict(run_meta("eager_ops.py", argv), cpu_count=os.cpu_count(), warmup=args.warmup, repeats=args.repeats,
                slow_repeats=args.slow_repeats, loadavg_before=os.getloadavg())
    impls = references()
    rows = []
    for text in args.shapes:
        shape = tuple(int(x) for x in text.split(","))
        if len(shape) != 5:
            parser.error(f"--shapes entries are B,T,H,K,V, got {text!r}")
        print(f"shape B,T,H,K,V = {shape}", flush=True)
        rows += run_shape(shape, impls, args.warmup, args.repeats, args.slow_repeats)
    meta["loadavg_after"] = os.getloadavg()
    publish(dict(meta=meta, rows=rows), markdown(rows, meta), args, "eager_ops",
            "## Eager GDN / KDA ops vs pure-PyTorch references (`benchmarks/eager_ops.py`)")


if __name__ == "__main__":
    main()
