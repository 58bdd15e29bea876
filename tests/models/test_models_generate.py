"""Generation through megatron-core's static inference path (``hp_megatron.generate``) against transformers'
``generate``: the tiny random models of ``models_case`` (Qwen3-Next: GDN + attention, Kimi Linear: KDA + MLA,
DeepSeek-V3: MLA with q LoRA; Llama: attention; Qwen3.5 dense and the Qwen3.5-MoE VL checkpoint (text only);
OLMo-Hybrid: GDN with negative eigenvalues + post-norm NoPE attention; Ling 3.0: KDA with full-rank gates + output-gated
MLA, clipped SwiGLU experts) are converted with ``hf_to_mcore`` and loaded the way the command
loads them; three prompts of different lengths in ONE batch give the same 32 greedy tokens (fp32) as
transformers generating each prompt alone (no padding in the reference). Also the command itself (one
subprocess on a converted checkpoint) and its one-line errors for bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.support.models_case import converted_tiny_model
from tests.support.paths import REPO, pythonpath

ARCHS = ("qwen3_next", "kimi_linear", "deepseek_v3", "llama", "qwen3_5_text", "qwen3_5_moe", "olmo_hybrid",
         "bailing_hybrid")
PROMPT_LENGTHS = (3, 7, 12)
NEW_TOKENS = 32


def prompts_for(vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{arch: (transformers model, HF directory, converted checkpoint directory)}, built on first use."""
    made = {}

    def get(arch):
        if arch not in made:
            root = tmp_path_factory.mktemp(arch)
            hf_dir, ckpt = str(root / "hf"), str(root / "ckpt")
            model = converted_tiny_model(arch, hf_dir, ckpt, drop_unmodeled=True)
            model.generation_config.eos_token_id = None  # 32 tokens, no early stop
            made[arch] = (model.eval(), hf_dir, ckpt)
        return made[arch]

    return get


def transformers_greedy(model, prompt) -> list:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_transformers(arch, converted, single_rank):
    from hp_megatron.convert.safetensors_io import load_hf_config
    from hp_megatron.generate import StaticGenerator, sampling_params
    from hp_megatron.generate.model import build_model

    hf_model, hf_dir, ckpt = converted(arch)
    hf_config = load_hf_config(hf_dir)
    model = build_model(hf_config, load=ckpt)
    vocab = hf_config.get("text_config", hf_config)["vocab_size"]   # VL: the language model's
    prompts = prompts_for(vocab)
    generator = StaticGenerator(model, vocab_size=vocab, max_positions=model.max_sequence_length,
                                max_batch_size=4, max_sequence_length=64)
    result = generator.generate(prompts, sampling_params(max_new_tokens=NEW_TOKENS))
    expected = [transformers_greedy(hf_model, p) for p in prompts]
    assert result.tokens == expected
    assert all(len(lp) == NEW_TOKENS and max(lp) <= 0.0 for lp in result.log_probs)
    assert result.prefill_tokens == 3 * min(PROMPT_LENGTHS)
    assert result.decode_tokens == 3 * (max(PROMPT_LENGTHS) + NEW_TOKENS - min(PROMPT_LENGTHS) - 1)


def test_stop_token_ends_each_sequence(converted, single_rank):
    """``stop_id``: each sequence is its unstopped greedy continuation up to and including the first stop token."""
    from hp_megatron.convert.safetensors_io import load_hf_config
    from hp_megatron.generate import StaticGenerator, sampling_params
    from hp_megatron.generate.model import build_model

    _, hf_dir, ckpt = converted("llama")
    hf_config = load_hf_config(hf_dir)
    generator = StaticGenerator(build_model(hf_config, load=ckpt), vocab_size=hf_config["vocab_size"],
                                max_positions=64, max_batch_size=3, max_sequence_length=64)
    prompts, params = prompts_for(hf_config["vocab_size"]), sampling_params(max_new_tokens=12)
    full = generator.generate(prompts, params).tokens
    stop = full[0][2]
    stopped = generator.generate(prompts, params, stop_id=stop)
    expected = [seq[:seq.index(stop) + 1] if stop in seq else seq for seq in full]
    assert stopped.tokens == expected and len(stopped.tokens[0]) <= 3
    assert [len(lp) for lp in stopped.log_probs] == [len(t) for t in expected]


def test_command_generates_and_reports_speed(converted, tmp_path):
    """One run of ``python -m hp_megatron.generate`` on a converted Qwen3-Next: the HF config comes from the
    checkpoint, prompts as token ids; the tokens equal transformers' greedy ones."""
    hf_model, _, ckpt = converted("qwen3_next")
    prompts = prompts_for(hf_model.config.vocab_size, seed=1)
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "hp_megatron.generate", "--load", ckpt, "--max-new-tokens", "8",
           "--output-json", str(out)] + [a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))]
    env = dict(os.environ, PYTHONPATH=pythonpath(REPO))
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["tokens"] == [transformers_greedy(hf_model, p)[:8] for p in prompts]
    lines = run.stdout.splitlines()
    assert sum(line.startswith(f"[{i}] generated (8 tokens)") for i in range(3) for line in lines) == 3
    assert any(line.startswith("prefill: 9 tokens in") and "tokens/s) | decode: " in line for line in lines)


@pytest.mark.parametrize("flags, message", [
    (["--prompt-ids", "1,2", "--prompt-ids", ""], "prompt 1 is empty (0 tokens)"),
    (["--prompt-ids", "1,2,3", "--max-new-tokens", "62"], "exceeds the model's positions (max_position_embeddings) 64"),
    (["--prompt-ids", "1,2,3", "--max-new-tokens", "20", "--inference-max-seq-length", "16"],
     "exceeds the cache's length (--inference-max-seq-length) 16"),
    (["--prompt-ids", "1", "--prompt-ids", "2", "--prompt-ids", "3", "--inference-max-requests", "2"],
     "3 prompts exceed the cache's batch size 2"),
    (["--prompt-ids", "1,99"], "token ids outside the vocabulary [0, 64): [99]"),
    (["--prompt-ids", "1", "--top-k", "5", "--top-p", "0.9"], "not both"),
    (["--prompt", "hello"], "text prompts need a tokenizer"),
])
def test_bad_input_is_one_line_before_any_output(flags, message, converted, capsys):
    """Bad input: exit status 2, one ``error:`` line naming the constraint and values, nothing on stdout."""
    from hp_megatron.generate.__main__ import main

    _, hf_dir, ckpt = converted("deepseek_v3")  # 64 positions
    output = os.path.join(os.path.dirname(ckpt), "bad.json")
    capsys.readouterr()  # the fixture's conversion messages
    assert main(["--hp-hf-config", hf_dir, "--load", ckpt, "--output-json", output] + flags) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], captured.err
    assert not os.path.exists(output)
