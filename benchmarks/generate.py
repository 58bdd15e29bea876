"""Generation speed on CPU: ``hp_megatron.generate`` (megatron-core's static inference path, recurrent GDN/KDA
decode steps, MLA latent cache) against transformers' ``generate`` on the same weights.

Small models, hidden 256, 4 layers of each mixer kind, dense MLPs, fp32, random weights: Qwen3-Next (4 GDN +
4 softmax attention) and Kimi Linear (4 KDA + 4 MLA without q LoRA). Each is built with transformers, saved,
converted with ``hf_to_mcore`` and loaded the way the generate command loads it. Per model, batch ``--batch``
prompts of ``--prompt`` random tokens, ``--new`` greedy tokens (``eos`` off, so every step runs):

- decode tokens/s: ours (every step after the prefill) vs transformers (``generate``'s time minus its prefill,
  one ``use_cache=True`` forward of the prompts); goal >= 3x;
- prefill: our first step (the prompts through megatron-core's inference context, caches filled) vs one training
  forward of the same prompts (no context, no grad); goal: at least as fast;
- the MLA cache bytes per token per layer, measured on the context after generation, against the full K/V cache
  of the same layer (heads x (qk_head_dim + v_head_dim) values), and DeepSeek-V3's (the real config) by the same
  formula.

Times are this process's CPU seconds (``time.process_time``, all torch threads), the measure that survives a
shared machine; the load average at the start is in the table. Both sides run a warm-up generation of the measured
prompts (2 new tokens) first, and the training forward one warm-up forward: one-time costs (kernel selection,
allocations, lazy imports, and megatron-core's ``torch.compile`` of the attention output gate, which compiles
per new shape and grad mode) stay out of the timings.

Usage: ``python benchmarks/generate.py [--batch 8 --prompt 512 --new 128] [--json out.json] [--write-docs]``
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from benchmarks._common import add_output_args, publish, run_meta  # noqa: E402

HIDDEN, VOCAB = 256, 1024
DEEPSEEK_V3 = dict(heads=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)


def hf_model(arch: str, max_positions: int):
    """A small random transformers model of ``arch`` (4 layers of each mixer kind, dense MLPs, fp32)."""
    import transformers

    from hp_megatron.models.tiny import perturb_parameters

    if arch == "qwen3_next":
        cls = transformers.Qwen3NextForCausalLM
        cfg = transformers.Qwen3NextConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
            mlp_only_layers=list(range(8)), max_position_embeddings=max_positions, rms_norm_eps=1e-6,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    elif arch == "kimi_linear":
        cls = transformers.KimiLinearForCausalLM
        cfg = transformers.KimiLinearConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=128, qk_nope_head_dim=64,
            qk_rope_head_dim=32, v_head_dim=64, rms_norm_eps=1e-5, pad_token_id=None, bos_token_id=None,
            eos_token_id=None, mlp_layer_types=["dense"] * 8, max_position_embeddings=max_positions,
            layer_types=["linear_attention", "full_attention"] * 4,
            linear_attn_config={"head_dim": 64, "num_heads": 4, "short_conv_kernel_size": 4})
    else:
        raise ValueError(f"no benchmark model for {arch!r}")
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg).float().eval()
    perturb_parameters(model, 0)
    model.generation_config.eos_token_id = None
    return model


def _transformers_torch_path(arch: str) -> None:
    """transformers' own PyTorch GDN/KDA functions (FLA's Triton kernels do not run on CPU)."""
    import importlib

    module = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
                 "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention",
                 "fused_recurrent_kimi_delta_attention"):
        fn = getattr(module, name, None)
        if fn is not None and hasattr(fn, "__wrapped__"):
            setattr(module, name, fn.__wrapped__)


CLOCK = time.process_time


def _hf_generate(model, prompts, new: int):
    return model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                          do_sample=False, pad_token_id=0)


def measure_transformers(model, prompts, new: int) -> dict:
    with torch.no_grad():
        _hf_generate(model, prompts, 2)  # warm-up at the measured prompt length, as for ours
        began = CLOCK()
        model(input_ids=prompts, use_cache=True)
        prefill = CLOCK() - began
        began = CLOCK()
        out = _hf_generate(model, prompts, new)
        total = CLOCK() - began
    decode = max(total - prefill, 1e-9)
    return {"prefill_s": prefill, "decode_s": decode, "decode_tokens_per_s": prompts.shape[0] * (new - 1) / decode,
            "tokens": out[:, prompts.shape[1]:].tolist()}


def measure_ours(hf_dir: str, ckpt: str, prompts, new: int) -> dict:
    from hp_megatron.convert.safetensors_io import load_hf_config
    from hp_megatron.generate import StaticGenerator, sampling_params
    from hp_megatron.generate.model import build_model

    hf_config = load_hf_config(hf_dir)
    model = build_model(hf_config, load=ckpt)
    batch, length = prompts.shape
    generator = StaticGenerator(model, vocab_size=VOCAB, max_positions=model.max_sequence_length,
                                max_batch_size=batch, max_sequence_length=length + new)
    # warm-up at the measured prompt length: megatron-core compiles its attention output gate (``jit_fuser`` =
    # torch.compile, Qwen3-Next) per new shape and grad mode, so a warm-up on shorter prompts left one compile
    # inside the timed prefill (and one inside the timed training forward, which runs under no_grad)
    generator.generate(prompts.tolist(), sampling_params(max_new_tokens=2))
    result = generator.generate(prompts.tolist(), sampling_params(max_new_tokens=new), clock=CLOCK)
    positions = torch.arange(length).expand(batch, length)
    with torch.no_grad():
        model(prompts, positions, None)  # warm-up (see above)
        began = CLOCK()
        model(prompts, positions, None)
        forward = CLOCK() - began
    cache = mla_cache_bytes(model, generator.context, batch, length + new)
    return {"prefill_s": result.prefill_seconds, "decode_s": result.decode_seconds,
            "decode_tokens_per_s": result.decode_tokens_per_s, "training_forward_s": forward,
            "tokens": result.tokens, "mla_cache": cache}


def mla_cache_bytes(model, context, batch: int, length: int):
    """(cache bytes per token per MLA layer on ``context``, full K/V bytes per token of that layer), or None."""
    from layers.mixers.mla.layer import MultiLatentAttention

    for layer in model.decoder.layers:
        attention = layer.self_attention
        if isinstance(attention, MultiLatentAttention):
            stored = context.key_value_memory_dict[layer.layer_number]
            tensors = [stored] if torch.is_tensor(stored) else [t for t in _flat(stored) if torch.is_tensor(t)]
            cached = sum(t.numel() * t.element_size() for t in tensors) / (batch * length)
            cfg = model.config
            full = cfg.num_attention_heads * (cfg.qk_head_dim + cfg.qk_pos_emb_head_dim + cfg.v_head_dim) * 4
            return {"cache_bytes_per_token": cached, "full_kv_bytes_per_token": full}
    return None


def _flat(value):
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flat(v)]
    return [value]


def run(args) -> dict:
    from hp_megatron.convert.engine import hf_to_mcore
    from hp_megatron.models import architecture_of
    from hp_megatron.platform import single_rank_megatron

    load = os.getloadavg()
    rows = {}
    for arch in args.archs:
        _transformers_torch_path(arch)
        model = hf_model(arch, args.prompt + args.new)
        prompts = torch.randint(0, VOCAB, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
        with tempfile.TemporaryDirectory() as tmp:
            hf_dir, ckpt = os.path.join(tmp, "hf"), os.path.join(tmp, "ckpt")
            model.save_pretrained(hf_dir)
            hf_to_mcore(hf_dir, ckpt, architecture_of(hf_dir))
            with single_rank_megatron(0):
                ours = measure_ours(hf_dir, ckpt, prompts, args.new)
        theirs = measure_transformers(model, prompts, args.new)
        same = sum(a == b for x, y in zip(ours.pop("tokens"), theirs.pop("tokens")) for a, b in zip(x, y))
        rows[arch] = {"ours": ours, "transformers": theirs, "same_tokens": same, "tokens": args.batch * args.new,
                      "decode_speedup": ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"],
                      "prefill_vs_training_forward": ours["training_forward_s"] / ours["prefill_s"]}
    d = DEEPSEEK_V3
    deepseek = {"cache_values_per_token": d["kv_lora_rank"] + d["qk_rope_head_dim"],
                "full_kv_values_per_token": d["heads"] * (d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
                                                          + d["v_head_dim"])}
    return {"meta": dict(run_meta("generate.py"), load_average=load, cpus=os.cpu_count()),
            "batch": args.batch, "prompt": args.prompt, "new": args.new, "models": rows, "deepseek_v3": deepseek}


def table(result: dict) -> str:
    meta = result["meta"]
    lines = [f"`{meta['command']}`; CPU, {meta['threads']} torch threads, load average "
             f"{meta['load_average'][0]:.1f} / {meta['cpus']} CPUs at the start; torch {meta['torch']}, megatron-core "
             f"{meta['megatron_core']}, transformers {meta['transformers']}. Batch {result['batch']}, prompt "
             f"{result['prompt']}, {result['new']} new tokens, greedy, fp32.", "",
             "Tokens per CPU second (this process, all threads).", "",
             "| model | decode tok/s ours | decode tok/s transformers | speedup (goal >= 3x) | prefill CPU s ours | "
             "training forward CPU s | forward / prefill (goal >= 1) | same greedy tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for arch, row in result["models"].items():
        ours, theirs = row["ours"], row["transformers"]
        lines.append(f"| {arch} | {ours['decode_tokens_per_s']:.1f} | {theirs['decode_tokens_per_s']:.1f} | "
                     f"{row['decode_speedup']:.2f}x | {ours['prefill_s']:.3f} | {ours['training_forward_s']:.3f} | "
                     f"{row['prefill_vs_training_forward']:.2f} | {row['same_tokens']} / {row['tokens']} |")
    lines += ["", "| MLA cache per token per layer | cached | full K/V | ratio |", "|---|---|---|---|"]
    for arch, row in result["models"].items():
        cache = row["ours"]["mla_cache"]
        if cache:
            lines.append(f"| {arch} (bytes, fp32) | {cache['cache_bytes_per_token']:.0f} | "
                         f"{cache['full_kv_bytes_per_token']:.0f} | "
                         f"{cache['full_kv_bytes_per_token'] / cache['cache_bytes_per_token']:.1f}x |")
    d = result["deepseek_v3"]
    lines.append(f"| DeepSeek-V3 (values, by its config) | {d['cache_values_per_token']} | "
                 f"{d['full_kv_values_per_token']} | "
                 f"{d['full_kv_values_per_token'] / d['cache_values_per_token']:.1f}x |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--archs", nargs="+", default=["qwen3_next", "kimi_linear"])
    add_output_args(parser)
    args = parser.parse_args(argv)
    result = run(args)
    publish(result, table(result), args, "generate", "## Generation (`benchmarks/generate.py`)")


if __name__ == "__main__":
    main()
