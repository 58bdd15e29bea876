"""Megatron-LM's own ``pretrain_gpt.py`` with our specs, through the documented launch scripts, on CPU/gloo.

Every run is ``bash examples/pretrain/megatron_lm/train_*.sh`` (torchrun -> pretrain_gpt_hp.py -> Megatron-LM's
``pretrain``) with tiny dims and the CPU flags of docs/usage.md, in the CPU mode of tests/megatron_lm/cpu_mode.py
(``sitecustomize`` on PYTHONPATH). Per pattern (KKKM, GGGA): one single-rank reference (3 iterations, evaluation,
torch_dist checkpoint at the end, for KKKM also at iteration 2), CP2 with allgather, p2p, ulysses and auto and TP2
(first iteration each; the CP2 allgather and TP2 runs save their checkpoint at exit, the other CP methods would
save the same shards and save none), and examples/pretrain/pretrain_hybrid.py's training on the same dims and
data (its ``train`` on one gloo rank of tests/support/dist.py, full precision). For KKKM a second run loads the
iteration-2 checkpoint (weights only) and continues (without saving). Needs Megatron-LM's training code:
MEGATRON_LM_PATH, default ../shared/megatron-lm next to the repository.
"""
import os
import re
import sys

import pytest

from tests.support.megatron_lm_runs import NO_SAVE, SEQ, cuda_sites, example_first_loss, launched_once
from tests.support.megatron_lm_runs import run_script as launch
from tests.support.paths import EXAMPLE, megatron_lm_skip

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(EXAMPLE, "megatron_lm")
sys.path.insert(0, HERE)
sys.path.insert(0, EXAMPLE)
sys.path.insert(0, SCRIPTS)


# Megatron-LM core_v0.16.1's training code: tests/megatron_lm/cpu_mode.py lists its CUDA call sites.
SKIP = megatron_lm_skip((0, 16))
pytestmark = pytest.mark.skipif(SKIP is not None, reason=str(SKIP))

PATTERNS = {
    "KKKM": ("train_kimi_linear_like.sh",
             ["--hp-mla-kv-lora-rank", "16", "--hp-mla-qk-head-dim", "8", "--hp-mla-qk-pos-emb-head-dim", "8",
              "--hp-mla-v-head-dim", "8"],
             ["--hp-mla-cp-strategy", "latent", "--hp-mla-rope-type", "none"]),
    "GGGA": ("train_qwen3_next_like.sh",
             ["--kv-channels", "8", "--hp-linear-num-value-heads", "8"],
             ["--num-query-groups", "2", "--rotary-base", "10000000", "--hp-linear-num-value-heads", "8"]),
}
PARALLEL = {"cp2_allgather": {"CP": "2", "CP_METHOD": "allgather"}, "cp2_p2p": {"CP": "2", "CP_METHOD": "p2p"},
            "cp2_ulysses": {"CP": "2", "CP_METHOD": "ulysses"}, "cp2_auto": {"CP": "2", "CP_METHOD": "auto"},
            "tp2": {"TP": "2"}}
SAVING = ("cp2_allgather", "tp2")  # the parallel runs whose checkpoint at exit is not another's repeat


def run_script(pattern, workdir, sites_dir, env_vars, extra):
    """One launch of the pattern's script; returns (per-iteration records, log text)."""
    script, dims, _ = PATTERNS[pattern]
    return launch(script, dims, workdir, sites_dir, env_vars, extra)


@pytest.fixture(scope="module")
def runs(data, sites_dir, tmp_path_factory):
    """``runs(pattern)``: every run of that pattern, launched once per module."""
    return launched_once(lambda pattern: _launch_all(pattern, data, sites_dir, tmp_path_factory))


def _launch_all(pattern, data, sites_dir, tmp_path_factory):
    out = {}
    ref_dir = str(tmp_path_factory.mktemp(f"{pattern}_ref"))
    # reference: 3 iterations, evaluation at 2 (1 batch), checkpoints at 3 and (KKKM, resumed below) at 2
    save_interval = "2" if pattern == "KKKM" else "100"
    out["ref"] = run_script(pattern, ref_dir, sites_dir, {**data, "SAVE_INTERVAL": save_interval},
                            ["--eval-interval", "2", "--eval-iters", "1"])
    for name, env_vars in PARALLEL.items():
        out[name] = run_script(pattern, str(tmp_path_factory.mktemp(f"{pattern}_{name}")), sites_dir,
                               {**data, **env_vars},
                               ["--exit-interval", "1", "--eval-iters", "1", *([] if name in SAVING else NO_SAVE)])
    if pattern == "KKKM":  # the same command again resumes: weights of iteration 2, fresh optimizer and RNG
        out["resumed"] = run_script(pattern, ref_dir, sites_dir, data,
                                    ["--ckpt-step", "2", "--no-load-optim", "--no-load-rng", "--eval-iters", "1",
                                     *NO_SAVE])
    out["hybrid"] = _pretrain_hybrid(pattern, data)
    return out


def _pretrain_hybrid(pattern, data):
    """examples/pretrain/pretrain_hybrid.py's first-iteration lm loss on the same dims, data, split and iterations."""
    return example_first_loss(pattern, data, PATTERNS[pattern][2])


def _rel(a, b):
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("name", list(PARALLEL))
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_parallel_first_iteration_matches_single_rank(runs, pattern, name):
    (ref, _), (got, log) = runs(pattern)["ref"], runs(pattern)[name]
    assert got[0]["iteration"] == 1 and len(got) == 1, got
    assert _rel(got[0]["lm loss"], ref[0]["lm loss"]) <= 1e-5, (got[0], ref[0])
    assert _rel(got[0]["grad_norm"], ref[0]["grad_norm"]) <= 1e-5, (got[0], ref[0])
    size = "context-parallel size: 2" if name.startswith("cp2") else "tensor-model-parallel size: 2"
    assert size in log


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_auto_calibrates_and_logs_its_choice_through_megatron_lm(runs, pattern):
    """``CP_METHOD=auto``: one calibration line, and one decision line per GDN/KDA layer shape with the model's
    ranking and the candidates timed on the layer (the loss equals the single rank's in the test above)."""
    _, log = runs(pattern)["cp2_auto"]
    assert len(re.findall(r"\[hp_megatron cp auto\] calibration \[P=2\|", log)) == 1, log[-3000:]
    kind = {"KKKM": "KDA", "GGGA": "GDN"}[pattern]
    decisions = re.findall(rf"\[hp_megatron cp auto\] {kind} B=1 T={SEQ} .*", log)
    assert len(decisions) == 1 and "runner-up" in decisions[0], log[-3000:]
    assert re.search(r"; timed on the layer: \S+ [0-9.]+, \S+ [0-9.]+, \S+ [0-9.]+ ms -> \S+$", decisions[0])


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_first_iteration_matches_pretrain_hybrid(runs, pattern):
    (ref, _), hybrid = runs(pattern)["ref"], runs(pattern)["hybrid"]
    assert _rel(ref[0]["lm loss"], hybrid) <= 1e-5, (ref[0], hybrid)


def test_reference_run_trains_evaluates_and_saves(runs):
    ref, log = runs("KKKM")["ref"]
    assert [r["iteration"] for r in ref] == [1, 2, 3]
    assert ref[2]["lm loss"] < ref[0]["lm loss"], ref
    assert "validation loss at iteration 2" in log
    assert "successfully saved checkpoint from iteration       2" in log
    assert re.search(r"^\s+load \.+ None$", log, re.M), "common.sh passed --load without a checkpoint"


def test_resumed_run_continues_from_checkpoint(runs):
    (ref, _), (resumed, log) = runs("KKKM")["ref"], runs("KKKM")["resumed"]
    assert "successfully loaded checkpoint" in log and "at iteration 2" in log, log[-3000:]
    assert [r["iteration"] for r in resumed] == [3]
    assert _rel(resumed[0]["lm loss"], ref[2]["lm loss"]) <= 1e-5, (resumed, ref)
    assert _rel(resumed[0]["grad_norm"], ref[2]["grad_norm"]) <= 1e-5, (resumed, ref)


def test_cuda_sites_all_reached_none_unlisted(runs, sites_dir):
    """Every redirected site of cpu_mode.SITES is needed by some run, and no run met an unlisted one."""
    import cpu_mode

    for pattern in PATTERNS:
        runs(pattern)
    reached, unlisted = cuda_sites(sites_dir)
    listed = {f"{p}:{line} {call}" for p, line, call, _ in cpu_mode.SITES[(0, 16)] if not call.startswith("platform:")}
    assert not unlisted
    assert reached == listed, {"listed, never reached": sorted(listed - reached),
                               "reached, not listed": sorted(reached - listed)}
