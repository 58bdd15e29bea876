"""examples/pretrain/pretrain_hybrid.py as a new user runs it: ``--eval-interval N`` alone evaluates (the
default ``--split`` is Megatron-LM's 969,30,1, which has a validation part), and the closing line's throughput is
the tokens over the time spent in the training iterations, as Megatron-LM reports it (not over a run that
includes start-up, evaluation and checkpoint saves)."""
import os
import re
import subprocess
import sys

import pytest

from tests.support.paths import EXAMPLE, REPO, pythonpath

if EXAMPLE not in sys.path:
    sys.path.insert(0, EXAMPLE)
GBS, SEQ, ITERS = 2, 32, 3


@pytest.fixture(scope="module")
def run(pydoc_data):
    data = pydoc_data
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
            "--seq-length", str(SEQ), "--micro-batch-size", "1", "--global-batch-size", str(GBS), "--no-progress",
            "--hp-layer-pattern", "KM", "--train-iters", str(ITERS), "--eval-interval", "2", "--eval-iters", "1",
            "--data-path", os.path.join(data, "pydoc_text_document"),
            "--tokenizer", os.path.join(data, "tokenizer.json")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           os.path.join(EXAMPLE, "pretrain_hybrid.py"), *argv]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    return proc.returncode, proc.stdout, proc.stderr


def test_eval_interval_alone_evaluates_on_the_default_split(run):
    from cli import parse_args

    assert parse_args([]).split == "969,30,1"
    code, out, err = run
    assert code == 0, err[-3000:]
    assert "--split 969,30,1" in out
    valid = re.findall(r" validation loss at iteration (\d+) \| lm loss value: ", out)
    assert valid == ["2", "3"], out  # every 2 iterations and at the end


def test_summary_throughput_counts_the_training_iterations(run):
    code, out, err = run
    assert code == 0, err[-3000:]
    per_iteration_ms = [float(ms) for ms in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", out)]
    assert len(per_iteration_ms) == ITERS, out
    summary = re.search(r"done: (\d+) iterations in ([0-9.]+) s of forward, backward and optimizer steps "
                        r"\((\d+) tokens/s\), final lm loss \S+, validation lm loss \S+; start-up, evaluation and "
                        r"checkpoints ([0-9.]+) s more", out)
    assert summary, out[-2000:]
    iterations, seconds, tokens_per_s, other = (int(summary[1]), float(summary[2]), int(summary[3]),
                                                float(summary[4]))
    train_s = sum(per_iteration_ms) / 1000
    assert iterations == ITERS and abs(seconds - train_s) <= 0.05 + 1e-3 * train_s
    expected = ITERS * GBS * SEQ / train_s
    rounding = ITERS * 0.05e-3 / train_s   # the logged times are rounded to 0.1 ms: a relative bound on train_s
    assert abs(tokens_per_s - expected) <= 1 + (rounding + 1e-3) * expected, (tokens_per_s, expected)
    assert other > 0  # start-up (model, data) and the two evaluations are reported apart
