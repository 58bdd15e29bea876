"""Bytes per rank per layer moved by MLA context parallelism: our strategies vs Transformer Engine's ring.

Closed forms from ``layers.cp.mla.mla_comm_bytes`` (tests/cp/test_cp_mla.py checks them against the bytes the
layer actually moves on gloo ranks). Ring (``tests.support.mla_layer.ring_comm_bytes``) = TE's P2P ring attention
passing the expanded K/V (heads x (qk + rope + v) values per token) around the CP ring: P-1 hops forward, K/V and dK/dV
backward.

Usage: ``python benchmarks/mla_comm.py [--seq 131072] [--dtype-bytes 2] [--json out.json] [--no-docs]``
prints JSON and a markdown table and replaces the ``mla_comm`` section of docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
from functools import partial
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._common import DOCS, marked_section, write_docs_section  # noqa: E402
from layers.cp.mla import mla_comm_bytes  # noqa: E402
from tests.support.mla_layer import ring_comm_bytes  # noqa: E402

MODELS = {
    # heads, qk_head_dim (no-rope), qk_pos_emb_head_dim, v_head_dim, kv_lora_rank
    "DeepSeek-V3": dict(heads=128, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, kv_lora_rank=512),
    "Kimi-Linear-48B": dict(heads=32, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, kv_lora_rank=512),
}
STRATEGIES = ("latent", "latent_ulysses", "expanded_ulysses", "ring")
WORLD_SIZES = (2, 4, 8, 16, 32, 64)


def rows(seq_len: int, element_size: int) -> list[dict]:
    out = []
    for model, dims in MODELS.items():
        for P in WORLD_SIZES:
            row = {"model": model, "P": P, "tokens_per_rank": seq_len // P}
            for s in STRATEGIES:
                if s in ("latent_ulysses", "expanded_ulysses") and dims["heads"] % P:
                    row[s] = None                                    # needs heads % P == 0
                    continue
                comm_bytes = ring_comm_bytes if s == "ring" else partial(mla_comm_bytes, s)
                b = comm_bytes(world_size=P, tokens_per_rank=seq_len // P, element_size=element_size, **dims)
                row[s] = {"forward": b["forward"], "backward": b["backward"]}
            row["ring_over_latent_fwd"] = row["ring"]["forward"] / row["latent"]["forward"]
            row["ring_over_latent_fwd_bwd"] = (sum(row["ring"].values()) / sum(row["latent"].values()))
            out.append(row)
    return out


def _mib(x) -> str:
    return "n/a" if x is None else f"{(x['forward'] + x['backward']) / 2**20:,.1f}"


def markdown(table: list[dict], seq_len: int, element_size: int) -> str:
    lines = [f"MLA CP communication per rank per layer, forward + backward, MiB (global sequence {seq_len:,} "
             f"tokens, {element_size}-byte elements, TP = 1). Closed forms of `layers.cp.mla.mla_comm_bytes`, "
             "checked against measured bytes on gloo in `tests/cp/test_cp_mla.py`. Ring = Transformer Engine's "
             "P2P ring attention exchanging expanded K/V (`ring_comm_bytes` of `tests/support/mla_layer.py`). n/a: "
             "Ulysses strategies need heads % P == 0.",
             "",
             "| model | P | latent | latent_ulysses | expanded_ulysses | TE ring | ring / latent (fwd) | "
             "ring / latent (fwd+bwd) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in table:
        lines.append(f"| {r['model']} | {r['P']} | {_mib(r['latent'])} | {_mib(r['latent_ulysses'])} | "
                     f"{_mib(r['expanded_ulysses'])} | {_mib(r['ring'])} | {r['ring_over_latent_fwd']:.1f}x | "
                     f"{r['ring_over_latent_fwd_bwd']:.1f}x |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=131072, help="global sequence length (tokens per layer)")
    parser.add_argument("--dtype-bytes", type=int, default=2, help="bytes per element (2 = bf16)")
    parser.add_argument("--json", default=None, help="also write the JSON rows to this file")
    parser.add_argument("--docs", default=str(DOCS))
    parser.add_argument("--no-docs", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    table = rows(args.seq, args.dtype_bytes)
    section = markdown(table, args.seq, args.dtype_bytes)
    print(json.dumps(table, indent=1))
    print(section)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(table, f, indent=1)
    if not args.no_docs:
        write_docs_section(marked_section("mla_comm", section), os.path.normpath(args.docs),
                           heading="## MLA context-parallel communication")
    worst = min(r["ring_over_latent_fwd"] for r in table if r["model"] == "DeepSeek-V3")
    print(f"DeepSeek-V3: the ring moves at least {worst:.1f}x the bytes of the latent strategy (goal >= 10x)")
    return table


if __name__ == "__main__":
    main()
