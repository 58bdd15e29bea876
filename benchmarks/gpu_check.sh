#!/usr/bin/env bash
# One GPU check of the triton backend (issue 7): GPU tests + benchmarks/gpu_layers.py under one time budget.
#
# Run on the GPU machine from the repository root, carrying the git-ignored wheel folder:
#     run(command="bash benchmarks/gpu_check.sh", carry=[".wheels"], timeout_s=600)
# The machine has no network: wheels in .wheels/ (fla-core, flash-linear-attention 0.6.0, megatron-core
# 0.16.1 cp312, and einops/packaging/numpy/pytest for whatever is missing) are installed with --no-deps into a
# scratch --target that goes first on PYTHONPATH. Everything lands in $OUT (default ./out-gpu):
#   env.txt, summary.txt, tests_single.log, tests_cp.log, tests_cp_cases.jsonl (per CP case, written as they
#   finish), bench_ops.log, bench_layers.log, gpu_layers.json/.md (merged), benchmarks.md (docs with the section). Then, on the dev machine: copy $OUT/benchmarks.md's gpu section into docs/benchmarks.md with
#     python benchmarks/gpu_layers.py --render <files_at>/gpu_layers.json --docs docs/benchmarks.md
#
# Phases (GPU_CHECK_PHASES, default "bench_ops tests_single tests_cp bench_layers") run in that order, so a second
# run can pick up what the first did not reach (each run compiles its kernels afresh on a new machine).
# Budget (GPU_CHECK_BUDGET_S, default 540 s): phases start only while enough time is left; each runs under
# `timeout`. The first call of a Triton kernel with new compile-time constants autotunes for minutes (measured
# on an H200: GDN fwd+bwd 145 s, KDA fwd+bwd 206 s), so the benchmark and the single-rank tests share one shape
# set (H=16, K=V=128, layer flags) and the benchmark runs first. With triton < 3.7.1 on Hopper, FLA (and our
# backend, up front) refuse GDN backward; those rows/tests record the error or skip with the reason.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT="${OUT:-$ROOT/out-gpu}"
mkdir -p "$OUT"
BUDGET="${GPU_CHECK_BUDGET_S:-540}"
T0=$SECONDS
left() { echo $(( BUDGET - (SECONDS - T0) )); }
log() { echo "[gpu_check $(( SECONDS - T0 ))s] $*" | tee -a "$OUT/summary.txt"; }

# ---- 1. wheels -> scratch site (only what is missing, never shadow what the machine has)
SITE=/tmp/hp_gpu_site
mkdir -p "$SITE"
WHEELS="$ROOT/.wheels"
install_wheel() {  # install_wheel <import-name> <wheel-glob>
  if python -c "import $1" 2>/dev/null; then log "have $1: $(python -c "import $1 as m; print(getattr(m, '__version__', '?'))" 2>/dev/null)"; return; fi
  local whl
  whl=$(ls "$WHEELS"/$2 2>/dev/null | head -n1)
  if [ -z "$whl" ]; then log "MISSING $1 and no wheel $2 in $WHEELS"; return; fi
  python -m pip install --quiet --no-deps --no-index --target "$SITE" "$whl" >>"$OUT/summary.txt" 2>&1 \
    && log "installed $(basename "$whl")" || log "FAILED to install $(basename "$whl")"
}
export PYTHONPATH="$SITE:$ROOT:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"
for pair in "numpy numpy-*.whl" "packaging packaging-*.whl" "einops einops-*.whl" "pluggy pluggy-*.whl" \
            "iniconfig iniconfig-*.whl" "pytest pytest-*.whl"; do
  install_wheel $pair
done
# FLA and megatron-core: always the carried versions (FLA 0.6.0 is the API this backend was written against).
# One pip call: fla-core and flash-linear-attention share the top-level package `fla`, and pip --target does not
# merge into an existing directory.
install_together() {  # install_together <wheel-glob>...  (one pip call; --upgrade replaces a previous copy)
  local wheels=() w
  for w in "$@"; do
    if [ -f "$w" ]; then wheels+=("$w"); else log "MISSING wheel $w"; fi
  done
  [ ${#wheels[@]} -gt 0 ] || return
  python -m pip install --quiet --no-deps --no-index --upgrade --target "$SITE" "${wheels[@]}" >>"$OUT/summary.txt" 2>&1 \
    && log "installed ${wheels[*]##*/}" || log "FAILED to install ${wheels[*]##*/}"
}
install_together "$WHEELS"/fla_core-*.whl "$WHEELS"/flash_linear_attention-*.whl
install_together "$WHEELS"/megatron_core-*cp312*.whl

export PYTHONUNBUFFERED=1 FLA_CACHE_RESULTS=1 TRITON_CACHE_DIR=/tmp/hp_triton_cache
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  python - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
      "capability", torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None)
for name in ("triton", "fla", "megatron.core", "einops", "numpy", "pytest", "transformers", "tilelang"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as error:
        print(name, "unavailable:", type(error).__name__, error)
try:
    from layers.ops.backends import get_backend
    get_backend("triton")
    print("backend triton: available")
    from layers.ops.triton.runtime import gdn_backward_blocker
    print("gdn backward blocker:", gdn_backward_blocker(torch.device("cuda", 0)))
except Exception as error:
    print("backend triton: UNAVAILABLE:", error)
EOF
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt" | tee -a "$OUT/summary.txt"

PHASES="${GPU_CHECK_PHASES:-bench_ops tests_single tests_cp bench_layers}"
run_phase() {  # run_phase <name> <min-seconds-needed> <cap-seconds> <command...>
  local name=$1 need=$2 cap=$3; shift 3
  case " $PHASES " in *" $name "*) ;; *) log "SKIP $name: not in GPU_CHECK_PHASES"; return ;; esac
  local remaining; remaining=$(left)
  if [ "$remaining" -lt "$need" ]; then log "SKIP $name: ${remaining}s left, needs ${need}s"; return; fi
  local limit=$(( remaining < cap ? remaining : cap ))
  log "START $name (limit ${limit}s)"
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  log "END $name rc=$rc$( [ $rc -eq 124 ] && echo ' (timed out)')"
  tail -n 25 "$OUT/$name.log" >>"$OUT/summary.txt"
}

# ---- 2. benchmark (a) FLA ops and (b) our ops: compiles the shared shape set
run_phase bench_ops 120 260 python benchmarks/gpu_layers.py --sections ab --budget-s 200 --iters 5 \
  --out "$OUT/ops"
# ---- 3. single-rank GPU tests (same H/K/V flags as the benchmark, plus one variant set)
run_phase tests_single 90 170 python -m pytest tests/test_backend_triton.py -v -rs -p no:cacheprovider \
  -k "not test_cp_matches"
# ---- 4. CP tests: P=4 gloo processes on the one GPU
export HP_GPU_CP_TIMEOUT=140 HP_GPU_CP_LOG="$OUT/tests_cp_cases.jsonl"
run_phase tests_cp 90 160 python -m pytest tests/test_backend_triton.py -v -rs \
  -p no:cacheprovider -k "test_cp_matches"
# ---- 5. benchmark (c) our layers, (d) FLA / megatron-core layers, (e) CP per-rank simulation
run_phase bench_layers 60 400 python benchmarks/gpu_layers.py --sections cde --budget-s $(( $(left) - 30 )) \
  --iters 3 --out "$OUT/layers"

# ---- 6. merge both benchmark JSONs and render the docs section
python - "$OUT" <<'EOF' 2>&1 | tee -a "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
sys.path.insert(0, "benchmarks")
import gpu_layers
reports = [json.loads(p.read_text()) for p in (out / "ops" / "gpu_layers.json", out / "layers" / "gpu_layers.json")
           if p.exists()]
if not reports:
    print("no benchmark results"); sys.exit(0)
merged = {"meta": reports[0]["meta"], "rows": [r for rep in reports for r in rep["rows"]]}
merged["meta"]["command"] = "bash benchmarks/gpu_check.sh (gpu_layers.py --sections ab, then --sections cde)"
gpu_layers.fill_ratios(merged["rows"])
merged["goals"] = gpu_layers.evaluate_goals(merged["rows"])
(out / "gpu_layers.json").write_text(json.dumps(merged, indent=1))
(out / "gpu_layers.md").write_text(gpu_layers.render_markdown(merged))
gpu_layers.write_docs(gpu_layers.render_markdown(merged), Path("docs/benchmarks.md"))
(out / "benchmarks.md").write_text(Path("docs/benchmarks.md").read_text())
print("\n".join(merged["goals"]))
EOF
log "done in $(( SECONDS - T0 ))s"
