#!/usr/bin/env bash
# Prepare the carried files of the four-call GPU check (benchmarks/gpu_check.sh, docs/backends.md "GPU check").
#
# Run HERE, on the dev machine (PyPI reachable), from anywhere:   bash benchmarks/gpu_prepare.sh
# The GPU machine has no network and its torch ships triton 3.6.0, which FLA refuses for GDN backward on Hopper
# (FLA issue #640). The triton 3.7.1 cp312 wheel is ~198 MB, but one device call carries at most 64 MiB, so the
# wheel is split into four parts of at most 50 MB, one per call, next to the other wheels the check installs:
#   .wheels/gpu/call1/ .. call3/  triton parts 1..3
#   .wheels/gpu/call4/  triton part 4, the other wheels (megatron-core, fla-core + flash-linear-attention,
#                       einops, packaging, pluggy, iniconfig, pytest: so call 4 alone still runs the check on
#                       the machine's triton if the parts were lost), MANIFEST (wheel name, sha256 of the wheel
#                       and of every part),
#                       triton_autotune.tar.gz from .wheels/gpu/ or else benchmarks/gpu_cache/ (autotune
#                       results an earlier check wrote to $OUT; same triton/FLA/GPU => no autotuning)
# .wheels/.gitignore ignores everything under .wheels/, so none of this is committed.
# Environment: TRITON_VERSION (3.7.1), PY_VERSION (3.12), PART_BYTES (50000000), WHEELS (.wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
TRITON_VERSION="${TRITON_VERSION:-3.7.1}"
PY_VERSION="${PY_VERSION:-3.12}"
PART_BYTES="${PART_BYTES:-50000000}"
WHEELS="${WHEELS:-.wheels}"
GPU="$WHEELS/gpu"
PARTS=4
CARRY_LIMIT=$(( 64 * 1024 * 1024 ))

[ -f "$WHEELS/.gitignore" ] || { echo "$WHEELS/.gitignore is missing; refusing to put 200 MB next to tracked files" >&2; exit 1; }
if git check-ignore -q "$GPU/call1/x" 2>/dev/null; then :; else
  echo "$GPU is not ignored by git; fix $WHEELS/.gitignore first" >&2; exit 1
fi

mkdir -p "$GPU/download"
tag=${PY_VERSION/./}
wheel=$(ls "$GPU/download"/triton-"$TRITON_VERSION"-cp"$tag"-cp"$tag"-manylinux*x86_64*.whl 2>/dev/null | head -n1 || true)
if [ -z "$wheel" ]; then
  python -m pip download --quiet --no-deps --only-binary=:all: --implementation cp --python-version "$PY_VERSION" \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
    "triton==$TRITON_VERSION" -d "$GPU/download"
  wheel=$(ls "$GPU/download"/triton-"$TRITON_VERSION"-cp"$tag"-cp"$tag"-manylinux*x86_64*.whl | head -n1)
fi
name=$(basename "$wheel")
size=$(stat -c %s "$wheel")
if [ "$size" -gt $(( PARTS * PART_BYTES )) ]; then
  echo "$name is $size bytes; $PARTS parts of $PART_BYTES bytes cannot hold it" >&2; exit 1
fi
python - "$wheel" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:  # a truncated download fails here, not on the GPU machine
    bad = z.testzip()
    assert bad is None, f"corrupt member {bad}"
    assert any(n.endswith("libtriton.so") for n in z.namelist()), "no libtriton.so in the wheel"
EOF

rm -rf "$GPU"/call1 "$GPU"/call2 "$GPU"/call3 "$GPU"/call4 "$GPU"/split
mkdir -p "$GPU/split" "$GPU"/call{1,2,3,4}
split -b "$PART_BYTES" -d -a 1 "$wheel" "$GPU/split/part"
n=$(ls "$GPU/split" | wc -l)
[ "$n" -eq "$PARTS" ] || { echo "expected $PARTS parts, got $n (PART_BYTES=$PART_BYTES)" >&2; exit 1; }
for i in 1 2 3 4; do
  mv "$GPU/split/part$(( i - 1 ))" "$GPU/call$i/$name.part$i"
done
rmdir "$GPU/split"

place() {  # place <call> <wheel-glob>: hard-link (or copy) one wheel into a call folder; a missing one is fatal
  local w
  w=$(ls "$WHEELS"/$2 2>/dev/null | head -n1 || true)
  [ -n "$w" ] || { echo "missing $WHEELS/$2 (needed on the GPU machine)" >&2; exit 1; }
  ln -f "$w" "$GPU/call$1/" 2>/dev/null || cp "$w" "$GPU/call$1/"
}
for w in 'megatron_core-*cp312*.whl' 'fla_core-*.whl' 'flash_linear_attention-*.whl' 'einops-*.whl' \
         'packaging-*.whl' 'pluggy-*.whl' 'iniconfig-*.whl' 'pytest-*.whl'; do
  place 4 "$w"
done
# Autotune results: a newer local one (.wheels/gpu/, from the last check's $OUT) or the committed one of the H200
# check of 2026-11-30 (triton 3.7.1, FLA 0.6.0; Triton ignores entries of other kernels, versions or GPUs).
if [ -f "$GPU/triton_autotune.tar.gz" ]; then cp "$GPU/triton_autotune.tar.gz" "$GPU/call4/"
elif [ -f benchmarks/gpu_cache/h200_triton3.7.1_fla0.6.0.tar.gz ]; then
  cp benchmarks/gpu_cache/h200_triton3.7.1_fla0.6.0.tar.gz "$GPU/call4/triton_autotune.tar.gz"
fi

{
  echo "wheel $name"
  echo "sha256 $(sha256sum "$wheel" | cut -d' ' -f1)"
  echo "bytes $size"
  for i in 1 2 3 4; do echo "part$i $(sha256sum "$GPU/call$i/$name.part$i" | cut -d' ' -f1)"; done
} >"$GPU/call4/MANIFEST"

tree=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
untracked=$(git ls-files -z --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
status=0
for i in 1 2 3 4; do
  bytes=$(du -sb "$GPU/call$i" | cut -f1)
  total=$(( bytes + tree + untracked ))
  printf 'call%d: %9d bytes carried + %d working tree = %d (limit %d)\n' "$i" "$bytes" "$(( tree + untracked ))" "$total" "$CARRY_LIMIT"
  ls -l "$GPU/call$i" | tail -n +2 | awk '{printf "    %10d %s\n", $5, $9}'
  [ "$total" -lt "$CARRY_LIMIT" ] || { echo "call$i exceeds the carry limit" >&2; status=1; }
done
echo "numpy is not carried (16.6 MB does not fit beside a 50 MB part); gpu_check.sh logs it when the GPU machine lacks it"
exit $status
