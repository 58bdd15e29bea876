#!/usr/bin/env bash
# Run the spec tests (and optionally more test files) under megatron-core 0.14.0 and 0.15.3 besides the
# installed version. Each version is installed with --no-deps into its own --target directory (cached
# under ${HP_MCORE_CACHE:-/tmp/hp_mcore}) and put first on PYTHONPATH; torch etc. come from the environment.
#   tests/run_mcore_versions.sh                      # tests/integration/test_specs.py on 0.14.0, 0.15.3 and installed
#   tests/run_mcore_versions.sh tests/cp/test_data.py   # other test files
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${HP_MCORE_CACHE:-/tmp/hp_mcore}"
VERSIONS="${HP_MCORE_VERSIONS:-0.14.0 0.15.3}"
TESTS=("$@")
[ ${#TESTS[@]} -eq 0 ] && TESTS=(tests/integration/test_specs.py)
status=0
for version in $VERSIONS; do
    target="$CACHE/megatron-core-$version"
    if [ ! -d "$target/megatron/core" ]; then
        python -m pip install --quiet --no-deps --target "$target" "megatron-core==$version"
    fi
    echo "=== megatron-core $version"
    PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" python -c \
        "import megatron.core, sys; assert megatron.core.__version__ == '$version', megatron.core.__version__"
    PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" python -m pytest -q "${TESTS[@]}" || status=1
done
if [ -z "${HP_MCORE_SKIP_INSTALLED:-}" ]; then   # CI already ran the whole suite on the installed version
    echo "=== megatron-core (installed) $(python -c 'import megatron.core as m; print(m.__version__)')"
    python -m pytest -q "${TESTS[@]}" || status=1
fi
exit $status
