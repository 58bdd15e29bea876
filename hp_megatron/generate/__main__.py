"""python -m hp_megatron.generate: generate text from a converted or trained checkpoint.

    python -m hp_megatron.generate --hp-hf-config HF_DIR --load CKPT --prompt "def main(" --max-new-tokens 32
    python -m hp_megatron.generate --load EXAMPLE_CKPT --prompt "def "     # the example's stored model arguments
    torchrun --nproc-per-node 2 -m hp_megatron.generate ... --tensor-model-parallel-size 2

Prints each prompt's continuation and the prefill / decode tokens per second (rank 0). Bad input (an empty
prompt, a prompt longer than the model's positions or the cache, more prompts than the cache) is one line on
stderr and exit status 2, before anything is generated or printed; so is a stored model this command cannot
generate from (a stored ``--hp-mixer-module`` that does not import, a mixer without a decode path:
``hp_megatron.registry.MixerSupport``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hp_megatron.generate", description=__doc__.split("\n")[0])
    g = p.add_argument_group("model")
    g.add_argument("--hp-hf-config", default=None,
                   help="HF config.json or model directory (default: the config a converted --load stores)")
    g.add_argument("--load", default=None, help="megatron-core checkpoint (tracker directory or iteration "
                                                "directory); without it the weights are random")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="build the model from the arguments --load stores (the example's checkpoints; the default "
                        "when it stores no HF config)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g = p.add_argument_group("prompts")
    g.add_argument("--prompt", action="append", default=[], help="a text prompt (repeat for a batch)")
    g.add_argument("--prompts-file", default=None, help="a file of text prompts, one per line")
    g.add_argument("--prompt-ids", action="append", default=[],
                   help="a prompt as comma-separated token ids (repeat for a batch; no tokenizer needed)")
    g.add_argument("--tokenizer", default=None, help="HF tokenizer directory or tokenizers JSON file "
                                                     "(default: the --hp-hf-config directory's tokenizer, or "
                                                     "the one the example's checkpoint names)")
    g = p.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=1, help="1: greedy (the default); 0: no top-k")
    g.add_argument("--top-p", type=float, default=0.0, help="0: no top-p")
    g.add_argument("--seed", type=int, default=1234, help="seed of the sampling generator")
    g.add_argument("--ignore-eos", action="store_true", help="generate --max-new-tokens even after end of text")
    g.add_argument("--inference-max-requests", type=int, default=8, help="the cache's batch size")
    g.add_argument("--inference-max-seq-length", type=int, default=2560, help="the cache's length (tokens)")
    g.add_argument("--output-json", default=None, help="also write tokens, log-probabilities and speeds here")
    return p


def read_prompts(args, tokenizer):
    """(texts or None, token id lists): --prompt / --prompts-file tokenized, or --prompt-ids parsed."""
    texts = list(args.prompt)
    if args.prompts_file is not None:
        with open(args.prompts_file, encoding="utf-8") as f:
            texts += [line.rstrip("\n") for line in f if line.strip()]
    if texts and args.prompt_ids:
        raise ValueError("give text prompts (--prompt / --prompts-file) or --prompt-ids, not both")
    if args.prompt_ids:
        try:
            return None, [[int(t) for t in ids.split(",") if t.strip()] for ids in args.prompt_ids]
        except ValueError:
            raise ValueError(f"--prompt-ids takes comma-separated integers, got {args.prompt_ids}") from None
    if not texts:
        raise ValueError("no prompts: give --prompt, --prompts-file or --prompt-ids")
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer: --tokenizer, or an --hp-hf-config directory that has one "
                         "(or give --prompt-ids)")
    return texts, [tokenizer.encode(t) for t in texts]


def _tokenizer(args, default: str | None):
    """``--tokenizer``, else ``default`` (the model's own) for text prompts, else None."""
    from hp_megatron.generate.tokenizer import load_tokenizer

    if args.tokenizer is not None:
        return load_tokenizer(args.tokenizer)
    return load_tokenizer(default) if default is not None and not args.prompt_ids else None


def _init_distributed(tp: int, seed: int) -> bool:
    """torch.distributed (torchrun's world, else one gloo rank) and megatron's parallel state at TP=``tp``,
    unless the caller made them already; the CPU shims. Returns True when this call created them."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from hp_megatron.platform import apply_cpu_shims

    created = not dist.is_initialized()
    if created and "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    elif created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != tp:
        raise ValueError(f"generation runs one model replica: world size {dist.get_world_size()} must equal "
                         f"--tensor-model-parallel-size {tp}")
    if created or not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, 1)
    apply_cpu_shims(seed)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    return created


def run(args) -> dict:
    """Generate for ``args`` (parsed :func:`build_parser` flags); returns what rank 0 prints and writes."""
    from hp_megatron.generate.loop import check_batch, sampling_params
    from hp_megatron.generate.model import model_source

    source = model_source(args.hp_hf_config, args.load, args.use_checkpoint_args)
    tokenizer = _tokenizer(args, source.tokenizer)
    texts, prompts = read_prompts(args, tokenizer)
    params = sampling_params(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                             top_p=args.top_p)
    vocab_size = source.vocab_size
    limits = dict(max_positions=source.max_positions, max_batch_size=args.inference_max_requests,
                  max_sequence_length=args.inference_max_seq_length)
    check_batch(prompts, args.max_new_tokens, vocab_size=vocab_size, **limits)
    created = _init_distributed(args.tensor_model_parallel_size, args.seed)
    try:
        return _generate(args, source, tokenizer, texts, prompts, params, vocab_size, limits)
    finally:
        if created:
            import torch.distributed as dist
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def _generate(args, source, tokenizer, texts, prompts, params, vocab_size, limits) -> dict:
    import torch.distributed as dist

    from hp_megatron.generate.loop import StaticGenerator

    model = source.build(tensor_model_parallel_size=args.tensor_model_parallel_size, load=args.load)
    stop_id = None if args.ignore_eos or tokenizer is None else tokenizer.stop_id
    generator = StaticGenerator(model, vocab_size=vocab_size, pad_id=stop_id or 0, **limits)
    result = generator.generate(prompts, params, seed=args.seed, stop_id=stop_id)
    report = {"prompts": prompts, "tokens": result.tokens, "log_probs": result.log_probs,
              "prefill_tokens_per_s": result.prefill_tokens_per_s, "decode_tokens_per_s": result.decode_tokens_per_s}
    if tokenizer is not None:
        report["texts"] = [tokenizer.decode(t) for t in result.tokens]
    if dist.get_rank() == 0:
        _print(texts, prompts, report, result)
        if args.output_json is not None:
            _write_json(args.output_json, report)
    return report


def _print(texts, prompts, report, result):
    for i, prompt in enumerate(prompts):
        shown = repr(texts[i]) if texts is not None else prompt
        print(f"[{i}] prompt ({len(prompt)} tokens): {shown}")
        new = report["texts"][i] if "texts" in report else report["tokens"][i]
        print(f"[{i}] generated ({len(report['tokens'][i])} tokens): {new!r}" if "texts" in report
              else f"[{i}] generated ({len(report['tokens'][i])} tokens): {new}")
    print(f"prefill: {result.prefill_tokens} tokens in {result.prefill_seconds:.3f} s "
          f"({result.prefill_tokens_per_s:.1f} tokens/s) | decode: {result.decode_tokens} tokens in "
          f"{result.decode_seconds:.3f} s ({result.decode_tokens_per_s:.1f} tokens/s)", flush=True)


def _write_json(path: str, report: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, path)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.tensor_model_parallel_size < 1:
        print(f"error: --tensor-model-parallel-size must be >= 1, got {args.tensor_model_parallel_size}",
              file=sys.stderr)
        return 2
    try:
        run(args)
    except (ValueError, FileNotFoundError) as err:  # CheckpointError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
