"""``python -m hp_megatron.generate --load CKPT`` on a checkpoint of examples/pretrain/pretrain_hybrid.py trained
without ``--hp-hf-config`` (a GKMA hybrid from the example's own flags, 2 iterations on one gloo rank): the
command builds the model from the arguments the checkpoint stores, tokenizes with the tokenizer it names, prints
a continuation and exits 0. Independent check: its greedy tokens equal the argmax of the example's own model
(its ``setup``: flags -> config -> model, checkpoint loaded by its ``resume``) run over the whole sequence at every
step (no cache), i.e. the cached decode equals the training forward. A checkpoint that stores neither an HF
config nor model arguments is refused in one line.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.support.dist import run_distributed
from tests.support.paths import EXAMPLE, REPO, pythonpath

PROMPT, NEW_TOKENS = "def ", 8


def _argv(data_dir, ckpt_dir):
    return ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
            "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-2",
            "--lr-decay-style", "constant", "--hp-layer-pattern", "GKMA", "--train-iters", "2",
            "--data-path", os.path.join(data_dir, "pydoc_text_document"),
            "--tokenizer", os.path.join(data_dir, "tokenizer.json"), "--no-progress", "--split", "100,0,0",
            "--save", ckpt_dir, "--load", ckpt_dir]


def _train_and_reference(rank, world_size, data_dir, ckpt_dir):
    """Train 2 iterations into ``ckpt_dir``; then the example's model with that checkpoint loaded and its greedy
    continuation of the prompt, each token the argmax of a full forward over the sequence so far."""
    import torch

    if EXAMPLE not in sys.path:
        sys.path.insert(0, EXAMPLE)
    import pretrain_hybrid

    pretrain_hybrid.train(pretrain_hybrid.parse_args(_argv(data_dir, ckpt_dir)))
    run = pretrain_hybrid.setup(pretrain_hybrid.parse_args(_argv(data_dir, ckpt_dir)))
    assert run.iteration == 2
    model = run.model.module.eval()
    prompt = run.tokenizer.tokenize(PROMPT)
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids = torch.tensor([tokens])
            logits = model(ids, torch.arange(len(tokens))[None], None)
            tokens.append(int(logits[0, -1, :run.tokenizer.vocab_size].argmax()))
    return {"prompt": prompt, "greedy": tokens[len(prompt):], "eod": run.tokenizer.eod}


@pytest.fixture(scope="module")
def trained(pydoc_data, tmp_path_factory):
    """(checkpoint root, the reference worker's result)."""
    ckpt_dir = str(tmp_path_factory.mktemp("ckpt"))
    return ckpt_dir, run_distributed(_train_and_reference, 1, pydoc_data, ckpt_dir)[0]


def test_generate_from_example_checkpoint_equals_training_forward(trained, tmp_path):
    ckpt, reference = trained
    output = str(tmp_path / "out.json")
    cmd = [sys.executable, "-m", "hp_megatron.generate", "--load", ckpt, "--prompt", PROMPT,
           "--max-new-tokens", str(NEW_TOKENS), "--output-json", output]
    env = dict(os.environ, PYTHONPATH=pythonpath(REPO))
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[0] generated (" in run.stdout and "decode:" in run.stdout, run.stdout
    with open(output) as f:
        report = json.load(f)
    assert report["prompts"] == [reference["prompt"]]  # the stored tokenizer
    got, want = report["tokens"][0], reference["greedy"]
    assert got, run.stdout
    assert repr(report["texts"][0]) in run.stdout  # the continuation, decoded by the stored tokenizer
    # a sequence ends early only at the end-of-text id, which the reference then produced at the same step
    assert got == want[:len(got)], (got, want)
    assert len(got) == NEW_TOKENS or got[-1] == reference["eod"], (got, want)


def test_checkpoint_without_model_description_is_refused_in_one_line(trained, tmp_path, capsys):
    import torch
    from megatron.core import dist_checkpointing

    from hp_megatron.checkpoint import find_checkpoint
    from hp_megatron.generate.__main__ import main
    from hp_megatron.training.model_args import MODEL_ARGS_KEY

    source = find_checkpoint(trained[0])
    bare = str(tmp_path / "iter_bare")
    shutil.copytree(source, bare)
    common = dist_checkpointing.load_common_state_dict(bare)
    assert MODEL_ARGS_KEY in common and "hf_config" not in common
    del common[MODEL_ARGS_KEY]
    torch.save(common, os.path.join(bare, "common.pt"))
    capsys.readouterr()
    assert main(["--load", bare, "--prompt-ids", "1,2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stores neither an HF config nor the example's model arguments" in err[0], err
    assert main(["--load", bare, "--prompt-ids", "1,2", "--use-checkpoint-args"]) == 2
    assert "stores no model arguments" in capsys.readouterr().err
