"""Packed documents in the example (``--reset-position-ids --reset-attention-mask``): a packed micro-batch run
under CP2 gives every token the loss it gets when its document runs alone on one rank.

One 2-rank spawn: the example's model (pattern GKMA: GDN, KDA, MLA, attention) reads a micro-batch of two
rows holding five documents through the example's ``BatchLoader`` (packing to THD, padding each document
to a multiple of 2 x CP, ``hp_megatron.data.get_batch_on_this_cp_rank``); the per-token losses of both CP
ranks are put back in document order and compared with the same weights run on each document alone
(CP1, BSHD, positions from 0).
"""
import os
import sys

import torch

from tests.support.dist import run_distributed
from tests.support.paths import EXAMPLE

SEQ = 32
ROWS = ((5, 11, 16), (9, 23))  # document lengths per sample row (each row: SEQ tokens)
VOCAB = 512


def _argv(data_dir, cp):
    return ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
            "--seq-length", str(SEQ), "--micro-batch-size", "2", "--global-batch-size", str(4 // cp),
            "--hp-layer-pattern", "GKMA", "--context-parallel-size", str(cp), "--reset-position-ids",
            "--reset-attention-mask", "--data-path", os.path.join(data_dir, "pydoc_text_document"),
            "--tokenizer", os.path.join(data_dir, "tokenizer.json"), "--no-progress"]


def _samples():
    """Two dataset samples (the dicts GPTDataset returns) with positions restarting at every document."""
    gen = torch.Generator().manual_seed(5)
    samples = []
    for lengths in ROWS:
        tokens = torch.randint(0, VOCAB, (SEQ + 1,), generator=gen)
        positions = torch.cat([torch.arange(n) for n in lengths])
        samples.append({"tokens": tokens[:-1], "labels": tokens[1:], "loss_mask": torch.ones(SEQ),
                        "position_ids": positions})
    return samples


def _build(argv):
    import pretrain_hybrid
    from prepare_data import BPETokenizer

    args = pretrain_hybrid.parse_args(argv)
    device = pretrain_hybrid.initialize(args)
    tokenizer = BPETokenizer(args.tokenizer)
    vocab = pretrain_hybrid.pad_vocab(tokenizer.vocab_size, args.tensor_model_parallel_size)
    config = pretrain_hybrid.build_config(args, vocab)
    return args, device, tokenizer, pretrain_hybrid.build_model(args, config, vocab)


def _worker(rank, world_size, data_dir):
    if EXAMPLE not in sys.path:
        sys.path.insert(0, EXAMPLE)
    from megatron.core import parallel_state

    from hp_megatron.data import cp_token_index
    from training import BatchLoader

    samples = _samples()
    args, device, tokenizer, model = _build(_argv(data_dir, cp=2))
    model.eval()
    batch = BatchLoader(samples, args, device, tokenizer.pad)._micro_batch(0)
    params = batch["packed_seq_params"]
    with torch.no_grad():
        local = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                      packed_seq_params=params).reshape(-1)
    cp_group = parallel_state.get_context_parallel_group()
    gathered = [torch.empty_like(local) for _ in range(2)]
    torch.distributed.all_gather(gathered, local, group=cp_group)
    cu = params.cu_seqlens_q_padded.to(torch.int64)
    total = int(cu[-1])
    packed = torch.empty(total)
    for r in range(2):
        packed[cp_token_index(total, 2, r, cu)] = gathered[r]
    weights = {k: v.clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}
    parallel_state.destroy_model_parallel()

    _, _, _, single = _build(_argv(data_dir, cp=1))
    single.load_state_dict(weights)
    single.eval()
    out = []
    doc = 0
    for sample, lengths in zip(samples, ROWS):
        start = 0
        for n in lengths:
            with torch.no_grad():
                alone = single(sample["tokens"][None, start:start + n].long(), torch.arange(n)[None], None,
                               labels=sample["labels"][None, start:start + n].long()).reshape(-1)
            in_pack = packed[int(cu[doc]):int(cu[doc]) + n]
            out.append((n, int(cu[doc + 1] - cu[doc]), in_pack, alone))
            start, doc = start + n, doc + 1
    parallel_state.destroy_model_parallel()
    return out


def test_packed_cp2_batch_equals_documents_one_by_one(pydoc_data):
    results = run_distributed(_worker, 2, pydoc_data)
    for rank_results in results:
        assert len(rank_results) == sum(len(r) for r in ROWS)
        for n, padded, in_pack, alone in rank_results:
            assert padded % 4 == 0 and padded - n < 4, (n, padded)  # padded to 2 x CP, no more
            torch.testing.assert_close(in_pack, alone, rtol=1e-4, atol=1e-5)
