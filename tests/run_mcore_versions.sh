#!/usr/bin/env bash
# The version matrix: test files under other megatron-core releases than the installed one (CI: the whole suite
# runs on the installed 0.19.x, this script runs MATRIX on 0.16.1). Each version is installed with --no-deps
# into its own --target directory (cached under ${HP_MCORE_CACHE:-/tmp/hp_mcore}) and put first on PYTHONPATH,
# which the tests' child processes keep (tests/support/paths.py: pythonpath); torch etc. come from the
# environment, and Megatron-LM's training code from the checkout of that version (tests/support/paths.py).
#   tests/run_mcore_versions.sh                             # MATRIX on 0.16.1, then on the installed version
#   HP_MCORE_VERSIONS=0.16.1 tests/run_mcore_versions.sh tests/cp/test_data.py   # other test files
#   HP_MCORE_SKIP_INSTALLED=1 ...                           # not again on the installed version (CI)
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${HP_MCORE_CACHE:-/tmp/hp_mcore}"
VERSIONS="${HP_MCORE_VERSIONS:-0.16.1}"
# What differs between 0.16 and 0.19 (layers/base/megatron_compat.py and the tests that skip under 0.19): specs and
# the MoE provider, each compat switch, GDN/KDA layers and their checkpoints, MLA, MLA under CP, megatron-core's
# CP slicing and hybrid CP groups, MTP (conversion, losses, parallel layouts), conversion and generation
# (common.pt checkpoints), the example's MoE/EP and MTP runs and generation from its checkpoint, the in-process
# Megatron-LM 0.16 tests and Megatron-LM core_v0.16.1's pretrain_gpt.py (with MTP), the mixer registry and a toy mixer
# registered from a test module: 245 tests, about 4 minutes on an idle 2-core machine.
MATRIX=(tests/integration/test_specs.py tests/integration/test_config.py tests/integration/test_training_library.py
        tests/integration/test_toy_mixer.py tests/integration/test_mixer_registry.py
        tests/layers/test_megatron_compat.py tests/layers/test_layers_delta.py tests/layers/test_layers_checkpoint.py
        tests/layers/test_mla.py tests/cp/test_cp_mla.py tests/cp/test_cp_plan.py tests/cp/test_data.py
        tests/cp/test_cp_subgroups_hybrid.py tests/models/test_models_mtp.py tests/models/test_models_mtp_parallel.py
        tests/models/test_models_generate.py tests/convert/test_convert_damaged_checkpoint.py
        tests/example/test_pretrain_moe.py tests/example/test_pretrain_mtp.py
        tests/example/test_generate_example_checkpoint.py tests/megatron_lm/test_megatron_lm_launch.py
        tests/megatron_lm/test_megatron_lm_pretrain.py tests/megatron_lm/test_megatron_lm_mtp.py)
TESTS=("$@")
[ ${#TESTS[@]} -eq 0 ] && TESTS=("${MATRIX[@]}")
status=0
for version in $VERSIONS; do
    target="$CACHE/megatron-core-$version"
    if [ ! -d "$target/megatron/core" ]; then  # 0.17+ declares Requires-Python >=3.12 (runs on 3.10/3.11)
        python -m pip install --quiet --no-deps --ignore-requires-python --target "$target" "megatron-core==$version"
    fi
    echo "=== megatron-core $version"
    PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" python -c \
        "import megatron.core; v = megatron.core.__version__; assert v.split('+')[0] == '$version', v"
    PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" python -m pytest -q "${TESTS[@]}" || status=1
done
if [ -z "${HP_MCORE_SKIP_INSTALLED:-}" ]; then   # CI already ran the whole suite on the installed version
    echo "=== megatron-core (installed) $(python -c 'import megatron.core as m; print(m.__version__)')"
    python -m pytest -q "${TESTS[@]}" || status=1
fi
exit $status
