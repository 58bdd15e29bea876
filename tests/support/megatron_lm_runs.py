"""Launches of Megatron-LM's ``pretrain_gpt.py`` (and, on 0.19, ``pretrain_hybrid.py``) with our specs through the
documented launch scripts (``examples/pretrain/megatron_lm/train_*.sh``: torchrun -> pretrain_gpt_hp.py /
pretrain_hybrid_hp.py -> Megatron-LM's ``pretrain``) on CPU/gloo, in the CPU mode of tests/megatron_lm/cpu_mode.py
(its ``site`` folder's ``sitecustomize`` on PYTHONPATH), with tiny dims and docs/usage.md's CPU flags.
:func:`run_script` returns the per-iteration records of tests/megatron_lm/record.py and the log
(:func:`run_megatron_lm_entry` the same for Megatron-LM's unmodified entry script);
:func:`example_first_loss` the first loss of examples/pretrain/pretrain_hybrid.py on the same dims and data;
:func:`launched_once` the test modules' launch-once cache and :func:`cuda_sites` what the launches' CUDA sites
recorded (the ``data`` and ``sites_dir`` fixtures: tests/megatron_lm/conftest.py)."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import tempfile

from hp_megatron.platform import MEGATRON_LM_CPU_FLAGS
from tests.support.paths import EXAMPLE, MEGATRON_LM, REPO, pythonpath

SITE = os.path.join(REPO, "tests", "megatron_lm", "site")
SCRIPTS = os.path.join(EXAMPLE, "megatron_lm")
# docs/usage.md's CPU flags (hp_megatron.platform) and the tiny dims (fp32: DTYPE=fp32 drops the scripts' --bf16).
CPU_FLAGS = list(MEGATRON_LM_CPU_FLAGS)
TINY = ["--num-layers", "4", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
        "--hp-linear-num-key-heads", "4", "--hp-linear-key-head-dim", "8", "--hp-linear-value-head-dim", "8"]
NORM_EPS = ["--norm-epsilon", "1e-6"]  # pretrain_hybrid.py's fixed RMSNorm epsilon (Megatron-LM's default: 1e-5)
SEQ, GBS, ITERS, LR = 32, 2, 3, 1e-2
# No checkpoint: Megatron-LM saves at --exit-interval and after the last iteration whenever --save is set (the
# scripts always set it), ~10 CPU s per run; runs whose saves repeat another run's turn it off (the last flag wins).
NO_SAVE = ["--save", ""]


def run_script(script, dims, workdir, sites_dir, env_vars, extra, tiny=True):
    """One launch of ``script`` (a train_*.sh) with the model ``dims`` (and, with ``tiny``, the tiny dims and norm
    epsilon above; without: the model's flags come from elsewhere, e.g. ``--hp-hf-config``); returns
    (per-iteration records, log text)."""
    env = dict(MEGATRON_LM_PATH=MEGATRON_LM, GPUS="1", TP="1", CP="1", BACKEND="eager", DTYPE="fp32", SEQ=str(SEQ),
               GBS=str(GBS), ITERS=str(ITERS), LR=str(LR), CKPT=os.path.join(workdir, "ckpt"))
    env.update(env_vars)
    env["GPUS"] = str(int(env["TP"]) * int(env["CP"]) * int(env.get("PP", "1")))
    model = [*TINY, *NORM_EPS] if tiny else []
    return _launch(["bash", os.path.join(SCRIPTS, script), *CPU_FLAGS, *model, *dims, *extra], env,
                   workdir, sites_dir, without_fla=env["BACKEND"] == "eager")


def run_megatron_lm_entry(entry, argv, workdir, sites_dir):
    """One single-rank launch of Megatron-LM's own entry script ``entry`` (``pretrain_hybrid.py``), unmodified:
    ``torchrun $MEGATRON_LM/<entry> <CPU flags> <argv>``, without FLA; returns (per-iteration records, log)."""
    env = {"PYTHONPATH": pythonpath(SITE, MEGATRON_LM, REPO), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return _launch(["torchrun", "--nproc-per-node", "1", os.path.join(MEGATRON_LM, entry), *CPU_FLAGS, *argv], env,
                   workdir, sites_dir, without_fla=True)


def _launch(argv, env_vars, workdir, sites_dir, without_fla):
    record_dir = tempfile.mkdtemp(prefix="record", dir=workdir)  # one per run; runs may share a checkpoint
    env = dict(os.environ, PYTHONPATH=pythonpath(SITE, REPO), PET_STANDALONE="1", OMP_NUM_THREADS="1",
               HP_MEGATRON_LM_SITES_DIR=sites_dir, HP_MEGATRON_LM_RECORD_DIR=record_dir)
    env.pop("MEGATRON_LM", None)
    env.update(env_vars)
    if without_fla:  # FLA serves only the triton backend (tests/megatron_lm/without_fla.py)
        env["HP_MEGATRON_LM_WITHOUT_FLA"] = "1"
    done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    with open(os.path.join(record_dir, "train.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f], log


def launched_once(launch):
    """``get(name)``: ``launch(name)``'s result, launched at the first call; a launch that raised makes the later
    calls for that name raise RuntimeError naming it, without launching again (the first caller gets the error
    itself)."""
    done = {}

    def get(name):
        if name not in done:
            try:
                done[name] = launch(name)
            except Exception as err:
                done[name] = err
                raise
        if isinstance(done[name], Exception):
            raise RuntimeError(f"the runs of {name} failed in an earlier test: {str(done[name])[:300]}")
        return done[name]
    return get


def cuda_sites(sites_dir: str) -> tuple[set, set]:
    """(reached, unlisted): the CUDA call sites that the launches writing to ``sites_dir`` met, listed in
    tests/megatron_lm/cpu_mode.py's table or not (each "<path>:<line> <call>")."""
    reached, unlisted = set(), set()
    for path in glob.glob(os.path.join(sites_dir, "sites-*.json")):
        with open(path, encoding="utf-8") as f:
            sites = json.load(f)
        reached.update(sites["reached"])
        unlisted.update(sites["unlisted"])
    return reached, unlisted


def write_data(data_dir: str, out: str) -> dict:
    """The pydoc dataset in ``data_dir`` (vocabulary 512: the ``pydoc_data`` fixture) and its tokenizer written
    as a HF tokenizer directory under ``out``: ``{"DATA": prefix, "TOKENIZER": directory}`` (the launch scripts'
    variables)."""
    import sys

    for path in (EXAMPLE, SCRIPTS):
        if path not in sys.path:
            sys.path.insert(0, path)
    from hf_tokenizer import write_tokenizer_dir
    from prepare_data import DATA_NAME

    return {"DATA": os.path.join(data_dir, DATA_NAME),
            "TOKENIZER": write_tokenizer_dir(os.path.join(data_dir, "tokenizer.json"), os.path.join(out, "hf"))}


def example_first_loss(pattern: str, data: dict, flags) -> float:
    """examples/pretrain/pretrain_hybrid.py's first-iteration lm loss for the layer ``pattern`` (``--hp-layer-pattern``)
    on the launches' dims, data, split and schedule (its ``train`` on one gloo rank of tests/support/dist.py, full
    precision); ``flags``: the model's other flags."""
    return example_first_record(pattern, data, flags)["lm_loss"]


def example_first_record(pattern: str, data: dict, flags) -> dict:
    """The first iteration's record of the run of :func:`example_first_loss` (lm loss, grad norm, MTP losses)."""
    from tests.support.dist import run_distributed

    return run_distributed(_example_first_iteration, 1, example_argv(pattern, data, flags))[0]


def example_records(pattern: str, data: dict, flags) -> list:
    """Every iteration's record of the run of :func:`example_first_loss` (``ITERS`` iterations)."""
    from tests.support.dist import run_distributed

    return run_distributed(_example_iterations, 1, example_argv(pattern, data, flags))[0]


def example_argv(pattern: str, data: dict, flags) -> list:
    """The example's flags for the launches' dims, data, split and schedule, with ``pattern`` and ``flags``."""
    tokenizer_json = os.path.join(os.path.dirname(data["DATA"]), "tokenizer.json")
    return ["--hp-layer-pattern", pattern, "--seq-length", str(SEQ), "--micro-batch-size", "1",
            "--global-batch-size", str(GBS), "--train-iters", str(ITERS), "--eval-interval", "100",
            "--eval-iters", "1", "--lr", str(LR), "--lr-warmup-iters", "0", "--split", "99,1,0",
            "--data-path", data["DATA"], "--tokenizer", tokenizer_json, "--no-progress",
            "--hp-linear-conv-kernel-dim", "4", *TINY, *flags]


def _example_first_iteration(rank, world_size, argv):
    from tests.support.converted_runs import first_iteration

    record = first_iteration(argv)
    assert record["iteration"] == 1, record
    return record


def _example_iterations(rank, world_size, argv):
    from tests.support.converted_runs import example

    pretrain_hybrid = example()
    return pretrain_hybrid.train(pretrain_hybrid.parse_args(list(argv)))
