"""``python -m hp_megatron.convert {hf-to-mcore,mcore-to-hf} --load SRC --save DST [...]``.

    python -m hp_megatron.convert hf-to-mcore --load /models/Llama-tiny --save /ckpt/llama-tiny
    python -m hp_megatron.convert mcore-to-hf --load /ckpt/llama-tiny --save /models/llama-tiny-out

The architecture comes from config.json's ``model_type`` (the table of ``hp_megatron.models``: this entry point
imports it, the engine does not); ``--rules`` / ``--model-builder`` (``package.module:function``) replace its
conversion rules / model builder. ``--mtp-num-layers N`` converts DeepSeek-V3's / Qwen3-Next's
multi-token-prediction layers too (N: config.json's ``num_nextn_predict_layers`` / ``mtp_num_hidden_layers``);
mcore-to-hf takes the checkpoint's MTP depth unless given. ``--model-class hybrid`` converts to / from megatron-core's
``HybridModel`` (0.19+; the architecture's rules in HybridModel's layer numbering,
``hp_megatron.hybrid_model.numbering``);
mcore-to-hf reads the class from the checkpoint unless given. ``gpt-to-hybrid --load GPT --save HYBRID`` migrates a
GPTModel checkpoint of our layers (training state included) to HybridModel (``hp_megatron.convert.migrate``).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
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
    to_mcore.add_argument("--mtp-num-layers", type=int, default=0,
                          help="build the model with the checkpoint's N multi-token-prediction layers and convert "
                               "them (DeepSeek-V3, Qwen3-Next; default 0: none)")
    to_hf.add_argument("--mtp-num-layers", type=int, default=None,
                       help="multi-token-prediction layers to convert (default: those the checkpoint holds)")
    to_mcore.add_argument("--model-class", choices=("gpt", "hybrid"), default="gpt",
                          help="megatron-core model class of the checkpoint: GPTModel (default) or HybridModel")
    to_hf.add_argument("--model-class", choices=("gpt", "hybrid"), default=None,
                       help="model class of the checkpoint (default: read from it)")
    for name, source, target in (("gpt-to-hybrid", "GPTModel", "HybridModel"),
                                 ("hybrid-to-gpt", "HybridModel", "GPTModel")):
        migrate = sub.add_parser(name, help=f"{source} checkpoint -> {target} checkpoint (weights and optimizer "
                                            "state bit-exact)")
        migrate.add_argument("--load", required=True, help=f"{source} checkpoint root or iteration directory")
        migrate.add_argument("--save", required=True, help="checkpoint root to create")
        migrate.add_argument("--hybrid-layer-pattern", default=None,
                             help="the model's HybridModel pattern (default: from the checkpoint's hf_config or the "
                                  "example's stored flags)")
        migrate.add_argument("--overwrite", action="store_true", help="replace --save if it exists")
    for p in (to_mcore, to_hf):
        p.add_argument("--rules", default=None, help="package.module:function returning the TensorRules")
        p.add_argument("--model-builder", default=None, help="package.module:function building the GPTModel")
        p.add_argument("--overwrite", action="store_true", help="replace --save if it exists")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.direction in ("gpt-to-hybrid", "hybrid-to-gpt"):
            done = _migrate(args)
            state = ("weights and optimizer state" if done["optimizer"]
                     else "weights only (the checkpoint has no optimizer state)")
            print(f"{args.direction}: {done['tensors']} tensors, {done['objects']} objects ({state}), pattern "
                  f"{done['pattern']} -> {args.save}", flush=True)
            return 0
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
    from hp_megatron.convert.engine import (hf_to_mcore, mcore_to_hf, stored_hf_config, stored_model_class,
                                            stored_mtp_depth)
    from hp_megatron.convert.safetensors_io import load_hf_config

    if args.direction == "hf-to-mcore":
        architecture = _architecture(load_hf_config(args.load), args).with_mtp(args.mtp_num_layers)
        return hf_to_mcore(args.load, args.save, architecture.for_model_class(args.model_class),
                           iteration=args.ckpt_iteration, overwrite=args.overwrite, drop_unmodeled=args.drop_unmodeled)
    hf_config = load_hf_config(args.hf_config) if args.hf_config else stored_hf_config(args.load)
    depth = stored_mtp_depth(args.load) if args.mtp_num_layers is None else args.mtp_num_layers
    model_class = args.model_class or stored_model_class(args.load)
    architecture = _architecture(hf_config, args).with_mtp(depth).for_model_class(model_class)
    return mcore_to_hf(args.load, args.save, architecture, hf_config=hf_config, max_shard_size=args.max_shard_size,
                       overwrite=args.overwrite)


def _migrate(args) -> dict:
    """``gpt-to-hybrid`` / ``hybrid-to-gpt``: the pattern from the flag, the checkpoint's ``hybrid_layer_pattern``
    (a migrated one), its ``hf_config`` (its architecture, with the checkpoint's MTP depth) or the example's stored
    flags; then ``migrate_gpt_to_hybrid`` / ``migrate_hybrid_to_gpt``."""
    from hp_megatron.checkpoint import checkpoint_directory
    from hp_megatron.checkpoint.common_state import read_common_state
    from hp_megatron.convert.engine import stored_mtp_depth
    from hp_megatron.convert.migrate import migrate_gpt_to_hybrid, migrate_hybrid_to_gpt, pattern_of_model_args
    from hp_megatron.models import get_architecture

    pattern = args.hybrid_layer_pattern
    if pattern is None:
        common = read_common_state(checkpoint_directory(args.load))
        if common.get("hybrid_layer_pattern"):
            pattern = common["hybrid_layer_pattern"]
        elif common.get("hf_config") is not None:
            hf = common["hf_config"]
            pattern = get_architecture(hf["model_type"]).with_mtp(stored_mtp_depth(args.load)).hybrid_pattern(hf)
        elif common.get("hp_model_args") is not None:
            pattern = pattern_of_model_args(common["hp_model_args"])
        else:
            raise ValueError(f"{args.load}: its common state has neither hf_config nor hp_model_args; pass "
                             "--hybrid-layer-pattern")
    migrate = migrate_gpt_to_hybrid if args.direction == "gpt-to-hybrid" else migrate_hybrid_to_gpt
    return {**migrate(args.load, args.save, pattern, overwrite=args.overwrite), "pattern": pattern}


def _architecture(hf_config: dict, args):
    """The listed architecture of config.json's ``model_type`` with ``--rules`` / ``--model-builder`` in place of
    its own; an unlisted ``model_type`` needs both."""
    from hp_megatron.models import ARCHITECTURES, Architecture

    rules = load_callable(args.rules) if args.rules else None
    builder = load_callable(args.model_builder) if args.model_builder else None
    model_type = hf_config.get("model_type")
    if model_type not in ARCHITECTURES:
        if rules is None or builder is None:
            raise ValueError(f"config.json model_type={model_type!r} is not one of {sorted(ARCHITECTURES)}; "
                             "pass both --rules and --model-builder to convert it")
        return Architecture(model_type, None, rules, model_builder=builder)
    listed = ARCHITECTURES[model_type]
    return dataclasses.replace(listed, conversion_rules=rules or listed.conversion_rules,
                               model_builder=builder or listed.model_builder)


def load_callable(spec: str):
    """``"package.module:function"`` -> the function (``--rules`` / ``--model-builder``)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"expected 'package.module:function', got {spec!r}")
    return getattr(importlib.import_module(module), name)


if __name__ == "__main__":
    sys.exit(main())
