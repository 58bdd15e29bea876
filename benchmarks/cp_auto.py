"""Validation of ``--hp-cp-method auto``: every CP method's real layer forward + backward on gloo against the model.

For each CP size P (spawned gloo CPU ranks, one thread each), the ranks calibrate the group
(``layers.cp.calibration``, or reuse ``--calibration PATH``), then for every sequence length and head
configuration build a real ``layers.GatedDeltaNet`` (or KDA) with ``cp_method="auto"`` and run it once (its
choice: the model's ranking, its 3 best timed on the layer), then one per valid candidate of
``layers.cp.cost_model.delta_candidates`` (every state method, grouped with each group size, each Ulysses degree
dividing the heads, the hybrids), time their forward + backward on this rank's zigzag shard (``--warmup``
untimed runs, then ``--repeats`` rounds that run every method once; the median, the slowest rank's time), and
compare with the model's predictions, the model's own choice and auto's choice.

Pass criteria of issue 15 (printed per case): auto's measured time within 10 % of the fastest measured method,
every predicted time within a factor of 2 of its measurement.

Usage: ``python benchmarks/cp_auto.py [--world-sizes 2,3,4] [--seq 768,3072] [--heads 4x4,3x6] [--kind gdn]
[--repeats 5] [--calibration PATH] [--json out.json] [--write-docs] [--plot docs/cp_auto.png]``
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before benchmarks/, whose layers.py would shadow the package

import torch  # noqa: E402

from benchmarks._common import add_output_args, publish, run_meta, spawn_gloo  # noqa: E402

HIDDEN, HEAD_DIM = 64, 32


def _heads(text):
    h, hv = text.lower().split("x")
    return int(h), int(hv)


def _time_layers(layers, x_local, repeats, warmup) -> list:
    """Median forward + backward seconds of each layer (the slowest rank's), timed round-robin: repeat r runs
    every layer once, so a load change on the machine hits all methods alike."""
    import torch.distributed as dist

    def step(layer):
        xl = x_local.clone().requires_grad_(True)
        y, _ = layer(xl)
        y.square().sum().backward()

    for layer in layers:
        for _ in range(warmup):
            step(layer)
    times = [[] for _ in layers]
    for _ in range(repeats):
        for i, layer in enumerate(layers):
            dist.barrier()
            t0 = time.perf_counter()
            step(layer)
            times[i].append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(ts) for ts in times], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _worker(rank, P, cases, kind, repeats, warmup, calibration_path):
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    from hp_megatron.platform import apply_cpu_shims
    from layers import GatedDeltaNet, KimiDeltaAttention
    from layers.cp.auto import auto_tuner, calibrate_layer, rank_candidates
    from layers.cp.calibration import calibrate_kernel, persist
    from layers.cp.cost_model import Candidate
    from layers.mixers.delta.cp import auto_layer

    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=P)
    apply_cpu_shims(0)
    tuner = auto_tuner()        # the layers built with cp_method="auto" below decide through it, on this calibration
    cal, source = tuner.calibration(None, calibration_path)
    calibrate_kernel(cal, None, kind=kind, backend="eager", k_dim=HEAD_DIM, v_dim=HEAD_DIM, dtype=torch.float32)
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
                               params_dtype=torch.float32, context_parallel_size=P)
    cls = GatedDeltaNet if kind == "gdn" else KimiDeltaAttention
    rows = []
    for T, (H, HV) in cases:
        def build(cand, H=H, HV=HV):
            return cls(config, None, layer_number=1, num_key_heads=H, num_value_heads=HV, key_head_dim=HEAD_DIM,
                       value_head_dim=HEAD_DIM, init_seed=1, cp_method=cand.method, cp_group_size=cand.group_size,
                       cp_ulysses_degree=cand.ulysses_degree)

        part = T // (2 * P)
        idx = torch.cat([torch.arange(c * part, (c + 1) * part) for c in (rank, 2 * P - 1 - rank)])
        x = torch.randn(T, 1, HIDDEN, generator=torch.Generator().manual_seed(T))[idx]
        reference = build(Candidate("allgather"))
        layer = auto_layer(reference, reference.cp_group, T, 1, None, x, None)   # the layer's description
        calibrate_layer(cal, None, layer)                 # the rest-of-layer fit auto measures
        decision = rank_candidates(layer.shape, P, cal)
        persist(cal, None, calibration_path)
        auto_mixer = build(Candidate("auto"))        # the real thing: model, then its best few timed on the layer
        auto_mixer(x.clone())
        auto = Candidate(*auto_mixer.cp_auto_choice(auto_mixer.cp_group)).label
        auto_line = tuner.log[-1]
        seconds = _time_layers([build(cand) for cand, _ in decision.ranking], x, repeats, warmup)
        measured = {cand.label: {"measured_s": t, "predicted_s": pred["total"], "predicted_comm_s": pred["comm"],
                                 "predicted_compute_s": pred["compute"]}
                    for (cand, pred), t in zip(decision.ranking, seconds)}
        best = min(measured, key=lambda k: measured[k]["measured_s"])
        model = decision.choice.label
        rows.append({"P": P, "T": T, "H": H, "HV": HV, "auto": auto, "model": model, "best_measured": best,
                     "auto_log": auto_line,
                     "auto_over_best": measured[auto]["measured_s"] / measured[best]["measured_s"],
                     "model_over_best": measured[model]["measured_s"] / measured[best]["measured_s"],
                     "methods": measured})
    return {"calibration": cal.to_json(), "source": source, "rows": rows}


def summarize(rows) -> dict:
    ratios = [m["predicted_s"] / m["measured_s"] for r in rows for m in r["methods"].values()]
    return {"cases": len(rows), "auto_within_10pct": sum(r["auto_over_best"] <= 1.10 for r in rows),
            "worst_auto_over_best": max(r["auto_over_best"] for r in rows),
            "model_within_10pct": sum(r["model_over_best"] <= 1.10 for r in rows),
            "worst_model_over_best": max(r["model_over_best"] for r in rows),
            "predicted_over_measured_min": min(ratios), "predicted_over_measured_max": max(ratios),
            "predictions_within_2x": sum(0.5 <= q <= 2.0 for q in ratios), "predictions": len(ratios)}


def markdown(rows, summary, kind, calibrations, meta, note="") -> str:
    lines = [f"`{meta['command']}` (torch {meta['torch']}, megatron-core {meta['megatron_core']}).{note}", "",
             f"{kind.upper()} layer (hidden {HIDDEN}, K = V = {HEAD_DIM}, batch 1, zigzag, fp32, eager) forward + "
             "backward per rank on gloo CPU ranks (one thread each): the slowest rank's median. *model* is the "
             "cost model's fastest prediction from the group's calibration; *auto* what `cp_method=\"auto\"` "
             "chose in a layer (the model's 3 fastest timed on the layer, the default); *best* the fastest "
             "method measured afterwards, all methods round-robin; pred/meas the range over all methods of the "
             "case.", "",
             "| P | T | H/HV | methods | model | model/best | auto | auto ms | best | best ms | auto/best | "
             "pred/meas (min..max) |",
             "|---:|---:|---|---:|---|---:|---|---:|---|---:|---:|---|"]
    for r in rows:
        m = r["methods"]
        q = [v["predicted_s"] / v["measured_s"] for v in m.values()]
        lines.append(f"| {r['P']} | {r['T']} | {r['H']}/{r['HV']} | {len(m)} | {r['model']} | "
                     f"{r['model_over_best']:.2f} | {r['auto']} | "
                     f"{m[r['auto']]['measured_s'] * 1e3:.1f} | {r['best_measured']} | "
                     f"{m[r['best_measured']]['measured_s'] * 1e3:.1f} | {r['auto_over_best']:.2f} | "
                     f"{min(q):.2f}..{max(q):.2f} |")
    lines += ["", f"auto within 10 % of the best in {summary['auto_within_10pct']} of {summary['cases']} cases "
              f"(worst {summary['worst_auto_over_best']:.2f}x); the model alone in {summary['model_within_10pct']} "
              f"(worst {summary['worst_model_over_best']:.2f}x); predictions within 2x of the measurement: "
              f"{summary['predictions_within_2x']} of {summary['predictions']} (ratio "
              f"{summary['predicted_over_measured_min']:.2f}..{summary['predicted_over_measured_max']:.2f}).", "",
              "Calibrations (alpha us/step, beta GB/s per rank; fold GFLOP/s; sync: straggler cost of one "
              "synchronization after a compute phase):", ""]
    for P, c in calibrations.items():
        fits = ", ".join(f"{n} {f['alpha'] * 1e6:.0f} us / {f['beta'] / 1e9:.2f} GB/s "
                         f"(resid {f['residual'] * 100:.0f}%)" for n, f in sorted(c["collectives"].items()))
        sync = c["sync"]
        lines.append(f"- P={P}: {fits}; fold {c['fold_flops'] / 1e9:.0f} GFLOP/s; sync {sync['alpha'] * 1e6:.0f} us + "
                     f"{100 / sync['beta']:.1f}% of the phase")
    return "\n".join(lines)


def plot(rows, path) -> None:
    try:
        import matplotlib
    except ImportError as err:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib); the JSON and table are written") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    for P in sorted({r["P"] for r in rows}):
        pts = [(m["measured_s"] * 1e3, m["predicted_s"] * 1e3) for r in rows if r["P"] == P
               for m in r["methods"].values()]
        ax.scatter(*zip(*pts), label=f"P={P}", s=14)
        auto = [(r["methods"][r["auto"]]["measured_s"] * 1e3, r["methods"][r["auto"]]["predicted_s"] * 1e3)
                for r in rows if r["P"] == P]
        ax.scatter(*zip(*auto), marker="*", s=90, edgecolors="k", linewidths=0.6)
    lo = min(min(m["measured_s"], m["predicted_s"]) for r in rows for m in r["methods"].values()) * 1e3 / 1.5
    hi = max(max(m["measured_s"], m["predicted_s"]) for r in rows for m in r["methods"].values()) * 1e3 * 1.5
    for f, style in ((1, "-"), (2, ":"), (0.5, ":")):
        ax.plot([lo, hi], [lo * f, hi * f], "k" + style, lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured fwd+bwd per rank, ms")
    ax.set_ylabel("predicted, ms")
    ax.set_title("CP cost model vs measurement (stars: auto's choice)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", default="2,3,4")
    ap.add_argument("--seq", default="768,3072", help="global sequence lengths (multiples of 2P and of 64)")
    ap.add_argument("--heads", default="4x4,3x6", help="H x HV head configurations")
    ap.add_argument("--kind", choices=("gdn", "kda"), default="gdn")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--calibration", default=None, help="calibration JSON cache (reused per world layout)")
    ap.add_argument("--plot", default=None, help="write the predicted-vs-measured plot (PNG) here")
    ap.add_argument("--note", default="", help="a sentence printed under the command (e.g. the machine's load)")
    add_output_args(ap)
    args = ap.parse_args(argv)
    seqs = [int(s) for s in args.seq.split(",")]
    heads = [_heads(h) for h in args.heads.split(",")]
    rows, calibrations = [], {}
    for P in [int(p) for p in args.world_sizes.split(",")]:
        bad = [T for T in seqs if T % (2 * P)]
        if bad:
            raise ValueError(f"sequence lengths {bad} are not divisible by 2P={2 * P} (zigzag)")
        out = spawn_gloo(_worker, P, [(T, hv) for T in seqs for hv in heads], args.kind, args.repeats,
                         args.warmup, args.calibration)[0]
        calibrations[P] = out["calibration"]
        rows += out["rows"]
    summary = summarize(rows)
    result = {"meta": run_meta("cp_auto.py", argv), "summary": summary, "rows": rows, "calibrations": calibrations}
    table = markdown(rows, summary, args.kind, calibrations, result["meta"], f" {args.note}" if args.note else "")
    if args.plot:
        table += f"\n\n![cp auto]({Path(args.plot).name})"
    publish(result, table, args, "cp_auto", "## CP method auto: cost model vs measured layer time")
    if args.plot:
        plot(rows, args.plot)
    return result


if __name__ == "__main__":
    main()
