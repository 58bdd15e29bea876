"""Megatron-LM 0.19's own ``pretrain_gpt.py`` trains the 2026 families from their Hugging Face config and a
converted checkpoint: ``bash examples/pretrain/megatron_lm/train_from_hf_config.sh`` (torchrun -> pretrain_gpt_hp.py
``--hp-hf-config HF_DIR`` -> Megatron-LM's ``pretrain``, ``--load`` of the ``release`` checkpoint that
``hp_megatron.convert`` wrote), on CPU/gloo in the CPU mode of tests/megatron_lm/cpu_mode.py.

Tiny random transformers models of our own (tests/support/converted_runs.py, the pydoc dataset's 512-token
vocabulary): dense Qwen3.5 (``qwen3_5_text``), the released Qwen3.5-MoE VL form (``qwen3_5_moe``: its language
model; the vision tower dropped in the conversion), OLMo-Hybrid (``olmo_hybrid``) and Ling 3.0
(``bailing_hybrid``). Each one-rank launch's first iteration (lm loss and gradient norm, full precision from
tests/megatron_lm/record.py) equals examples/pretrain/pretrain_hybrid.py's from the same checkpoint, data, split
and batch (relative 1e-5: the same model, built by ``hp_megatron.models.preset_gpt_model`` in both); Ling at TP2 x
CP2 + SP (the script's ``--sequence-parallel``; CP: the mixers' default methods) equals its one-rank launch.
A model flag that contradicts the config is refused before anything is built.

Five launches and one example spawn: about 1 minute on an idle 2-core machine (measured in the issue's note).
Skips unless the installed megatron-core is 0.19.x with its Megatron-LM checkout (tests/support/paths.py).
"""
import os
import subprocess
import sys

import pytest

from tests.support.converted_runs import SEQ, example_argv, single_rank_runs, write_converted
from tests.support.megatron_lm_runs import CPU_FLAGS, NO_SAVE, SCRIPTS, SITE, cuda_sites, launched_once, run_script
from tests.support.paths import MEGATRON_LM, REPO, megatron_lm_skip, pythonpath

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # cpu_mode

SKIP = megatron_lm_skip((0, 19))
pytestmark = pytest.mark.skipif(SKIP is not None, reason=str(SKIP))

ARCHS = ("qwen3_5_text", "qwen3_5_moe", "olmo_hybrid", "bailing_hybrid")
GBS = 4   # converted_runs.example_argv's batch: micro-batches of 1, SEQ tokens
SCRIPT = "train_from_hf_config.sh"
# the example's split and one iteration; no evaluation, no save (the converted checkpoint stays as written)
RUN = ["--split", "100,0,0", "--eval-iters", "0", *NO_SAVE]
LAYOUTS = {"bailing_hybrid_tp2_cp2": ("bailing_hybrid", {"TP": "2", "CP": "2"})}


def _rel(a, b):
    return abs(a - b) / abs(b)


@pytest.fixture(scope="module")
def converted(pydoc_data, tmp_path_factory):
    """The root of the converted tiny checkpoints (``<arch>_hf``, ``<arch>_ckpt``) and the example's data link."""
    return write_converted(str(tmp_path_factory.mktemp("hf_config")), pydoc_data, ARCHS)


def _env(root, arch, data, layout=None):
    return {**data, "HF_CONFIG": os.path.join(root, f"{arch}_hf"), "CKPT": os.path.join(root, f"{arch}_ckpt"),
            "SEQ": str(SEQ), "GBS": str(GBS), "ITERS": "1", **(layout or {})}


@pytest.fixture(scope="module")
def launches(converted, data, sites_dir, tmp_path_factory):
    """``launches(name)``: (records, log) of the script for an architecture (one rank) or a ``LAYOUTS`` entry."""
    def launch(name):
        arch, layout = LAYOUTS.get(name, (name, None))
        return run_script(SCRIPT, [], str(tmp_path_factory.mktemp(name)), sites_dir,
                          _env(converted, arch, data, layout), RUN, tiny=False)
    return launched_once(launch)


@pytest.fixture(scope="module")
def example_runs(converted):
    """The example's first iteration of each converted checkpoint, one spawn."""
    return single_rank_runs({arch: example_argv(converted, arch) for arch in ARCHS})


@pytest.mark.parametrize("arch", ARCHS)
def test_pretrain_gpt_from_hf_config_matches_the_example(launches, example_runs, arch):
    (record,), log = launches(arch)
    want = example_runs[arch]
    assert record["iteration"] == 1, record
    assert _rel(record["lm loss"], want["lm_loss"]) <= 1e-5, (record, want)
    assert _rel(record["grad_norm"], want["grad_norm"]) <= 1e-5, (record, want)
    assert "successfully loaded checkpoint from" in log and "at iteration 0" in log, log[-3000:]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_parallel_layout_matches_one_rank(launches, name):
    (ref,), _ = launches(LAYOUTS[name][0])
    (got,), log = launches(name)
    assert _rel(got["lm loss"], ref["lm loss"]) <= 1e-5, (got, ref)
    assert _rel(got["grad_norm"], ref["grad_norm"]) <= 1e-5, (got, ref)
    assert "tensor-model-parallel size: 2" in log and "context-parallel size: 2" in log, log[-3000:]


def test_launches_reach_only_listed_cuda_sites(launches, sites_dir):
    """No launch met an unlisted CUDA site; cpu_mode's MoE sites (which the dense runs of
    test_megatron_lm_019.py do not reach) are all needed here."""
    import cpu_mode

    for name in (*ARCHS, *LAYOUTS):
        launches(name)
    reached, unlisted = cuda_sites(sites_dir)
    assert not unlisted
    moe = {f"{p}:{line} {call}" for p, line, call, _ in cpu_mode.SITES_019_MOE}
    assert moe <= reached, sorted(moe - reached)


def test_a_model_flag_contradicting_the_config_is_refused(converted, data, tmp_path):
    """``--num-layers`` given with another value than config.json's: one ValueError naming both, before any
    model is built."""
    env = dict(os.environ, PYTHONPATH=pythonpath(SITE, REPO), MEGATRON_LM_PATH=MEGATRON_LM, GPUS="1", TP="1",
               CP="1", BACKEND="eager", DTYPE="fp32", OMP_NUM_THREADS="1", PET_STANDALONE="1",
               HP_MEGATRON_LM_SITES_DIR=str(tmp_path), **_env(converted, "olmo_hybrid", data))
    done = subprocess.run(["bash", os.path.join(SCRIPTS, SCRIPT), *CPU_FLAGS, *RUN, "--num-layers", "7"], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "--num-layers 7 conflicts with --hp-hf-config" in done.stdout + done.stderr, done.stderr[-3000:]
