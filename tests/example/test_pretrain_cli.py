"""The example as a Megatron-LM user meets it: flag checks, error reporting, resume conventions, evaluation.

* Parse-time checks (in process, no model or data built): plausible bad inputs each raise one error naming
  the flag and the value; ``--train-iters 3`` works with Megatron's default ``--lr-warmup-iters 0``;
  ``--help`` shows defaults.
* Checkpoint checks (in process, on a checkpoint the runs below wrote): a truncated shard, a missing
  metadata file and a tracker naming a missing iteration are each named in the error.
* ``torchrun`` runs on 2 gloo ranks (tiny model): a configuration error and a usage error are one line,
  printed once, with a non-zero exit, also when rank 0 is the last rank to fail (it starts late); a first
  ``--save X --load X`` run (CP2, packed documents, evaluation) starts from scratch and prints the header,
  data line, Megatron's validation line and a summary; a resume
  with another ``--train-iters`` warns about the schedule and continues at the next iteration; a resume
  with nothing left to train says so and exits 0.
"""
import os
import re
import subprocess
import sys

import pytest

from tests.support.paths import EXAMPLE, REPO, pythonpath

if EXAMPLE not in sys.path:
    sys.path.insert(0, EXAMPLE)

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
        "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "2", "--no-progress"]


@pytest.fixture(scope="module")
def data_dir(pydoc_data):
    return pydoc_data


def _data(data_dir):
    return ["--data-path", os.path.join(data_dir, "pydoc_text_document"),
            "--tokenizer", os.path.join(data_dir, "tokenizer.json")]


BAD_FLAGS = [  # (flags, world size, text the error must contain)
    (["--hp-layer-pattern", "KKXM"], 1, "--hp-layer-pattern 'KKXM'"),
    (["--context-parallel-size", "2", "--seq-length", "30"], 2, "--seq-length 30 must be divisible by 4"),
    (["--tensor-model-parallel-size", "2"], 3, "world size 3 is not divisible by --tensor-model-parallel-size 2"),
    (["--context-parallel-size", "2", "--hp-cp-method", "grouped_allgather_p2p"], 2, "needs --hp-cp-group-size"),
    (["--context-parallel-size", "2", "--hp-cp-method", "grouped_allgather_p2p", "--hp-cp-group-size", "3"], 2,
     "--hp-cp-group-size 3 must divide"),
    (["--context-parallel-size", "2", "--hp-cp-group-size", "2"], 2, "--hp-cp-group-size is only used by"),
    (["--context-parallel-size", "2", "--hp-cp-ulysses-degree", "3"], 2, "--hp-cp-ulysses-degree 3 must divide"),
    (["--context-parallel-size", "2", "--hp-cp-method", "auto", "--hp-cp-ulysses-degree", "2"], 2,
     "--hp-cp-method auto chooses the group size and Ulysses degree itself"),
    (["--context-parallel-size", "2", "--hp-cp-layout", "contiguous", "--hp-layer-pattern", "GGGA"], 2,
     "--hp-cp-layout contiguous"),
    (["--global-batch-size", "3", "--micro-batch-size", "2"], 1, "--global-batch-size 3 is not divisible"),
    (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2, "--num-layers 3 is not divisible"),
    (["--hidden-size", "96", "--num-attention-heads", "3", "--tensor-model-parallel-size", "2"], 2,
     "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2"),
    (["--lr-warmup-iters", "10", "--train-iters", "5"], 1, "--lr-warmup-iters 10"),
    (["--eval-interval", "5", "--split", "100,0,0"], 1, "needs a validation split"),
    (["--split", "0,10,0"], 1, "leaves no training documents"),
    (["--reset-attention-mask"], 1, "add --reset-position-ids"),
    (["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"], 1, "exclude each other"),
    (["--hp-linear-num-value-heads", "6"], 1, "--hp-linear-num-value-heads 6 must be a multiple"),
    (["--train-iters", "0"], 1, "--train-iters must be positive"),
    (["--data-path", "/nonexistent/x", "--tokenizer", __file__], 1, "no /nonexistent/x.bin"),
    (["--data-path", "/nonexistent/x"], 1, "--data-path needs --tokenizer"),
    (["--save", __file__], 1, "is a file, not a directory"),
]


@pytest.mark.parametrize("flags,world,expected", BAD_FLAGS, ids=[" ".join(f[0]) for f in BAD_FLAGS])
def test_bad_flags_fail_at_parse_time_naming_the_flag(monkeypatch, flags, world, expected):
    from cli import parse_args

    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        parse_args(flags)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_megatron_defaults_and_help(monkeypatch):
    from cli import build_parser, parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    args = parse_args(["--train-iters", "3"])
    assert args.lr_warmup_iters == 0 and args.lr_decay_iters == 3
    text = build_parser().format_help()
    assert "(default: 60)" in text and "(default: cosine)" in text


def test_save_without_psutil_is_refused_before_training(monkeypatch):
    from cli import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil -> ImportError
    with pytest.raises(RuntimeError, match="pip install psutil"):
        parse_args(["--save", "/tmp/unused"])


def test_other_ranks_leave_the_report_to_rank_zero(monkeypatch, capsys):
    """Under torchrun a rank other than 0 waits (to be stopped once rank 0 has reported) and reports only if no
    stop comes; without torchrun it returns at once, silent."""
    import cli

    slept = []
    monkeypatch.setattr(cli.time, "sleep", slept.append)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    cli.leave_report_to_rank_zero("error (rank 1): x\n")
    assert slept == [] and capsys.readouterr().err == ""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    cli.leave_report_to_rank_zero("error (rank 1): x\n")
    assert slept == [cli.REPORT_WAIT_S] and capsys.readouterr().err == "error (rank 1): x\n"


def _torchrun(args, nproc=2, timeout=600, rank0_late_s=None):
    """(exit status, stdout, stderr) of the example under torchrun; ``rank0_late_s``: rank 0 starts that late
    (tests/support/rank0_late.py), so the other ranks reach an error first."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath(REPO))
    script = [os.path.join(EXAMPLE, "pretrain_hybrid.py")]
    if rank0_late_s is not None:
        script = [os.path.join(REPO, "tests", "support", "rank0_late.py"), str(rank0_late_s), *script]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script,
           *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


RANK0_LATE_S = 3.0


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    common = TINY + _data(data_dir) + ["--context-parallel-size", "2", "--hp-layer-pattern", "KM",
                                       "--save", ckpt, "--load", ckpt]
    out = {"ckpt": ckpt}
    # rank 0 last to fail: the other rank must not get it stopped before it reports (cli.leave_report_to_rank_zero)
    out["config_error"] = _torchrun(TINY + _data(data_dir) + ["--context-parallel-size", "2", "--seq-length", "30"],
                                    rank0_late_s=RANK0_LATE_S)
    out["usage_error"] = _torchrun(TINY + ["--hp-cp-method", "nope"], rank0_late_s=RANK0_LATE_S)
    out["first"] = _torchrun(common + ["--train-iters", "2", "--split", "80,20,0", "--eval-interval", "1",
                                       "--eval-iters", "1", "--reset-position-ids", "--reset-attention-mask",
                                       "--eod-mask-loss"])
    out["resume"] = _torchrun(common + ["--train-iters", "3"])
    out["nothing_left"] = _torchrun(common + ["--train-iters", "3"])
    return out


def test_configuration_error_is_one_line_once(runs):
    code, out, err = runs["config_error"]
    assert code != 0
    ours = [line for line in err.splitlines() if line.startswith("error")]
    assert ours == ["error: --seq-length 30 must be divisible by 4 (2 x --context-parallel-size 2, "
                    "--hp-cp-layout zigzag)"], err
    assert "hybrid GPT" not in out and "[rank" not in err  # nothing built, no per-rank traceback


def test_usage_error_is_printed_once(runs):
    code, out, err = runs["usage_error"]
    assert code != 0
    ours = [line for line in err.splitlines() if "pretrain_hybrid.py: error:" in line]
    assert len(ours) == 1 and "--hp-cp-method" in ours[0] and "usage:" not in err, err


def test_first_run_starts_from_scratch_evaluates_and_summarizes(runs):
    code, out, err = runs["first"]
    assert code == 0, err[-3000:]
    assert f"no checkpoint in {runs['ckpt']}" in out
    assert re.search(r"hybrid GPT: 2 layers KM \(pattern KM\).*CP=2.*CP method allgather, Ulysses degree 1", out)
    assert "packed per document (THD)" in out and "tokenizer " in out
    valid = re.findall(r" validation loss at iteration (\d+) \| lm loss value: (\S+) \| lm loss PPL: (\S+) \|", out)
    assert [v[0] for v in valid] == ["1", "2"], out
    for _, loss, ppl in valid:
        assert abs(float(ppl) - 2.718281828 ** float(loss)) <= 1e-4 * float(ppl)
    assert re.search(r"done: 2 iterations in .* tokens/s\), final lm loss \d.*validation lm loss \d.*"
                     r"checkpoint .*iter_0000002", out)
    assert "Transformer Engine and Apex are not installed" not in err


def test_resume_warns_about_schedule_and_continues(runs):
    code, out, err = runs["resume"]
    assert code == 0, err[-3000:]
    assert "loaded checkpoint" in out and "iter_0000002" in out
    assert "WARNING: the flags' LR schedule differs from the checkpoint's (lr_decay_steps 4 -> 6)" in out
    assert re.search(r"iteration\s+3/\s+3", out) and not re.search(r"iteration\s+[12]/", out)


def test_nothing_left_to_train_says_so(runs):
    code, out, err = runs["nothing_left"]
    assert code == 0, err[-3000:]
    assert "nothing to train: the checkpoint" in out and "at iteration 3 and --train-iters is 3" in out
    assert not re.search(r"iteration\s+\d+/", out)


def test_damaged_checkpoints_are_named(runs, tmp_path):
    import shutil

    from checkpointing import TRACKER, find_checkpoint, verify_checkpoint_files

    source = os.path.join(runs["ckpt"], "iter_0000003")
    verify_checkpoint_files(source)
    damaged = str(tmp_path / "iter_0000003")
    shutil.copytree(source, damaged)
    shard = sorted(f for f in os.listdir(damaged) if f.endswith(".distcp"))[0]
    with open(os.path.join(damaged, shard), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(damaged, shard)) // 2)
    with pytest.raises(ValueError, match=f"checkpoint file {re.escape(os.path.join(damaged, shard))} is truncated"):
        verify_checkpoint_files(damaged)
    os.remove(os.path.join(damaged, ".metadata"))
    with pytest.raises(ValueError, match=re.escape(f"no {os.path.join(damaged, '.metadata')}")):
        verify_checkpoint_files(damaged)
    (tmp_path / TRACKER).write_text("7")
    with pytest.raises(ValueError, match="names iteration 7, but .*iter_0000007 does not exist"):
        find_checkpoint(str(tmp_path))
    assert find_checkpoint(str(tmp_path / "missing")) is None


def test_header_tells_the_truth(monkeypatch):
    from cli import parse_args
    from pretrain_hybrid import describe_model

    monkeypatch.setenv("WORLD_SIZE", "4")
    args = parse_args(["--hp-layer-pattern", "AAAM", "--num-layers", "6", "--context-parallel-size", "4"])
    args.data_parallel_size = 1
    header = describe_model(args, 4096, 10, "cpu")
    assert "6 layers AAAMAA (pattern AAAM)" in header and "MLA CP latent" in header
    assert "backend" not in header and "CP method" not in header and "Ulysses" not in header
    args = parse_args(["--hp-layer-pattern", "GA", "--context-parallel-size", "4", "--hp-cp-ulysses-degree", "2",
                       "--hp-cp-method", "grouped_allgather_p2p", "--hp-cp-group-size", "2"])
    args.data_parallel_size = 1
    header = describe_model(args, 4096, 10, "cpu")
    assert ("GDN/KDA: backend eager, CP method grouped_allgather_p2p, Ulysses degree 2, group size 2" in header
            and "MLA" not in header), header
