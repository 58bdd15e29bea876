"""Megatron-LM 0.19's own ``pretrain_gpt.py`` trains the 2026 families from their Hugging Face config and a
converted checkpoint: ``bash examples/pretrain/megatron_lm/train_from_hf_config.sh`` (torchrun -> pretrain_gpt_hp.py
``--hp-hf-config HF_DIR`` -> Megatron-LM's ``pretrain``, ``--load`` of the ``release`` checkpoint that
``hp_megatron.convert`` wrote), on CPU/gloo in the CPU mode of tests/megatron_lm/cpu_mode.py.

Tiny random transformers models of our own (tests/support/converted_runs.py, the pydoc dataset's 512-token
vocabulary cut into documents of 3..20 tokens: tests/support/short_documents.py): dense Qwen3.5
(``qwen3_5_text``), the released Qwen3.5-MoE VL form (``qwen3_5_moe``: its language model; the vision tower
dropped in the conversion), OLMo-Hybrid (``olmo_hybrid``) and Ling 3.0 (``bailing_hybrid``).

* Each one-rank launch's first iteration (lm loss and gradient norm, full precision from tests/megatron_lm/record.py)
  equals examples/pretrain/pretrain_hybrid.py's from the same checkpoint, data, split and batch (relative 1e-5: the
  same model, built by ``hp_megatron.models.preset_gpt_model`` in both).
* Packed documents (``--reset-position-ids --reset-attention-mask --eod-mask-loss --calculate-per-token-loss``:
  our THD rows, examples/pretrain/megatron_lm/hp_packed.py) for Qwen3.5-MoE (VL) and Ling: one rank = the example's
  packed run; Qwen3.5-MoE at CP4 (``p2p``), Ling at TP2 x CP2 + SP (the mixers' default methods) and at CP2
  (``ulysses``) = one rank: the loss to 1e-5, the gradient norm to 1e-4 (measured 2e-5 .. 7e-5, fp32 sums in
  another order: the example's own runs of these layouts give the same norms to 1e-7, and its packed tests,
  tests/example/test_pretrain_qwen3_5.py, use the same bound).

A model flag that contradicts the config is refused before anything is built. Nine launches and one example spawn:
1:55 on an idle 2-core machine.
Skips unless the installed megatron-core is 0.19.x with its Megatron-LM checkout (tests/support/paths.py).
"""
import os
import subprocess
import sys

import pytest

from tests.support.converted_runs import SEQ, example_argv, single_rank_runs, write_converted
from tests.support.megatron_lm_runs import (CPU_FLAGS, NO_SAVE, SCRIPTS, SITE, cuda_sites, launched_once, run_script,
                                            write_data)
from tests.support.paths import MEGATRON_LM, REPO, megatron_lm_skip, pythonpath
from tests.support.short_documents import write_short_documents

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # cpu_mode

SKIP = megatron_lm_skip((0, 19))
pytestmark = pytest.mark.skipif(SKIP is not None, reason=str(SKIP))

ARCHS = ("qwen3_5_text", "qwen3_5_moe", "olmo_hybrid", "bailing_hybrid")
GBS = 4   # converted_runs.example_argv's batch: micro-batches of 1, SEQ tokens
SCRIPT = "train_from_hf_config.sh"
# the example's split and one iteration; no evaluation, no save (the converted checkpoint stays as written)
RUN = ["--split", "100,0,0", "--eval-iters", "0", *NO_SAVE]
# the global token mean (Megatron's default weighs each CP rank by its own loss-token count, unequal here)
PACKED = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss", "--calculate-per-token-loss"]
# one-rank runs: name -> (architecture, flags)
REFERENCES = {**{arch: (arch, []) for arch in ARCHS},
              "qwen3_5_moe_packed": ("qwen3_5_moe", PACKED), "bailing_hybrid_packed": ("bailing_hybrid", PACKED)}
# parallel launches: name -> (its one-rank reference, the launch scripts' layout variables)
LAYOUTS = {"qwen3_5_moe_packed_cp4_p2p": ("qwen3_5_moe_packed", {"CP": "4", "CP_METHOD": "p2p"}),
           "bailing_hybrid_packed_tp2_cp2": ("bailing_hybrid_packed", {"TP": "2", "CP": "2"}),
           "bailing_hybrid_packed_cp2_ulysses": ("bailing_hybrid_packed", {"CP": "2", "CP_METHOD": "ulysses"})}


def _rel(a, b):
    return abs(a - b) / abs(b)


@pytest.fixture(scope="module")
def converted(pydoc_data, tmp_path_factory):
    """The root of the converted tiny checkpoints (``<arch>_hf``, ``<arch>_ckpt``) and the example's data link
    (short documents)."""
    top = tmp_path_factory.mktemp("hf_config")
    short = write_short_documents(pydoc_data, str(top / "short_documents"))
    os.makedirs(top / "run")
    return write_converted(str(top / "run"), short, ARCHS)


@pytest.fixture(scope="module")
def short_data(converted, tmp_path_factory):
    """The launch scripts' ``DATA`` / ``TOKENIZER`` of the short documents."""
    return write_data(os.path.join(converted, "data"), str(tmp_path_factory.mktemp("tokenizer")))


def _env(root, arch, data, layout=None):
    return {**data, "HF_CONFIG": os.path.join(root, f"{arch}_hf"), "CKPT": os.path.join(root, f"{arch}_ckpt"),
            "SEQ": str(SEQ), "GBS": str(GBS), "ITERS": "1", **(layout or {})}


@pytest.fixture(scope="module")
def launches(converted, short_data, sites_dir, tmp_path_factory):
    """``launches(name)``: (records, log) of the script for a ``REFERENCES`` or ``LAYOUTS`` entry."""
    def launch(name):
        reference, layout = LAYOUTS.get(name, (name, None))
        arch, flags = REFERENCES[reference]
        return run_script(SCRIPT, [], str(tmp_path_factory.mktemp(name)), sites_dir,
                          _env(converted, arch, short_data, layout), [*RUN, *flags], tiny=False)
    return launched_once(launch)


@pytest.fixture(scope="module")
def example_runs(converted):
    """The example's first iteration of each reference, one spawn."""
    return single_rank_runs({name: example_argv(converted, arch, *flags)
                             for name, (arch, flags) in REFERENCES.items()})


@pytest.mark.parametrize("name", REFERENCES)
def test_pretrain_gpt_from_hf_config_matches_the_example(launches, example_runs, name):
    (record,), log = launches(name)
    want = example_runs[name]
    assert record["iteration"] == 1, record
    assert _rel(record["lm loss"], want["lm_loss"]) <= 1e-5, (record, want)
    assert _rel(record["grad_norm"], want["grad_norm"]) <= 1e-5, (record, want)
    assert "successfully loaded checkpoint from" in log and "at iteration 0" in log, log[-3000:]


def test_packed_runs_differ_from_unpacked(launches):
    """The packed rows change the loss (the data hold several documents per sample): the packed tests test packing."""
    for arch in ("qwen3_5_moe", "bailing_hybrid"):
        assert _rel(launches(f"{arch}_packed")[0][0]["lm loss"], launches(arch)[0][0]["lm loss"]) > 1e-3


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_parallel_layout_matches_one_rank(launches, name):
    reference, layout = LAYOUTS[name]
    (ref,), _ = launches(reference)
    (got,), log = launches(name)
    assert _rel(got["lm loss"], ref["lm loss"]) <= 1e-5, (got, ref)
    assert _rel(got["grad_norm"], ref["grad_norm"]) <= 1e-4, (got, ref)   # fp32 sums in another order (docstring)
    for flag, size in (("TP", "tensor-model-parallel size"), ("CP", "context-parallel size")):
        assert f"{size}: {layout.get(flag, '1')}" in log, log[-3000:]


def test_launches_reach_only_listed_cuda_sites(launches, sites_dir):
    """No launch met an unlisted CUDA site; cpu_mode's MoE sites (which the dense runs of
    test_megatron_lm_019.py do not reach) are all needed here."""
    import cpu_mode

    for name in (*REFERENCES, *LAYOUTS):
        launches(name)
    reached, unlisted = cuda_sites(sites_dir)
    assert not unlisted
    moe = {f"{p}:{line} {call}" for p, line, call, _ in cpu_mode.SITES_019_MOE}
    assert moe <= reached, sorted(moe - reached)


def test_a_model_flag_contradicting_the_config_is_refused(converted, short_data, tmp_path):
    """``--num-layers`` given with another value than config.json's: one ValueError naming both, before any
    model is built."""
    env = dict(os.environ, PYTHONPATH=pythonpath(SITE, REPO), MEGATRON_LM_PATH=MEGATRON_LM, GPUS="1", TP="1",
               CP="1", BACKEND="eager", DTYPE="fp32", OMP_NUM_THREADS="1", PET_STANDALONE="1",
               HP_MEGATRON_LM_SITES_DIR=str(tmp_path), **_env(converted, "olmo_hybrid", short_data))
    done = subprocess.run(["bash", os.path.join(SCRIPTS, SCRIPT), *CPU_FLAGS, *RUN, "--num-layers", "7"], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "--num-layers 7 conflicts with --hp-hf-config" in done.stdout + done.stderr, done.stderr[-3000:]
