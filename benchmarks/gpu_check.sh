#!/usr/bin/env bash
# One GPU check of the triton backend (issue 7): GPU tests + benchmarks/gpu_layers.py under one time budget.
#
# Four-call protocol (docs/backends.md "GPU check"; prepare first, HERE: `bash benchmarks/gpu_prepare.sh`).
# The GPU machine has no network and torch's triton 3.6.0, which FLA refuses for GDN backward on Hopper; the
# triton 3.7.1 wheel (~198 MB) is carried in four parts, one per call (a call carries at most 64 MiB):
#   GPU_CHECK_PART=1|2|3  copy .wheels/gpu/callN/* to $CARRY (/tmp/hp_gpu_carry, outside the tree; /tmp survives
#                         while the machine stays warm, i.e. when the next call follows within ~30 s) and exit;
#   GPU_CHECK_PART=4      copy call4, join the parts, check the sha256 from MANIFEST, `pip install --no-deps
#                         --target $SITE` the triton wheel and the other carried wheels ($SITE first on
#                         PYTHONPATH), check `triton.__version__ == 3.7.1`, then run the phases below.
#   unset                 one-call mode: install what is missing from .wheels/ and use the machine's triton.
# GPU_CHECK_DRY=1 (CPU dry run of the script logic): no pip installs, no version requirement.
#
# Results: the device tool returns at most 8 files, so everything is written to $GPU_CHECK_WORK (/tmp/hp_gpu_work)
# and after every phase $OUT (default ./out-gpu) gets summary.txt, results.tar.gz (the whole work folder: env.txt,
# <phase>.log, example_<pattern>.log, tests_cp<P>_cases.jsonl, ops|layers|cp/gpu_layers.json, profile/profile.json,
# gpu_layers.json, benchmarks.md) and triton_autotune.tar.gz (Triton's autotune results; put it at
# .wheels/gpu/triton_autotune.tar.gz before the next gpu_prepare.sh and a check on the same triton/FLA/GPU skips
# autotuning). On the dev machine afterwards, from the unpacked results.tar.gz:
#     python benchmarks/gpu_layers.py --render gpu_layers.json --docs docs/benchmarks.md
#     python benchmarks/gpu_profile.py --render profile/profile.json --docs docs/benchmarks.md
#
# Phases (GPU_CHECK_PHASES, default all, in this order; most valuable evidence first):
#   warm           side by side: gpu_layers.py --warm gdn | kda | cp fill the shared TRITON_CACHE_DIR (the first
#                  call with new compile-time constants autotunes for minutes: H200, triton 3.6: GDN fwd+bwd 145 s,
#                  KDA 206 s; later processes load the results from disk), the example for 20 iterations with
#                  patterns KKKM and GGGA (bf16, --hp-backend triton, the benchmark's linear-attention heads) and
#                  the single-rank GPU tests (layer flags, conv, GDN guard)
#   bench_ops      gpu_layers.py sections a, b (FLA's ops vs ours)
#   profile        gpu_profile.py: FLA's ops vs ours in interleaved windows, and their kernels under torch.profiler
#   bench_layers   gpu_layers.py sections c, d (our layers, FLA's and megatron-core's)
#   bench_cp       gpu_layers.py section e (CP per-rank cost, P = 8, 4, 2)
#   tests_cp2      CP tests with P=2 gloo processes on the GPU; tests_cp4 the same with P=4, as time allows
# Budget (GPU_CHECK_BUDGET_S, default 520 s from the start of the script): a phase starts only while its
# minimum is left and runs under `timeout` with its cap. Give the call timeout_s=590.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PART="${GPU_CHECK_PART:-}"
DRY="${GPU_CHECK_DRY:-0}"
CARRY="${GPU_CHECK_CARRY:-/tmp/hp_gpu_carry}"
SITE="${GPU_CHECK_SITE:-/tmp/hp_gpu_site}"
TRITON_WANT=3.7.1
T0=$SECONDS

# ---- 0. calls 1-3: stash this call's part outside the tree and leave
case "$PART" in
  1|2|3)
    src="$ROOT/.wheels/gpu/call$PART"
    if [ ! -d "$src" ]; then echo "GPU_CHECK_PART=$PART: $src was not carried (carry=[\".wheels/gpu/call$PART\"])" >&2; exit 1; fi
    mkdir -p "$CARRY" && cp -f "$src"/* "$CARRY"/ || exit 1
    echo "call $PART: $CARRY now holds:"; ls -l "$CARRY"; df -h /tmp | tail -n1
    exit 0 ;;
  ""|4) ;;
  *) echo "GPU_CHECK_PART must be 1, 2, 3, 4 or unset, got '$PART'" >&2; exit 2 ;;
esac

# The device tool returns at most 8 files from $OUT: every result goes to $WORK, and after each phase $OUT gets
# summary.txt, results.tar.gz (all of $WORK) and triton_autotune.tar.gz, so a kill still leaves the latest snapshot.
RESULTS="${OUT:-$ROOT/out-gpu}"
OUT="${GPU_CHECK_WORK:-/tmp/hp_gpu_work}"
rm -rf "$OUT"
mkdir -p "$OUT" "$SITE" "$RESULTS"
BUDGET="${GPU_CHECK_BUDGET_S:-520}"
left() { echo $(( BUDGET - (SECONDS - T0) )); }
log() { echo "[gpu_check $(( SECONDS - T0 ))s] $*" | tee -a "$OUT/summary.txt"; }
pip_target() {  # pip_target <label> <wheel>...: one pip call into the scratch site
  if [ "$DRY" = 1 ]; then log "DRY: would install $*"; return 0; fi
  local label=$1; shift
  python -m pip install --quiet --no-deps --no-index --no-compile --upgrade --target "$SITE" "$@" >>"$OUT/summary.txt" 2>&1 \
    && log "installed $label" || { log "FAILED to install $label"; return 1; }
}
export PYTHONPATH="$SITE:$ROOT:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"

# ---- 1. wheels -> scratch site
if [ "$PART" = 4 ]; then
  WHEELS="$CARRY"
  mkdir -p "$CARRY"
  if [ -d "$ROOT/.wheels/gpu/call4" ]; then cp -f "$ROOT/.wheels/gpu/call4"/* "$CARRY"/; else log "call4 folder was not carried"; fi
  if [ -f "$CARRY/MANIFEST" ]; then
    name=$(awk '$1 == "wheel" {print $2}' "$CARRY/MANIFEST")
    want=$(awk '$1 == "sha256" {print $2}' "$CARRY/MANIFEST")
    missing=""
    for i in 1 2 3 4; do [ -f "$CARRY/$name.part$i" ] || missing="$missing part$i"; done
    if [ -n "$missing" ]; then
      log "TRITON PARTS MISSING:$missing (the machine went cold between calls?); continuing with the machine's triton"
    else
      cat "$CARRY/$name".part1 "$CARRY/$name".part2 "$CARRY/$name".part3 "$CARRY/$name".part4 >"$CARRY/$name"
      got=$(sha256sum "$CARRY/$name" | cut -d' ' -f1)
      if [ "$got" = "$want" ]; then
        log "joined $name (sha256 ok)"
        pip_target "$name" "$CARRY/$name"
      else
        log "TRITON WHEEL CORRUPT: sha256 $got, MANIFEST says $want; continuing with the machine's triton"
      fi
    fi
  else
    log "no $CARRY/MANIFEST; continuing with the machine's triton"
  fi
else
  WHEELS="$ROOT/.wheels"
fi
# Test/benchmark dependencies only when missing (never shadow what the machine has); numpy is not carried.
for pair in "numpy numpy-*.whl" "packaging packaging-*.whl" "einops einops-*.whl" "pluggy pluggy-*.whl" \
            "iniconfig iniconfig-*.whl" "pytest pytest-*.whl"; do
  set -- $pair
  if python -c "import $1" 2>/dev/null; then continue; fi
  whl=$(ls "$WHEELS"/$2 2>/dev/null | head -n1)
  if [ -z "$whl" ]; then log "MISSING $1 and no wheel $2 in $WHEELS"; else pip_target "$(basename "$whl")" "$whl"; fi
done
# FLA and megatron-core: always the carried versions. One pip call for fla-core + flash-linear-attention (they
# share the top-level package `fla`; pip --target does not merge into an existing directory).
fla=( "$WHEELS"/fla_core-*.whl "$WHEELS"/flash_linear_attention-*.whl )
if [ -f "${fla[0]}" ] && [ -f "${fla[1]}" ]; then pip_target "fla-core + flash-linear-attention" "${fla[@]}"
else log "MISSING fla wheels in $WHEELS"; fi
mcore=$(ls "$WHEELS"/megatron_core-*cp312*.whl 2>/dev/null | head -n1)
if [ -n "$mcore" ]; then pip_target "$(basename "$mcore")" "$mcore"; else log "MISSING megatron-core wheel in $WHEELS"; fi

if [ "$PART" = 4 ] && [ "$DRY" != 1 ]; then
  have=$(python -c "import triton; print(triton.__version__)" 2>&1 | tail -n1)
  if [ "$have" = "$TRITON_WANT" ]; then log "triton $have active (from $SITE)"
  else log "TRITON $TRITON_WANT NOT ACTIVE: import triton gives '$have'; GDN backward stays refused on Hopper"; fi
fi

export PYTHONUNBUFFERED=1 FLA_CACHE_RESULTS=1 TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/hp_triton_cache}"
mkdir -p "$TRITON_CACHE_DIR"
if [ -f "$CARRY/triton_autotune.tar.gz" ] && [ "$PART" = 4 ]; then
  tar xzf "$CARRY/triton_autotune.tar.gz" -C "$TRITON_CACHE_DIR" && log "restored carried autotune results"
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  python - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
      "capability", torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None)
for name in ("triton", "fla", "megatron.core", "einops", "numpy", "pytest", "transformers", "tilelang"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), getattr(module, "__file__", ""))
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
tee -a "$OUT/summary.txt" <"$OUT/env.txt"

save_autotune() {  # Triton's autotune results and a snapshot of $WORK -> $RESULTS, after every phase
  (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' -print0 | tar czf "$RESULTS/triton_autotune.tar.gz" --null -T -) \
    2>/dev/null || true
  cp -f "$OUT/summary.txt" "$RESULTS/summary.txt" 2>/dev/null
  tar czf "$RESULTS/results.tar.gz.tmp" -C "$OUT" . 2>/dev/null && mv -f "$RESULTS/results.tar.gz.tmp" "$RESULTS/results.tar.gz"
}
PHASES="${GPU_CHECK_PHASES:-warm bench_ops profile bench_layers bench_cp tests_cp2 tests_cp4}"
LIMIT=0
start_phase() {  # start_phase <name> <min-seconds-needed> <cap-seconds>: sets LIMIT; false when skipped
  local name=$1 need=$2 cap=$3
  case " $PHASES " in *" $name "*) ;; *) log "SKIP $name: not in GPU_CHECK_PHASES"; return 1 ;; esac
  local remaining; remaining=$(left)
  if [ "$remaining" -lt "$need" ]; then log "SKIP $name: ${remaining}s left, needs ${need}s"; return 1; fi
  LIMIT=$(( remaining < cap ? remaining : cap ))
  log "START $name (limit ${LIMIT}s)"
}
end_phase() {  # end_phase <name> <rc>
  log "END $1 rc=$2$( [ "$2" -eq 124 ] && echo ' (timed out)')"
  tail -n 25 "$OUT/$1.log" >>"$OUT/summary.txt" 2>/dev/null
  save_autotune
}
run_phase() {  # run_phase <name> <min-seconds-needed> <cap-seconds> <command...>
  local name=$1 need=$2 cap=$3; shift 3
  start_phase "$name" "$need" "$cap" || return 0
  timeout --signal=TERM --kill-after=10 "$LIMIT" "$@" >"$OUT/$name.log" 2>&1
  end_phase "$name" $?
}
PYTEST=(python -m pytest tests/backends/test_backend_triton.py -v -rs -p no:cacheprovider)
# The example on one GPU (issue 16): 20 iterations, bf16, triton backend, linear-attention heads of the benchmark
# shapes (H=16, K=V=128, KDA gate as the benchmark's) so its kernels share the autotune cache of the warm phase.
EXAMPLE_ARGS=(--hp-backend triton --bf16 --num-layers 4 --hidden-size 1024 --num-attention-heads 8
  --hp-linear-num-key-heads 16 --hp-linear-key-head-dim 128 --hp-linear-value-head-dim 128
  --hp-kda-lower-bound -5 --hp-kda-safe-gate --seq-length 4096 --micro-batch-size 1 --global-batch-size 4
  --train-iters 20 --lr 1e-3 --no-progress)
example_data() {  # example_data <dir>: the example's default pydoc dataset, built once, copied per run
  if [ ! -f /tmp/hp_example_data/pydoc_text_document.idx ]; then
    python examples/pretrain/prepare_data.py --output-dir /tmp/hp_example_data >"$OUT/example_data.log" 2>&1 || return 1
  fi
  rm -rf "$1" && cp -r /tmp/hp_example_data "$1"
}

# ---- 2. warm: three processes fill the shared TRITON_CACHE_DIR (partial results persist per kernel); the two
#         example runs (KKKM, GGGA; 20 iterations each) and the single-rank tests run beside them
if start_phase warm 60 225; then
  pids=()
  for what in gdn kda cp; do
    timeout --signal=TERM --kill-after=10 "$LIMIT" python benchmarks/gpu_layers.py --warm "$what" --cp-worlds 2 \
      >"$OUT/warm_$what.log" 2>&1 &
    pids+=($!)
  done
  port=29621
  for pattern in KKKM GGGA; do
    if example_data "/tmp/hp_example_$pattern"; then
      timeout --signal=TERM --kill-after=10 "$LIMIT" torchrun --nproc-per-node 1 --master-port $port \
        examples/pretrain/pretrain_hybrid.py "${EXAMPLE_ARGS[@]}" --hp-layer-pattern $pattern \
        --data-path "/tmp/hp_example_$pattern/pydoc_text_document" \
        --tokenizer "/tmp/hp_example_$pattern/tokenizer.json" >"$OUT/example_$pattern.log" 2>&1 &
      pids+=($!)
    else
      log "example data build failed (example_data.log)"
    fi
    port=$(( port + 1 ))
  done
  timeout --signal=TERM --kill-after=10 "$LIMIT" "${PYTEST[@]}" -k "not test_cp_matches and not variants" \
    >"$OUT/tests_single.log" 2>&1 &
  pids+=($!)
  rc=0
  for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
  cat "$OUT"/warm_gdn.log "$OUT"/warm_kda.log "$OUT"/warm_cp.log >"$OUT/warm.log" 2>/dev/null
  for f in example_KKKM example_GGGA tests_single; do
    echo "== $f"; tail -n 6 "$OUT/$f.log" 2>/dev/null
  done >>"$OUT/summary.txt"
  end_phase warm "$rc"
fi
# ---- 3. FLA's ops vs ours, then the interleaved profile of both (the +23% of GDN fwd at B8 T4096)
run_phase bench_ops 45 85 python benchmarks/gpu_layers.py --sections ab --budget-s 65 --iters 10 --out "$OUT/ops"
run_phase profile 30 55 python benchmarks/gpu_profile.py --budget-s 40 --rounds 4 --window-ms 40 --out "$OUT/profile"
# ---- 4. layers: ours, FLA's, megatron-core's; CP per-rank cost (P = 8 first: its goal)
run_phase bench_layers 45 80 python benchmarks/gpu_layers.py --sections cd --budget-s 60 --iters 5 \
  --out "$OUT/layers"
run_phase bench_cp 40 90 python benchmarks/gpu_layers.py --sections e --cp-worlds 8,4,2 \
  --budget-s $(( $(left) - 30 > 10 ? $(left) - 30 : 10 )) --iters 3 --out "$OUT/cp"
# ---- 5. what is left: CP tests with P=2, then P=4 (per-case lines in the jsonl survive a timeout)
HP_GPU_CP_WORLD=2 HP_GPU_CP_TIMEOUT=140 HP_GPU_CP_LOG="$OUT/tests_cp2_cases.jsonl" \
  run_phase tests_cp2 60 160 "${PYTEST[@]}" -k "test_cp_matches"
HP_GPU_CP_WORLD=4 HP_GPU_CP_TIMEOUT=170 HP_GPU_CP_LOG="$OUT/tests_cp4_cases.jsonl" \
  run_phase tests_cp4 90 190 "${PYTEST[@]}" -k "test_cp_matches"

# ---- 8. merge the benchmark JSONs and render the docs section
python - "$OUT" <<'EOF' 2>&1 | tee -a "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
sys.path.insert(0, "benchmarks")
import gpu_layers
reports = [json.loads(p.read_text()) for p in (out / d / "gpu_layers.json" for d in ("ops", "layers", "cp"))
           if p.exists()]
if not reports:
    print("no benchmark results"); sys.exit(0)
merged = {"meta": reports[0]["meta"], "rows": [r for rep in reports for r in rep["rows"]]}
merged["meta"]["command"] = ("GPU_CHECK_PART=4 bash benchmarks/gpu_check.sh (gpu_layers.py --sections ab, "
                             "then cd, then e)")
gpu_layers.fill_ratios(merged["rows"])
merged["goals"] = gpu_layers.evaluate_goals(merged["rows"])
(out / "gpu_layers.json").write_text(json.dumps(merged, indent=1))
(out / "gpu_layers.md").write_text(gpu_layers.render_markdown(merged))
gpu_layers.write_docs(gpu_layers.render_markdown(merged), Path("docs/benchmarks.md"))
(out / "benchmarks.md").write_text(Path("docs/benchmarks.md").read_text())
print("\n".join(merged["goals"]))
EOF
save_autotune
log "done in $(( SECONDS - T0 ))s"
