"""Turn a ``tokenizers`` JSON file into the directory Megatron-LM's ``--tokenizer-type HuggingFaceTokenizer`` loads.

Megatron-LM calls ``transformers.AutoTokenizer.from_pretrained(DIR)``, which needs ``tokenizer_config.json``
beside ``tokenizer.json``; its end-of-document id is the tokenizer's ``eos_token``. For the tokenizer of
``examples/pretrain/prepare_data.py`` (EOD ``<|endoftext|>``, PAD ``<|pad|>``):

    python examples/pretrain/prepare_data.py --output-dir out/data/pydoc
    python examples/pretrain/megatron_lm/hf_tokenizer.py out/data/pydoc/tokenizer.json out/data/pydoc/hf

then ``TOKENIZER=out/data/pydoc/hf`` for the launch scripts.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from prepare_data import EOD, PAD  # noqa: E402


def write_tokenizer_dir(tokenizer_json: str, output_dir: str, eos_token: str = EOD, pad_token: str = PAD) -> str:
    """Save ``tokenizer_json`` as a transformers tokenizer directory; returns ``output_dir``."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError as err:
        raise RuntimeError("writing a HuggingFaceTokenizer directory needs the 'transformers' package "
                           "(pip install transformers)") from err
    if not os.path.isfile(tokenizer_json):
        raise ValueError(f"tokenizer file {tokenizer_json!r} does not exist")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=tokenizer_json, eos_token=eos_token, pad_token=pad_token)
    missing = [t for t in (eos_token, pad_token)
               if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
    if missing:
        raise ValueError(f"tokenizer {tokenizer_json!r} has no token {missing}; pass --eos-token/--pad-token")
    tokenizer.save_pretrained(output_dir)
    return output_dir


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tokenizer_json")
    parser.add_argument("output_dir")
    parser.add_argument("--eos-token", default=EOD)
    parser.add_argument("--pad-token", default=PAD)
    args = parser.parse_args()
    print(write_tokenizer_dir(args.tokenizer_json, args.output_dir, args.eos_token, args.pad_token))


if __name__ == "__main__":
    main()
