"""Checkpoint conversion speed and memory: a synthetic Llama-shaped HF checkpoint, both ways.

Writes a random HF directory of about ``--size-gb`` GB (``--dtype`` shards of ``--shard-size``), then runs
``python -m hp_megatron.convert hf-to-mcore`` and ``mcore-to-hf`` each in a fresh process and reports per
direction: wall seconds (process start to exit, imports and model-layout building included), MB/s over the
tensor bytes, and the process's peak resident set (``wait4`` ru_maxrss), against the goals: peak RSS below
2 x the largest tensor + 1 GB, at least 200 MB/s. Finally checks that the exported tensors equal the input.
Files live in ``--workdir`` (default: a temporary directory, removed at the end); the page cache is warm
for the reads (the input was just written).

Usage: ``python benchmarks/convert.py [--size-gb 2] [--dtype bf16] [--json out.json] [--write-docs]``
(a quick check: ``--size-gb 0.2``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from benchmarks._common import add_output_args, publish, run_meta  # noqa: E402
from hp_megatron.convert.safetensors_io import ShardedSafetensorsWriter, parse_size  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HIDDEN, FFN, HEADS, GROUPS, VOCAB = 2048, 5632, 16, 4, 32000


def llama_config(layers: int, dtype: str) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
            "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": layers,
            "num_attention_heads": HEADS, "num_key_value_heads": GROUPS, "head_dim": HIDDEN // HEADS,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
            "tie_word_embeddings": False, "torch_dtype": {"bf16": "bfloat16", "fp16": "float16",
                                                          "fp32": "float32"}[dtype]}


def hf_tensor_shapes(layers: int) -> list[tuple[str, tuple]]:
    kv = GROUPS * HIDDEN // HEADS
    shapes = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (HIDDEN,)), (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
                   (p + "self_attn.k_proj.weight", (kv, HIDDEN)), (p + "self_attn.v_proj.weight", (kv, HIDDEN)),
                   (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
                   (p + "post_attention_layernorm.weight", (HIDDEN,)), (p + "mlp.gate_proj.weight", (FFN, HIDDEN)),
                   (p + "mlp.up_proj.weight", (FFN, HIDDEN)), (p + "mlp.down_proj.weight", (HIDDEN, FFN))]
    return shapes + [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]


def layers_for(size_bytes: int, itemsize: int) -> int:
    fixed = sum(math.prod(s) for _, s in hf_tensor_shapes(0)) * itemsize
    per_layer = (sum(math.prod(s) for _, s in hf_tensor_shapes(1)) * itemsize) - fixed
    return max(1, math.ceil((size_bytes - fixed) / per_layer))


def write_synthetic(directory: str, layers: int, dtype: str, shard_size: str) -> tuple[int, int]:
    """Random HF directory; returns (total bytes, largest tensor bytes)."""
    os.makedirs(directory)
    torch_dtype = DTYPES[dtype]
    shapes = hf_tensor_shapes(layers)
    writer = ShardedSafetensorsWriter(directory, [(k, torch_dtype, s) for k, s in shapes], parse_size(shard_size))
    gen = torch.Generator().manual_seed(0)
    for key, shape in shapes:
        writer.write(key, torch.randn(shape, generator=gen).mul_(0.02).to(torch_dtype))
    writer.close()
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(llama_config(layers, dtype), f, indent=2)
    largest = max(math.prod(s) for _, s in shapes) * torch_dtype.itemsize
    return writer.total_size, largest


def run_cli(argv: list[str]) -> dict:
    """One conversion in a fresh process: wall seconds, peak RSS bytes, the CLI's own summary line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                       os.environ.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "hp_megatron.convert", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    out, err = proc.stdout.read(), proc.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"conversion failed: {' '.join(argv)}\n{err[-3000:]}")
    match = re.search(r"in ([0-9.]+) s .*setup ([0-9.]+) s", out)
    if match is None:
        raise RuntimeError(f"unexpected converter output: {out!r}")
    return {"wall_s": wall, "convert_s": float(match.group(1)), "setup_s": float(match.group(2)),
            "peak_rss_bytes": usage.ru_maxrss * 1024}


def check_equal(a_dir: str, b_dir: str) -> bool:
    """Every tensor of ``a_dir`` equals the same-named tensor of ``b_dir`` (one at a time)."""
    from hp_megatron.convert.safetensors_io import HFCheckpoint

    a, b = HFCheckpoint(a_dir), HFCheckpoint(b_dir)
    return set(a.tensors) == set(b.tensors) and all(torch.equal(a.read(k), b.read(k)) for k in a.tensors)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size to synthesize (GB, 1e9 bytes)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--shard-size", default="1GB", help="safetensors shard size of the synthetic input")
    parser.add_argument("--workdir", default=None, help="where to put the checkpoints (kept when given)")
    add_output_args(parser)
    args = parser.parse_args(argv)

    work = args.workdir or tempfile.mkdtemp(prefix="hp_convert_bench_")
    hf_dir, mcore_dir, back_dir = (os.path.join(work, n) for n in ("hf", "mcore", "hf_back"))
    try:
        for d in (hf_dir, mcore_dir, back_dir):
            shutil.rmtree(d, ignore_errors=True)
        layers = layers_for(int(args.size_gb * 1e9), DTYPES[args.dtype].itemsize)
        total, largest = write_synthetic(hf_dir, layers, args.dtype, args.shard_size)
        goal_rss = 2 * largest + 2**30
        rows = {}
        for name, cli in (("hf-to-mcore", ["hf-to-mcore", "--load", hf_dir, "--save", mcore_dir]),
                          ("mcore-to-hf", ["mcore-to-hf", "--load", mcore_dir, "--save", back_dir,
                                           "--max-shard-size", args.shard_size])):
            r = run_cli(cli)
            r["mb_per_s_wall"] = total / 1e6 / r["wall_s"]
            r["mb_per_s_convert"] = total / 1e6 / r["convert_s"]
            r["mb_per_s_tensors"] = total / 1e6 / max(r["convert_s"] - r["setup_s"], 1e-9)
            r["rss_goal_met"] = r["peak_rss_bytes"] < goal_rss
            r["speed_goal_met"] = r["mb_per_s_wall"] >= 200
            rows[name] = r
        bit_exact = check_equal(hf_dir, back_dir)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    result = dict(run_meta("convert.py", argv), checkpoint_bytes=total, layers=layers, dtype=args.dtype,
                  largest_tensor_bytes=largest, rss_goal_bytes=goal_rss, bit_exact_round_trip=bit_exact,
                  directions=rows)
    lines = [f"Synthetic Llama-shaped checkpoint: {total / 1e9:.2f} GB {args.dtype}, {layers} layers, largest tensor "
             f"{largest / 1e6:.0f} MB; RSS goal 2 x largest + 1 GiB = {goal_rss / 2**30:.2f} GiB; HF -> ours -> HF "
             f"bit-exact: {'yes' if bit_exact else 'NO'}. Command: `{result['command']}`, {result['threads']} threads.",
             "MB/s over the tensor bytes: *wall* from process start to exit (imports included), *conversion* inside "
             "the converter (model layout and checks included), *tensors* the tensor phase alone.",
             "", "| direction | wall s | setup s | MB/s wall | MB/s conversion | MB/s tensors | peak RSS GiB | "
             "RSS goal | 200 MB/s (wall) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['wall_s']:.1f} | {r['setup_s']:.1f} | {r['mb_per_s_wall']:.0f} | "
                     f"{r['mb_per_s_convert']:.0f} | {r['mb_per_s_tensors']:.0f} | "
                     f"{r['peak_rss_bytes'] / 2**30:.2f} | {'met' if r['rss_goal_met'] else 'missed'} | "
                     f"{'met' if r['speed_goal_met'] else 'missed'} |")
    publish(result, "\n".join(lines), args, "convert", "## Checkpoint conversion (benchmarks/convert.py)")


if __name__ == "__main__":
    main()
