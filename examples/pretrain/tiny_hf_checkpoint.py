"""Write a tiny random Hugging Face checkpoint of a supported architecture, to try the path
HF checkpoint -> ``python -m hp_megatron.convert hf-to-mcore`` -> ``pretrain_hybrid.py --hp-hf-config --load``:

    python examples/pretrain/tiny_hf_checkpoint.py --arch qwen3_next --save out/hf/tiny_qwen3_next

The model is ``hp_megatron.models.tiny``'s (the tests' tiny configs: routed and shared experts, dense and MoE
layers, mixed layer types), built by transformers with random weights and written with ``save_pretrained``.
``--vocab-size`` defaults to 4096, the vocabulary of the example's default tokenizer (prepare_data.py): the
checkpoint's embedding rows must hold every id of the data's tokenizer.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:  # run from a fresh clone without installing
    sys.path.insert(0, REPO)

from hp_megatron.models.tiny import TINY_ARCHITECTURES, build_tiny_hf_model, save_tiny_hf_model  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--arch", choices=sorted(TINY_ARCHITECTURES), required=True, help="HF model_type")
    parser.add_argument("--save", required=True, help="output directory (config.json + model.safetensors)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="the data tokenizer's vocabulary size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if os.path.exists(args.save) and os.listdir(args.save):
        parser.error(f"--save {args.save} exists and is not empty")
    try:
        model = build_tiny_hf_model(args.arch, args.seed, vocab_size=args.vocab_size)
    except RuntimeError as err:  # transformers missing: one line naming the install command
        print(f"error: {err}", file=sys.stderr)
        return 2
    save_tiny_hf_model(model, args.save)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"saved a tiny random {type(model).__name__} ({n_params} parameters, vocab {args.vocab_size}) to {args.save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
