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

from tests.support.models_case import converted_tiny_model
from tests.support.paths import EXAMPLE, REPO, pythonpath

if EXAMPLE not in sys.path:
    sys.path.insert(0, EXAMPLE)

SEQ, GBS = 32, 2


def _first_batch_reference_loss(flags, hf_model):
    """transformers' mean next-token loss over the example's first global batch (samples 0..GBS-1)."""
    import pretrain_hybrid
    from prepare_data import BPETokenizer
    from pretrain_hybrid import build_datasets

    args = pretrain_hybrid.parse_args(flags)
    train, _ = build_datasets(args, BPETokenizer(args.tokenizer))
    samples = [train[i] for i in range(GBS)]
    tokens = torch.stack([torch.as_tensor(s["tokens"]) for s in samples]).long()
    labels = torch.stack([torch.as_tensor(s["labels"]) for s in samples]).long()
    mask = torch.stack([torch.as_tensor(s["loss_mask"]) for s in samples]).double()
    with torch.no_grad():
        logits = hf_model(input_ids=tokens).logits.double()
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    return float((per_token * mask.flatten()).sum() / mask.sum())


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
    reference = _first_batch_reference_loss(flags, model)
    assert abs(losses[0] - reference) <= 1e-4 * reference, (losses[0], reference)
