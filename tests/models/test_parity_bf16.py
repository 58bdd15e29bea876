"""RL-grade CP numerics on one small case (``benchmarks/parity.py``, whose full tables are in docs/benchmarks.md): the
tiny Qwen3.5-MoE in bf16 at CP2, BSHD and packed documents, for every CP method of the GDN layers: the per-token
log-prob error against the fp32 single rank (max and mean |delta log p|) is within 1.5x the bf16 single rank's own.
Two spawns (1 rank, 2 ranks)."""
from __future__ import annotations

import os
import sys

from tests.support.paths import REPO

if REPO not in sys.path:
    sys.path.insert(0, REPO)


def test_every_cp_method_bf16_log_probs_within_1p5x_of_one_rank():
    from benchmarks.parity import CP_METHODS, measure

    result = measure("qwen3_5_moe_text", cps=(2,), steps=0, seq=64, generate=False)
    base = {r["layout"]: r["vs_fp32"] for r in result["rows"] if r["cp"] == 1}
    assert set(base) == {"bshd", "packed"} and all(b["mean"] > 0 for b in base.values())   # bf16 is not fp32
    rows = [r for r in result["rows"] if r["cp"] == 2]
    assert {(r["method"], r["layout"]) for r in rows} == {(m, layout) for m in CP_METHODS for layout in base}
    for r in rows:
        for stat in ("max", "mean"):
            assert r["vs_fp32"][stat] <= 1.5 * base[r["layout"]][stat], (r, base[r["layout"]])
    with open(os.path.join(REPO, "docs", "benchmarks.md"), encoding="utf-8") as f:   # the full tables are published
        assert "<!-- parity_qwen3_5_moe_text:begin -->" in f.read()
