"""Build the example's default dataset offline: CPython's documentation text -> BPE tokenizer -> Megatron indexed data.

The text is ``pydoc_data.topics`` (the help() topics shipped with every CPython, ~0.5 MB of English and
code). A byte-level BPE tokenizer is trained on it with the ``tokenizers`` package, and every topic becomes
one document (tokens + end-of-document) in megatron-core's ``IndexedDataset`` format (``.bin`` + ``.idx``).

    python examples/pretrain/prepare_data.py --output-dir out/data/pydoc --vocab-size 4096

Outputs ``tokenizer.json`` and ``pydoc_text_document.{bin,idx}``; pass ``--data-path
out/data/pydoc/pydoc_text_document --tokenizer out/data/pydoc/tokenizer.json`` to pretrain_hybrid.py.
Re-running with the same arguments rebuilds byte-identical files. The settings are recorded in ``dataset.json``
(written last): a folder holding a dataset built with other settings is refused, by this script and by
pretrain_hybrid.py's default dataset (``out/data/pydoc``, vocabulary 4096), instead of being overwritten or used.
"""
from __future__ import annotations

import argparse
import json
import os

EOD = "<|endoftext|>"
PAD = "<|pad|>"
DATA_NAME = "pydoc_text_document"
DEFAULT_VOCAB_SIZE = 4096
SETTINGS_NAME = "dataset.json"
DATASET_FILES = ("tokenizer.json", DATA_NAME + ".bin", DATA_NAME + ".idx")


def documents():
    """The help() topics of this interpreter, in sorted key order (deterministic)."""
    from pydoc_data.topics import topics

    return [topics[key].strip() + "\n" for key in sorted(topics)]


def train_tokenizer(texts, vocab_size: int):
    """Byte-level BPE (GPT-2 style pre-tokenization) trained on ``texts``; EOD and PAD are special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


class BPETokenizer:
    """The attributes megatron-core's GPTDataset reads (``vocab_size``, ``eod``, ``pad``) over a trained
    ``tokenizers`` BPE model, plus ``tokenize``/``detokenize``."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        if not os.path.exists(path):
            raise FileNotFoundError(f"tokenizer file {path} not found; run examples/pretrain/prepare_data.py")
        import hashlib

        self._tok = Tokenizer.from_file(path)
        with open(path, "rb") as f:  # GPTDataset hashes this into its index-cache file names
            self.unique_identifiers = {"class": type(self).__name__, "sha256": hashlib.sha256(f.read()).hexdigest()}
        self.vocab_size = self._tok.get_vocab_size()
        self.eod = self._tok.token_to_id(EOD)
        self.pad = self._tok.token_to_id(PAD)
        if self.eod is None or self.pad is None:
            raise ValueError(f"tokenizer {path} lacks the special tokens {EOD!r} and {PAD!r}")

    def tokenize(self, text: str):
        return self._tok.encode(text).ids

    def detokenize(self, ids) -> str:
        return self._tok.decode(list(ids))


def dataset_settings(vocab_size: int) -> dict:
    """What ``dataset.json`` records: the text source and the flags of this script."""
    return {"source": "pydoc_data.topics", "vocab_size": vocab_size}


def dataset_ready(output_dir: str, vocab_size: int, other_use: str = "use another --output-dir") -> bool:
    """True when ``output_dir`` holds the complete dataset of ``vocab_size``, False when it holds none (or an
    interrupted build of these settings). ValueError (one line naming both settings; ``other_use`` says how to get
    the other dataset) when it holds a dataset built with other settings, or dataset files without a record."""
    record = os.path.join(output_dir, SETTINGS_NAME)
    present = [name for name in DATASET_FILES if os.path.exists(os.path.join(output_dir, name))]
    if not os.path.isfile(record):
        if present:
            raise ValueError(f"{output_dir} holds dataset files ({', '.join(present)}) but no {SETTINGS_NAME} "
                             f"recording their settings (an older or interrupted prepare_data.py), so it may not be "
                             f"--vocab-size {vocab_size}: delete the folder to rebuild it, or {other_use}")
        return False
    with open(record) as f:
        recorded = json.load(f)
    if recorded != dataset_settings(vocab_size):
        raise ValueError(f"{output_dir} holds a dataset built with --vocab-size {recorded.get('vocab_size')} "
                         f"({record}), not --vocab-size {vocab_size}: delete the folder to rebuild it, or {other_use}")
    return len(present) == len(DATASET_FILES)


def build(output_dir: str, vocab_size: int = DEFAULT_VOCAB_SIZE) -> str:
    """Write tokenizer.json, the indexed dataset and ``dataset.json`` into ``output_dir``; return the data path
    prefix. ValueError (:func:`dataset_ready`) when the folder holds a dataset built with other settings."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    dataset_ready(output_dir, vocab_size)
    os.makedirs(output_dir, exist_ok=True)
    record = os.path.join(output_dir, SETTINGS_NAME)
    if os.path.exists(record):  # rebuilt below; written again once every file is complete
        os.remove(record)
    texts = documents()
    tokenizer_path = os.path.join(output_dir, "tokenizer.json")
    train_tokenizer(texts, vocab_size).save(tokenizer_path)
    tokenizer = BPETokenizer(tokenizer_path)
    prefix = os.path.join(output_dir, DATA_NAME)
    dtype = np.uint16 if tokenizer.vocab_size < 65500 else np.int32
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    for text in texts:
        ids = tokenizer.tokenize(text) + [tokenizer.eod]
        builder.add_document(torch.tensor(ids), [len(ids)])
    builder.finalize(get_idx_path(prefix))
    with open(record, "w") as f:
        json.dump(dataset_settings(vocab_size), f)
    return prefix


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default="out/data/pydoc")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    args = parser.parse_args(argv)
    try:
        prefix = build(args.output_dir, args.vocab_size)
    except ValueError as err:
        parser.exit(1, f"{parser.prog}: error: {err}\n")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data = IndexedDataset(prefix)
    tokens = int(data.sequence_lengths.sum())
    tokenizer_path = os.path.join(args.output_dir, "tokenizer.json")
    print(f"wrote {prefix}.bin/.idx: {len(data)} documents, {tokens} tokens; tokenizer {tokenizer_path} "
          f"({BPETokenizer(tokenizer_path).vocab_size} entries)")


if __name__ == "__main__":
    main()
