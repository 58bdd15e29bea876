"""The example trains DeepSeek-V3.2 (DSA layers) from a converted Hugging Face checkpoint: the tiny random
``deepseek_v32`` (``hp_megatron.models.tiny``, vocabulary = the data tokenizer's), converted with
``hp_megatron.convert``, trained by ``pretrain_hybrid.py --hp-hf-config HF_DIR --load CKPT`` on one gloo rank with the
sparse-stage indexer loss on. Its iteration-1 lm loss (before any update) equals transformers' token-mean loss of the
original model on the same first global batch, and the indexer loss is logged beside it."""
import os
import re
import subprocess
import sys

import torch

from tests.example.test_pretrain_hf import GBS, SEQ, _first_batch_reference_loss
from tests.support.models_case import converted_tiny_model
from tests.support.paths import EXAMPLE, REPO, pythonpath


def test_example_trains_deepseek_v32_from_converted_checkpoint(pydoc_data, tmp_path):
    from prepare_data import BPETokenizer

    data = ["--data-path", os.path.join(pydoc_data, "pydoc_text_document"),
            "--tokenizer", os.path.join(pydoc_data, "tokenizer.json")]
    model = converted_tiny_model("deepseek_v32", tmp_path / "hf", tmp_path / "ckpt", seed=3,
                                 vocab_size=BPETokenizer(data[-1]).vocab_size)
    flags = [*data, "--hp-hf-config", str(tmp_path / "hf"), "--load", str(tmp_path / "ckpt"), "--seq-length",
             str(SEQ), "--micro-batch-size", "1", "--global-batch-size", str(GBS), "--train-iters", "2",
             "--no-progress"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           os.path.join(EXAMPLE, "pretrain_hybrid.py"), *flags, "--hp-dsa-indexer-loss-coeff", "0.01",
           "--hp-dsa-indexer-use-sparse-loss"]
    run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": pythonpath(REPO)},
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "loaded release checkpoint" in run.stdout and "hybrid GPT: deepseek_v32 from" in run.stdout, run.stdout
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", run.stdout)]
    indexer = [float(x) for x in re.findall(r"indexer loss: ([0-9.E+-]+)", run.stdout)]
    assert len(losses) == 2 and len(indexer) == 2 and all(v > 0 for v in indexer), run.stdout
    assert all(map(torch.isfinite, torch.tensor(losses + indexer)))
    reference = _first_batch_reference_loss((data, str(tmp_path / "hf"), str(tmp_path / "ckpt"), model))
    assert abs(losses[0] - reference) <= 1e-4 * reference, (losses[0], reference)
