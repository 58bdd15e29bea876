"""Text <-> token ids for the generate command: an HF tokenizer (a directory ``AutoTokenizer`` reads) or a
``tokenizers`` JSON file (the example's ``tokenizer.json``)."""
from __future__ import annotations

import os

_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Tokenizer:
    """``encode(text) -> ids``, ``decode(ids) -> text`` and ``stop_id`` (end of text, or None)."""

    def __init__(self, encode, decode, stop_id, source: str):
        self.encode, self.decode, self.stop_id, self.source = encode, decode, stop_id, source


def has_tokenizer(directory: str | None) -> bool:
    return directory is not None and any(os.path.isfile(os.path.join(directory, f)) for f in _HF_TOKENIZER_FILES)


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer at ``path``: a directory -> transformers' ``AutoTokenizer`` (no special tokens added),
    a ``.json`` file -> ``tokenizers.Tokenizer`` (stop id: ``<|endoftext|>`` when it has one).
    FileNotFoundError when there is none; RuntimeError naming the package when it is not installed."""
    if os.path.isdir(path):
        try:
            from transformers import AutoTokenizer
        except ImportError as err:
            raise RuntimeError("an HF tokenizer needs transformers: pip install 'hp-megatron[hf]'") from err
        tok = AutoTokenizer.from_pretrained(path)
        return Tokenizer(lambda text: tok.encode(text, add_special_tokens=False),
                         lambda ids: tok.decode(ids), tok.eos_token_id, path)
    if os.path.isfile(path):
        try:
            from tokenizers import Tokenizer as TokenizersTokenizer
        except ImportError as err:
            raise RuntimeError("a tokenizer.json needs the tokenizers package: pip install tokenizers") from err
        tok = TokenizersTokenizer.from_file(path)
        return Tokenizer(lambda text: tok.encode(text).ids, lambda ids: tok.decode(list(ids)),
                         tok.token_to_id("<|endoftext|>"), path)
    raise FileNotFoundError(f"tokenizer {path}: no such file or directory")
