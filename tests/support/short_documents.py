"""Packed-document data for the tests: the pydoc dataset's tokens cut into short documents, so every 32-token
sample holds several and documents cross CP ranks' shares (tests/example/test_pretrain_qwen3_5.py,
tests/megatron_lm/test_megatron_lm_hf_config.py)."""
import os
import shutil
import sys

import numpy as np
import torch

from tests.support.paths import EXAMPLE


def write_short_documents(source: str, target: str) -> str:
    """``target``: the pydoc dataset's tokenizer and its tokens cut into documents of 3..20 tokens (each ending in
    the end-of-document token), under the pydoc dataset's file names."""
    from megatron.core.datasets.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder, get_bin_path,
                                                        get_idx_path)

    os.makedirs(target)
    shutil.copy(os.path.join(source, "tokenizer.json"), target)
    if EXAMPLE not in sys.path:
        sys.path.insert(0, EXAMPLE)
    from prepare_data import BPETokenizer

    eod = BPETokenizer(os.path.join(target, "tokenizer.json")).eod
    pydoc = IndexedDataset(os.path.join(source, "pydoc_text_document"))   # memory-mapped: copy before it closes
    tokens = np.concatenate([np.array(pydoc[i], copy=True) for i in range(8)])
    del pydoc
    tokens = tokens[tokens != eod]
    lengths = np.random.default_rng(0).integers(3, 21, size=len(tokens) // 3)
    prefix = os.path.join(target, "pydoc_text_document")
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=tokens.dtype.type)
    start = 0
    for n in lengths:
        if start + n > len(tokens):
            break
        builder.add_document(torch.tensor(np.append(tokens[start:start + n], eod).astype(np.int64)), [n + 1])
        start += n
    builder.finalize(get_idx_path(prefix))
    return target
