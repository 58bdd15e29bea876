"""``python -m hp_megatron.convert {hf-to-mcore,mcore-to-hf} --load SRC --save DST [...]``.

    python -m hp_megatron.convert hf-to-mcore --load /models/Llama-tiny --save /ckpt/llama-tiny
    python -m hp_megatron.convert mcore-to-hf --load /ckpt/llama-tiny --save /models/llama-tiny-out

The architecture comes from config.json's ``model_type`` (see ``hp_megatron.convert.registry``);
``--rules`` / ``--model-builder`` (``package.module:function``) override it.
"""
from __future__ import annotations

import argparse
import json
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hp_megatron.convert", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="direction", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="HF directory -> megatron-core torch_dist checkpoint")
    to_mcore.add_argument("--load", required=True, help="HF directory (config.json + safetensors shards)")
    to_mcore.add_argument("--save", required=True, help="checkpoint root to create")
    to_mcore.add_argument("--drop-unmodeled", action="store_true",
                          help="leave out tensors of parts the megatron model does not build (DeepSeek-V3's "
                               "multi-token-prediction layers); without it their presence is an error")
    to_mcore.add_argument("--ckpt-iteration", type=int, default=None,
                          help="write iter_XXXXXXX with this iteration instead of a 'release' checkpoint")
    to_hf = sub.add_parser("mcore-to-hf", help="megatron-core checkpoint -> HF directory")
    to_hf.add_argument("--load", required=True, help="checkpoint root (with latest_checkpointed_iteration.txt) or "
                                                     "an iteration directory")
    to_hf.add_argument("--save", required=True, help="HF directory to create")
    to_hf.add_argument("--hf-config", default=None,
                       help="config.json (file or directory) when the checkpoint does not carry one")
    to_hf.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default 5GB)")
    for p in (to_mcore, to_hf):
        p.add_argument("--rules", default=None, help="package.module:function returning the TensorRules")
        p.add_argument("--model-builder", default=None, help="package.module:function building the GPTModel")
        p.add_argument("--overwrite", action="store_true", help="replace --save if it exists")
    return parser


def _read_config(path: str) -> dict:
    import os

    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        return json.load(f)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = _convert(args)
    except (ValueError, FileExistsError) as err:  # CheckpointError is a ValueError
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    print(f"{args.direction}: {report.tensors} tensors, {report.bytes / 1e6:.1f} MB in {report.seconds:.2f} s "
          f"({report.mb_per_s:.1f} MB/s; setup {report.setup_seconds:.2f} s, tensors {report.data_mb_per_s:.1f} MB/s)"
          f" -> {report.output}", flush=True)
    if report.dropped:
        print(f"left out {len(report.dropped)} tensors of parts the model does not build (--drop-unmodeled), e.g. "
              f"{report.dropped[0]}", flush=True)
    return 0


def _convert(args):
    from hp_megatron.convert.engine import hf_to_mcore, mcore_to_hf
    from hp_megatron.convert.registry import load_callable

    build_model = load_callable(args.model_builder) if args.model_builder else None
    rules_fn = load_callable(args.rules) if args.rules else None
    if args.direction == "hf-to-mcore":
        from hp_megatron.convert.safetensors_io import read_config

        rules = rules_fn(read_config(args.load)) if rules_fn else None
        return hf_to_mcore(args.load, args.save, rules=rules, build_model=build_model,
                           iteration=args.ckpt_iteration, overwrite=args.overwrite,
                           drop_unmodeled=args.drop_unmodeled)
    hf_config = _read_config(args.hf_config) if args.hf_config else None
    rules = None
    if rules_fn:
        if hf_config is None:
            raise ValueError("--rules with mcore-to-hf needs --hf-config")
        rules = rules_fn(hf_config)
    return mcore_to_hf(args.load, args.save, hf_config=hf_config, rules=rules, build_model=build_model,
                       max_shard_size=args.max_shard_size, overwrite=args.overwrite)


if __name__ == "__main__":
    sys.exit(main())
