"""examples/pretrain/pretrain_hybrid.py end to end on gloo ranks (tiny model, few iterations).

* The first iteration's loss and gradient norm under TP2 x CP2 equal the single-rank run (relative 1e-4)
  for every CP method of the GDN/KDA layers (MLA and attention layers in the same model).
* Saved under TP2 x CP2 after iteration 2 and resumed under TP1, iteration 3's loss equals an
  uninterrupted single-rank run's.
Two spawns: one with 4 ranks (all TP2 x CP2 runs; each method's result is streamed, so a method that
fails or times out fails its own test only), one with 1 rank (reference, resume).
"""
import os
import sys

import pytest

from tests.support.dist import DistributedTestError, case_result, case_started, run_distributed, run_distributed_cases
from tests.support.paths import EXAMPLE

CP_METHODS = ("allgather", "p2p", "grouped_allgather_p2p", "recursive_doubling", "ulysses")
PATTERN = "GKMA"


def _argv(data_dir, extra):
    return ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
            "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-2",
            "--lr-warmup-iters", "0", "--lr-decay-style", "constant", "--hp-layer-pattern", PATTERN,
            "--data-path", os.path.join(data_dir, "pydoc_text_document"),
            "--tokenizer", os.path.join(data_dir, "tokenizer.json"), "--no-progress",
            "--split", "100,0,0", *extra]  # no validation part: these runs compare training only


def _train(argv):
    if EXAMPLE not in sys.path:
        sys.path.insert(0, EXAMPLE)
    import pretrain_hybrid

    return pretrain_hybrid.train(pretrain_hybrid.parse_args(argv))


def _parallel_worker(rank, world_size, data_dir, ckpt_dir):
    out = {}
    tp_cp = ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2"]
    for method in CP_METHODS:
        case_started(method)
        extra = ["--hp-cp-group-size", "2"] if method == "grouped_allgather_p2p" else []
        out[method] = _train(_argv(data_dir, tp_cp + ["--train-iters", "1", "--hp-cp-method", method] + extra))[0]
        case_result(method, out[method])  # kept if a later method fails the spawn
    case_started("save")
    out["saved"] = _train(_argv(data_dir, tp_cp + ["--train-iters", "3", "--exit-interval", "2",
                                                   "--save", ckpt_dir, "--save-interval", "2"]))
    return out


def _single_worker(rank, world_size, data_dir, ckpt_dir):
    full = _train(_argv(data_dir, ["--train-iters", "3"]))
    resumed = _train(_argv(data_dir, ["--train-iters", "3", "--load", ckpt_dir]))
    return {"full": full, "resumed": resumed}


@pytest.fixture(scope="module")
def runs(pydoc_data, tmp_path_factory):
    """(parallel case reader, single-rank results); the 4-rank spawn runs first (it writes the checkpoint)."""
    data_dir = pydoc_data
    ckpt_dir = str(tmp_path_factory.mktemp("ckpt"))

    def parallel(key):  # the last rank's result (last PP stage, logs)
        return run_distributed_cases(_parallel_worker, 4, key, data_dir, ckpt_dir)[-1]

    try:
        parallel("saved")
    except (DistributedTestError, KeyError):
        pass  # each test reports what it misses
    single = run_distributed(_single_worker, 1, data_dir, ckpt_dir)[0]
    return parallel, single


def _rel(a, b):
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("method", CP_METHODS)
def test_first_iteration_matches_single_rank(runs, method):
    parallel, single = runs
    ref, got = single["full"][0], parallel(method)
    assert got["iteration"] == 1
    assert _rel(got["lm_loss"], ref["lm_loss"]) <= 1e-4, (got, ref)
    assert _rel(got["grad_norm"], ref["grad_norm"]) <= 1e-4, (got, ref)


def test_resume_under_other_layout_continues_exactly(runs):
    parallel, single = runs
    saved, resumed, full = parallel("saved"), single["resumed"], single["full"]
    assert [h["iteration"] for h in saved] == [1, 2]
    assert [h["iteration"] for h in resumed] == [3]
    for a, b in zip(saved, full[:2]):
        assert _rel(a["lm_loss"], b["lm_loss"]) <= 1e-4
    assert _rel(resumed[0]["lm_loss"], full[2]["lm_loss"]) <= 1e-5, (resumed, full)
    assert _rel(resumed[0]["grad_norm"], full[2]["grad_norm"]) <= 1e-4, (resumed, full)
