"""The example trains from a converted Hugging Face checkpoint: a tiny random Qwen3-Next built by transformers
(``hp_megatron.models.tiny``, vocabulary = the data tokenizer's), converted with ``hp_megatron.convert``
(``release`` checkpoint), trained by ``pretrain_hybrid.py --hp-hf-config HF_DIR --load CKPT`` on one gloo rank.
Its iteration-1 lm loss (before any update) must equal transformers' token-mean loss of the original model on the
same first global batch of megatron-core's GPTDataset. Also: ``--hp-hf-config`` refuses model flags that
contradict the HF config, at parse time."""
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.support.models_case import converted_tiny_model
from tests.support.paths import EXAMPLE, REPO, pythonpath

if EXAMPLE not in sys.path:
    sys.path.insert(0, EXAMPLE)

ARCH, SEQ, GBS = "qwen3_next", 32, 2


@pytest.fixture(scope="module")
def converted(pydoc_data, tmp_path_factory):
    """(data flags, HF directory, converted checkpoint root, the transformers model)."""
    from prepare_data import BPETokenizer

    root = tmp_path_factory.mktemp("pretrain_hf")
    data = ["--data-path", os.path.join(pydoc_data, "pydoc_text_document"),
            "--tokenizer", os.path.join(pydoc_data, "tokenizer.json")]
    vocab = BPETokenizer(data[-1]).vocab_size
    model = converted_tiny_model(ARCH, root / "hf", root / "ckpt", seed=3, vocab_size=vocab)
    return data, str(root / "hf"), str(root / "ckpt"), model


def _flags(converted):
    data, hf_dir, ckpt, _ = converted
    return [*data, "--hp-hf-config", hf_dir, "--load", ckpt, "--seq-length", str(SEQ), "--micro-batch-size", "1",
            "--global-batch-size", str(GBS), "--train-iters", "2", "--no-progress"]


def _first_batch_reference_loss(converted):
    """transformers' mean next-token loss over the example's first global batch (samples 0..GBS-1)."""
    import pretrain_hybrid
    from prepare_data import BPETokenizer
    from pretrain_hybrid import build_datasets

    args = pretrain_hybrid.parse_args(_flags(converted))
    train, _ = build_datasets(args, BPETokenizer(args.tokenizer))
    samples = [train[i] for i in range(GBS)]
    tokens = torch.stack([torch.as_tensor(s["tokens"]) for s in samples]).long()
    labels = torch.stack([torch.as_tensor(s["labels"]) for s in samples]).long()
    mask = torch.stack([torch.as_tensor(s["loss_mask"]) for s in samples]).double()
    with torch.no_grad():
        logits = converted[3](input_ids=tokens).logits.double()
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    return float((per_token * mask.flatten()).sum() / mask.sum())


def test_example_starts_from_converted_checkpoint_with_transformers_loss(converted):
    env = {**os.environ, "PYTHONPATH": pythonpath(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           os.path.join(EXAMPLE, "pretrain_hybrid.py"), *_flags(converted)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "loaded release checkpoint" in run.stdout and f"hybrid GPT: {ARCH} from" in run.stdout, run.stdout
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", run.stdout)]
    assert len(losses) == 2 and all(map(torch.isfinite, torch.tensor(losses))), run.stdout
    reference = _first_batch_reference_loss(converted)
    assert abs(losses[0] - reference) <= 1e-4 * reference, (losses[0], reference)


def test_hf_config_refuses_conflicting_model_flags(converted):
    import pretrain_hybrid

    flags = _flags(converted)
    args = pretrain_hybrid.parse_args(flags + ["--hidden-size", "32", "--hp-linear-key-head-dim", "8"])
    assert (args.hidden_size, args.num_layers, args.hp_layer_pattern, args.num_experts) == (32, 4, "GGAA", 4)
    with pytest.raises(ValueError, match=r"--hidden-size 64 conflicts with --hp-hf-config .*hidden_size 32"):
        pretrain_hybrid.parse_args(flags + ["--hidden-size", "64"])
    with pytest.raises(ValueError, match=r"--hp-layer-pattern KKKM conflicts with .*hp_layer_pattern GGAA"):
        pretrain_hybrid.parse_args(flags + ["--hp-layer-pattern", "KKKM"])
    with pytest.raises(ValueError, match=r"--hp-mla-kv-lora-rank 16 conflicts with .*kv_lora_rank None"):
        pretrain_hybrid.parse_args(flags + ["--hp-mla-kv-lora-rank=16"])
