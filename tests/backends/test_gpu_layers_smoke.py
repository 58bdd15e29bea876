"""benchmarks/gpu_layers.py end to end on CPU: every section builds and runs its rows (FLA's ops and layers,
ours, megatron-core's GatedDeltaNet, the CP methods on a fake process group) with FLA's kernels in Triton's
interpreter, tiny dimensions, fp32. Times mean nothing here; what is checked is that no row fails, so a GPU run
spends its device time measuring, not debugging. The run starts when collection ends and runs beside the tests
before this one (tests/support/background.py). Skips without triton 3.7 and FLA."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support import background, triton_interpreter

ROOT = Path(__file__).resolve().parents[2]
REASON = triton_interpreter.available()

# FLA's backend dispatch stays on in this run (FLA_DISABLE_BACKEND_DISPATCH=0, the user's choice that
# layers/ops/triton/runtime.py honours): with it off, torch.compile traces megatron-core's GatedDeltaNet (section d,
# which calls FLA's public functions) into Triton's CPU interpreter and fails on a uint64 fake tensor, an artifact of
# the interpreter; our backend's default (dispatch off) is tested in tests/backends/test_backend_triton_interpreter.py
DRIVER = """
import os, runpy, sys
os.environ["FLA_DISABLE_BACKEND_DISPATCH"] = "0"
sys.path[:0] = [{root!r}]
from tests.support import triton_interpreter
triton_interpreter.enable()
sys.argv = ["gpu_layers.py", *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""
ARGS = ["--device", "cpu", "--dims", "4,16,16,64", "--shapes", "B1T64", "--cp-shape", "B1T64", "--cp-worlds", "4",
        "--iters", "1", "--warmup", "0", "--repeats", "1", "--budget-s", "1200", "--out", "{out}"]
if REASON is None:  # one process on one core: started when collection ends, beside the tests before this one
    background.declare("gpu_layers_smoke", __name__, [sys.executable, "-c", DRIVER.format(
        root=str(ROOT), script=str(ROOT / "benchmarks" / "gpu_layers.py")), *ARGS], ROOT)


@pytest.mark.skipif(REASON is not None, reason=f"gpu_layers smoke run: {REASON or ''}")
def test_every_section_runs_on_cpu():
    code, _, stderr, out = background.result("gpu_layers_smoke", timeout=1500)
    assert code == 0, stderr[-4000:]
    tmp_path = Path(out)
    report = json.loads((tmp_path / "gpu_layers.json").read_text(encoding="utf-8"))
    rows = report["rows"]
    failed = [(r["section"], r["name"], r.get("mode"), r["error"]) for r in rows if "error" in r]
    assert not failed, failed
    names = {(r["section"], r["name"]) for r in rows}
    for op in ("chunk_gated_delta_rule", "chunk_kda"):
        assert ("a", f"fla.{op}") in names and ("b", f"layers.ops.{op}") in names
    assert {n for s, n in names if s == "c"} == {"hp layers.mixers.delta.gdn.GatedDeltaNet",
                                                 "hp layers.mixers.delta.kda.KimiDeltaAttention"}
    assert {n for s, n in names if s == "d"} == {"fla.layers.GatedDeltaNet", "fla.layers.KimiDeltaAttention",
                                                 "megatron.core GatedDeltaNet"}
    cp = {n for s, n in names if s == "e"}
    assert cp == {f"{kind} {m}" for kind in ("gdn", "kda")
                  for m in ("p2p", "allgather", "grouped_allgather_p2p", "recursive_doubling", "ulysses")}
    assert all("ratio_to_ideal" in r and "comm" in r for r in rows if r["section"] == "e")
    assert not any("not measured" in goal for goal in report["goals"]), report["goals"]
