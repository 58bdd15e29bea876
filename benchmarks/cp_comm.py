"""Communication of GDN/KDA context parallelism per rank per layer: the five methods, P = 2 .. 1024.

Layer: HV = 32 value heads, H = 16 query/key heads, K = V = 128, global sequence T = 131,072 tokens, one
sequence (D = 1), Megatron's zigzag layout; states and summaries fp32, activations bf16 (Ulysses).

* Measured (small P, default 2 and 4): the real code runs on gloo CPU ranks: ``ChainScan`` forward +
  backward on real-size summaries ([M | E] of 32 x 128 x 256 fp32; state bytes do not depend on T) and the
  Ulysses exchange of q, k, v, g, beta (and the output back) on a few tokens per rank, scaled per token
  (its bytes are linear in tokens). The measured counters must equal the closed forms
  (``layers.cp.accounting.state_scan_comm``); the script fails otherwise.
* Beyond: the closed forms, and an alpha-beta-gamma model of the forward time (documented constants
  ALPHA, BETA, GAMMA below; the backward is the same scan in reverse, so fwd + bwd = 2 x forward).
* megatron-core's own GatedDeltaNet (0.18+: ``megatron.core.ssm.gated_delta_net``) beside them: its CP is one
  all-to-all of the whole in-projection output (q, k, v, the output gate z, beta, alpha) from sequence to heads
  and one of the normed output back, in both directions; it needs P | H and P | HV at TP = 1 (n/a otherwise:
  its config refuses). Measured (``--measure-mcore``, default 2 and 4): their layer's forward and backward on
  gloo ranks with FLA's kernels through Triton's interpreter, at small head counts, every
  ``all_to_all_single`` counted as ``layers.cp.collectives`` counts ours ((P-1)/P of the buffer each way);
  the counts per token must equal the closed form; the table scales the closed form.
  :func:`refusal_markdown` lists the TP x CP layouts of Qwen3-Next-80B-A3B (16 key heads, 32 value heads)
  that their CP refuses and ours runs.

Usage: ``python benchmarks/cp_comm.py [--measure 2,4] [--measure-mcore 2,4] [--json out.json] [--no-docs]``;
prints JSON and a markdown table, replaces the ``cp_comm`` section of docs/benchmarks.md and writes
docs/cp_comm.png.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks._common import marked_section, spawn_gloo, write_docs_section  # noqa: E402
from layers.cp.accounting import state_scan_comm  # noqa: E402
from layers.cp.cost_model import COLLECTIVES, Calibration, LinearFit, state_exchange_seconds  # noqa: E402

HV, H, K, V = 32, 16, 128, 128
SEQ = 131_072
ACT_BYTES = 2                        # bf16 activations through Ulysses
WORLD_SIZES = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
NODE = 8                             # ranks per node: grouped_allgather_p2p uses g = min(P, NODE)
HYBRID_U = 8                         # hybrid row: Ulysses inside a node, all-gather across nodes

# alpha-beta-gamma model constants (documented in docs/cp.md)
ALPHA = 10e-6                        # s per sequential communication step (inter-node latency + launch)
BETA = 40e9                          # B/s per rank and direction (400 Gb/s NIC at ~80 % efficiency)
GAMMA = 50e12                        # FLOP/s of the fp32 K x K state folds (tf32x3-class tensor-core rate)
MODEL = Calibration(collectives={c: LinearFit(ALPHA, BETA) for c in COLLECTIVES}, fold_flops=GAMMA, key="cp_comm")

STATE_ROWS = ("p2p", "allgather", "grouped_allgather_p2p", "recursive_doubling")


def _group(P):
    return min(P, NODE)


def ulysses_token_bytes_fwd() -> int:
    """Bytes per token through the two forward all-to-alls: q, k [H*K], v [HV*V], g, beta [HV] in; o out."""
    return (2 * H * K + HV * V + 2 * HV) * ACT_BYTES + HV * V * ACT_BYTES


def mcore_token_elems_fwd(h=H, hv=HV, k=K, v=V) -> int:
    """Elements per token through megatron-core GDN's two forward all-to-alls: its whole in-projection output
    q, k [H*K], v, z [HV*V], beta, alpha [HV] in; the normed output [HV*V] back."""
    return (2 * h * k + 2 * hv * v + 2 * hv) + hv * v


# -- measurement on gloo ------------------------------------------------------------------------------------
def _worker(rank, P):
    from layers.cp import ChainScan, build_cp_context, heads_to_seq, seq_to_heads, shard

    out = {}
    for layout in ("zigzag", "contiguous"):
        for method in STATE_ROWS:
            g = _group(P) if method == "grouped_allgather_p2p" else None
            ctx = build_cp_context(None, method=method, layout=layout, group_size=g)
            plan = ctx.plan_for(1, 2 * P if layout == "zigzag" else P)    # T tiny: bytes need no T
            gen = torch.Generator().manual_seed(rank)
            M = (torch.randn(1, plan.n_own, HV, K, K, generator=gen) / K).requires_grad_(True)
            E = torch.randn(1, plan.n_own, HV, K, V, generator=gen).requires_grad_(True)
            ChainScan.apply(M, E, method, plan, ctx.stats, ctx.chain_comm).sum().backward()
            f, b = ctx.stats.records
            out[(layout, method)] = {"forward": (f.bytes_sent, f.bytes_received, f.steps),
                                     "backward": (b.bytes_sent, b.bytes_received, b.steps)}
    # Ulysses (U = P): in-exchange of q, k, v, g, beta and out-exchange of o on T_small tokens
    if H % P == 0:
        ctx = build_cp_context(None, method="ulysses", layout="zigzag")
        T_small = 2 * P * 2
        full = {"q": (H, K), "k": (H, K), "v": (HV, V), "g": (HV,), "beta": (HV,)}
        for _name, tail in full.items():
            x = torch.zeros((1, T_small) + tail, dtype=torch.bfloat16)
            seq_to_heads(shard(x, ctx, 1), ctx)
        o = torch.zeros(1, T_small, HV // P, V, dtype=torch.bfloat16)
        heads_to_seq(o, ctx)
        sent = sum(r.bytes_sent for r in ctx.stats.records)
        out[("ulysses", "per_token")] = sent / (T_small // P)
    return out


def measure(P: int) -> dict:
    return dict(enumerate(spawn_gloo(_worker, P)))


MCORE_SMALL = dict(heads=1, value_heads=2, dim=16, hidden=32)   # per rank at the measured P: heads x P


def _mcore_worker(rank, P):
    """megatron-core's GDN at CP = P (zigzag BSHD, 2P tokens per rank): elements per local token moved by its
    all-to-alls in forward and in backward (bytes over the fp32 element size)."""
    from tests.support import triton_interpreter

    triton_interpreter.enable()   # before megatron-core's GDN imports FLA (see the module docstring)
    import megatron.core.jit
    import torch.distributed as dist

    megatron.core.jit.disable_jit_fuser()   # its torch.compile'd helpers run uncompiled (no CPU compile)
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from hp_megatron.platform import CPU_SAFE_CONFIG, apply_cpu_shims

    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=P)
    apply_cpu_shims(0)
    h, hv, d = MCORE_SMALL["heads"] * P, MCORE_SMALL["value_heads"] * P, MCORE_SMALL["dim"]
    config = TransformerConfig(num_layers=1, hidden_size=MCORE_SMALL["hidden"], num_attention_heads=4,
                               normalization="RMSNorm", activation_func=torch.nn.functional.silu,
                               context_parallel_size=P, linear_num_key_heads=h, linear_num_value_heads=hv,
                               linear_key_head_dim=d, linear_value_head_dim=d, linear_conv_kernel_dim=4,
                               params_dtype=torch.float32, **CPU_SAFE_CONFIG)
    groups = ProcessGroupCollection(tp=parallel_state.get_tensor_model_parallel_group(),
                                    cp=parallel_state.get_context_parallel_group())
    layer = GatedDeltaNet(config, GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm,
                                                          out_proj=RowParallelLinear), 1, pg_collection=groups)
    counted = {"bytes": 0}
    original = dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        counted["bytes"] += (P - 1) * input.numel() * input.element_size() // P
        return original(output, input, *args, **kwargs)

    dist.all_to_all_single = counting
    tokens = 2 * P
    x = torch.randn(tokens, 1, MCORE_SMALL["hidden"], requires_grad=True)
    y, _ = layer(x, None)
    forward = counted["bytes"] / 4 / tokens
    counted["bytes"] = 0
    y.sum().backward()
    backward = counted["bytes"] / 4 / tokens
    dist.all_to_all_single = original
    parallel_state.destroy_model_parallel()
    want = (P - 1) / P * mcore_token_elems_fwd(h, hv, d, d)
    if forward != want or backward != want:
        raise AssertionError(f"megatron-core GDN all-to-alls at P={P}: {forward} / {backward} elements per token "
                             f"forward / backward, closed form {want}")
    return {"forward": forward, "backward": backward, "heads": (h, hv, d)}


def measure_mcore(P: int) -> dict:
    """Their layer's counted elements per token on rank 0 (every rank checked against the closed form)."""
    return spawn_gloo(_mcore_worker, P)[0]


# -- closed forms and model ---------------------------------------------------------------------------------
def state_row(method, layout, P):
    """Per-rank maxima over ranks of bytes received/sent and the steps, forward and backward."""
    g = _group(P) if method == "grouped_allgather_p2p" else None
    row = {}
    for phase in ("forward", "backward"):
        costs = [state_scan_comm(method, layout, P, r, num_chains=1, heads=HV, k_dim=K, v_dim=V, group_size=g,
                                 phase=phase) for r in range(P)]
        row[phase] = {"bytes_received": max(c["bytes_received"] for c in costs),
                      "bytes_sent": max(c["bytes_sent"] for c in costs), "steps": costs[0]["steps"]}
    row["group_size"] = g
    return row


def model_forward_seconds(method, layout, P, row) -> float:
    """The library's alpha-beta-gamma forward time of the state scan (backward is the same) at this script's
    constants: ``layers.cp.cost_model.state_exchange_seconds``."""
    return state_exchange_seconds(method, layout, P, num_chains=1, heads=HV, k_dim=K, v_dim=V, calibration=MODEL,
                                  group_size=row["group_size"])


def ulysses_row(P):
    """Ulysses U = P: two all-to-alls forward (inputs in, output back), two backward."""
    if H % P or HV % P:
        return None
    b = (P - 1) / P * (SEQ // P) * ulysses_token_bytes_fwd()
    return {"forward": {"bytes_received": int(b), "bytes_sent": int(b), "steps": 2},
            "backward": {"bytes_received": int(b), "bytes_sent": int(b), "steps": 2},
            "model_fwd_s": 2 * ALPHA + b / BETA}


def mcore_row(P):
    """megatron-core's GatedDeltaNet CP (TP = 1): two all-to-alls forward, two backward; None where it refuses."""
    if H % P or HV % P:
        return None
    b = (P - 1) / P * (SEQ // P) * mcore_token_elems_fwd() * ACT_BYTES
    return {"forward": {"bytes_received": int(b), "bytes_sent": int(b), "steps": 2},
            "backward": {"bytes_received": int(b), "bytes_sent": int(b), "steps": 2},
            "model_fwd_s": 2 * ALPHA + b / BETA}


def hybrid_row(P):
    """Ulysses(8) inside a node x allgather over the P/8 nodes (the state chain spans P/8 ranks)."""
    U = HYBRID_U
    if P <= U or P % U:
        return None
    Q = P // U
    a2a = (U - 1) / U * (SEQ // P) * ulysses_token_bytes_fwd()
    st = state_row("allgather", "zigzag", Q)
    recv = int(a2a) + st["forward"]["bytes_received"]
    t = 2 * ALPHA + a2a / BETA + model_forward_seconds("allgather", "zigzag", Q, st)
    return {"forward": {"bytes_received": recv, "bytes_sent": recv, "steps": 2 + st["forward"]["steps"]},
            "model_fwd_s": t}


def build_table(measured: dict, measured_mcore=()) -> list[dict]:
    table = []
    for P in WORLD_SIZES:
        entry = {"P": P, "measured": P in measured, "methods": {}}
        for layout in ("zigzag", "contiguous"):
            for method in STATE_ROWS:
                row = state_row(method, layout, P)
                row["model_fwd_s"] = model_forward_seconds(method, layout, P, row)
                if P in measured:
                    _check_measured(measured[P], layout, method, P)
                    row["source"] = "measured (gloo) = closed form"
                else:
                    row["source"] = "closed form"
                entry["methods"][f"{method}/{layout}"] = row
        u = ulysses_row(P)
        if u is not None:
            u["source"] = "measured (gloo), scaled per token" if P in measured else "closed form"
        entry["methods"]["ulysses"] = u
        entry["methods"][f"ulysses{HYBRID_U}_x_allgather"] = hybrid_row(P)
        m = mcore_row(P)
        if m is not None:
            m["source"] = ("closed form = their layer's all-to-alls counted (gloo, scaled per token)"
                           if P in measured_mcore else "closed form")
        entry["methods"]["mcore"] = m
        table.append(entry)
    return table


def _check_measured(meas, layout, method, P):
    """Every rank's measured counters must equal the closed forms."""
    g = _group(P) if method == "grouped_allgather_p2p" else None
    for rank, per_rank in meas["ranks"].items():
        got = per_rank[(layout, method)]
        for phase in ("forward", "backward"):
            want = state_scan_comm(method, layout, P, rank, num_chains=1, heads=HV, k_dim=K, v_dim=V,
                                   group_size=g, phase=phase)
            if got[phase] != (want["bytes_sent"], want["bytes_received"], want["steps"]):
                raise AssertionError(f"measured {got[phase]} != closed form {want} for {method}/{layout} P={P} "
                                     f"rank {rank} {phase}")


# -- output -------------------------------------------------------------------------------------------------
COLUMNS = [("p2p/zigzag", "p2p"), ("allgather/zigzag", "allgather"),
           ("grouped_allgather_p2p/zigzag", "grouped (g=min(P,8))"),
           ("recursive_doubling/zigzag", "recursive doubling"), ("ulysses", "Ulysses (U=P)"),
           (f"ulysses{HYBRID_U}_x_allgather", f"Ulysses({HYBRID_U}) x allgather"),
           ("mcore", "megatron-core GDN (all-to-all)")]


def _cell_bytes(row):
    if row is None:
        return "n/a"
    return f"{row['forward']['bytes_received'] / 2**20:,.0f} / {row['forward']['steps']}"


def _cell_time(row):
    return "n/a" if row is None else f"{2 * row['model_fwd_s'] * 1e3:,.2f}"


REFUSAL_TP, REFUSAL_CP = (1, 2, 4, 8), (2, 4, 8, 16, 32, 64)


def refusal_markdown(h=H, hv=HV, name="Qwen3-Next-80B-A3B") -> str:
    """TP x CP layouts of a GDN with ``h`` key and ``hv`` value heads: which CP runs where. megatron-core's GDN
    needs TP * CP | H and | HV (TransformerConfig check); ours needs TP | H, HV and runs every state method at
    any CP, Ulysses (U = CP) where CP | H/TP, HV/TP and the Ulysses(U) x state hybrids for U | gcd(CP, H/TP)."""
    import math

    def cell(tp, cp):
        theirs = "runs" if h % (tp * cp) == 0 and hv % (tp * cp) == 0 else "**refused**"
        hybrids = [u for u in range(2, cp) if cp % u == 0 and (h // tp) % u == 0 and (hv // tp) % u == 0]
        ulysses = (h // tp) % cp == 0 and (hv // tp) % cp == 0
        return (f"{theirs} / state" + (" + Ulysses" if ulysses else "")
                + (f" + U x state, U = {','.join(map(str, hybrids))}" if hybrids else ""))

    lines = [f"{name} (GDN key heads H = {h}, value heads HV = {hv}): which CP runs at each TP x CP. Cell: "
             "megatron-core's GDN CP (runs / refused) / our CP methods that run (state: p2p, allgather, "
             "grouped_allgather_p2p, recursive_doubling; Ulysses: U = CP; U x state: the hybrids). megatron-core "
             f"caps TP x CP at gcd(H, HV) = {math.gcd(h, hv)}; ours needs TP | H, HV only.", "",
             "| TP \\ CP | " + " | ".join(str(c) for c in REFUSAL_CP) + " |",
             "|---:|" + "---|" * len(REFUSAL_CP)]
    for tp in REFUSAL_TP:
        lines.append(f"| {tp} | " + " | ".join(cell(tp, cp) for cp in REFUSAL_CP) + " |")
    return "\n".join(lines)


def markdown(table) -> str:
    head = "| P | " + " | ".join(name for _, name in COLUMNS) + " |"
    rule = "|---:|" + "---:|" * len(COLUMNS)
    lines = [
        f"GDN/KDA CP exchange per rank per layer: HV={HV}, H={H}, K=V={K}, T={SEQ:,} tokens, one sequence, "
        "zigzag layout, fp32 states, bf16 activations (Ulysses). Rows with P in "
        f"{sorted(r['P'] for r in table if r['measured'])} were measured on gloo ranks with the real code "
        "(`benchmarks/cp_comm.py`; the counters equal the closed forms of docs/cp.md); larger P use the closed "
        "forms. Ulysses needs P | H and P | HV (n/a otherwise); so does megatron-core's own GDN CP (its config "
        "refuses other P), whose column was counted on its real layer at P in "
        f"{sorted(r['P'] for r in table if r['methods']['mcore'] and r['methods']['mcore']['source'] != 'closed form')}"
        " (gloo, FLA's kernels through Triton's interpreter) and equals the closed form: its all-to-alls carry "
        "the whole in-projection output, z included, while our Ulysses exchanges q, k, v, g, beta (the "
        "convolution runs before it on the sequence shards, with a W-1-token halo not counted here) — "
        f"{mcore_token_elems_fwd() / (ulysses_token_bytes_fwd() // ACT_BYTES):.2f}x the bytes.",
        "",
        "**Forward: MiB received per rank (max over ranks) / sequential steps** (the backward pass is the same "
        "scan in reverse with the same counts):",
        "", head, rule]
    for r in table:
        lines.append(f"| {r['P']}{'*' if r['measured'] else ''} | "
                     + " | ".join(_cell_bytes(r["methods"][k]) for k, _ in COLUMNS) + " |")
    lines += ["", f"**Modeled forward + backward exchange time, ms** (alpha = {ALPHA * 1e6:.0f} us per step, "
              f"beta = {BETA / 1e9:.0f} GB/s per rank, gamma = {GAMMA / 1e12:.0f} TFLOP/s for the fp32 "
              "fold matmuls on the critical path; see docs/cp.md):", "", head, rule]
    for r in table:
        lines.append(f"| {r['P']} | " + " | ".join(_cell_time(r["methods"][k]) for k, _ in COLUMNS) + " |")
    lines += ["", "\\* measured. Plot: ![cp comm](cp_comm.png)", "", refusal_markdown()]
    return "\n".join(lines)


def plot(table, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, name in COLUMNS:
        pts = [(r["P"], r["methods"][key]) for r in table if r["methods"][key] is not None]
        Ps = [p for p, _ in pts]
        ax1.plot(Ps, [row["forward"]["bytes_received"] / 2**20 for _, row in pts], marker="o", label=name)
        ax2.plot(Ps, [2 * row["model_fwd_s"] * 1e3 for _, row in pts], marker="o", label=name)
    for ax, title, unit in ((ax1, "received per rank, forward", "MiB"),
                            (ax2, "modeled exchange time, fwd + bwd", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("CP size P")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle(f"GDN/KDA CP exchange, HV={HV}, K=V={K}, T={SEQ:,}, zigzag")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measure", default="2,4", help="comma-separated P to measure on gloo ranks ('' for none)")
    ap.add_argument("--measure-mcore", default="2,4",
                    help="comma-separated P at which megatron-core's GDN is counted on gloo ranks ('' for none)")
    ap.add_argument("--json", default=None, help="also write the JSON table to this path")
    ap.add_argument("--no-docs", action="store_true", help="do not touch docs/benchmarks.md or the plot")
    args = ap.parse_args(argv)
    measured = {}
    for P in [int(p) for p in args.measure.split(",") if p.strip()]:
        ranks = measure(P)
        measured[P] = {"ranks": ranks, "ulysses_per_token": ranks[0].get(("ulysses", "per_token"))}
    measured_mcore = {P: measure_mcore(P) for P in [int(p) for p in args.measure_mcore.split(",") if p.strip()]}
    table = build_table(measured, measured_mcore)
    if measured:
        for P, m in measured.items():
            if m["ulysses_per_token"] is not None and m["ulysses_per_token"] != (P - 1) / P * ulysses_token_bytes_fwd():
                raise AssertionError(f"Ulysses measured {m['ulysses_per_token']} B/token at P={P}, closed form "
                                     f"{(P - 1) / P * ulysses_token_bytes_fwd()}")
    # the Ulysses per-token bytes are measured sent bytes per local token: rescale to the row's closed form
    for r in table:
        u = r["methods"]["ulysses"]
        if u is not None and r["measured"]:
            per = measured[r["P"]]["ulysses_per_token"]
            b = int(per * (SEQ // r["P"]))
            u["forward"]["bytes_received"] = u["forward"]["bytes_sent"] = b
            u["backward"]["bytes_received"] = u["backward"]["bytes_sent"] = b
            u["model_fwd_s"] = 2 * ALPHA + b / BETA
    md = markdown(table)
    payload = {"layer": {"HV": HV, "H": H, "K": K, "V": V, "T": SEQ}, "model": {"alpha_s": ALPHA, "beta_Bps": BETA,
               "gamma_flops": GAMMA}, "rows": table, "mcore_measured": measured_mcore}
    text = json.dumps(payload, indent=1)
    print(text)
    print()
    print(md)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    if not args.no_docs:
        write_docs_section(marked_section("cp_comm", md), os.path.join(ROOT, "docs", "benchmarks.md"),
                           heading="## GDN/KDA context-parallel communication")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("docs/cp_comm.png not redrawn: matplotlib is not installed", file=sys.stderr)
        else:
            plot(table, os.path.join(ROOT, "docs", "cp_comm.png"))


if __name__ == "__main__":
    main()
