"""Packed documents (Megatron-LM's ``--reset-position-ids --reset-attention-mask``) as one THD row.

A micro-batch of ``b`` samples of ``s`` tokens (GPTDataset with ``reset_position_ids``: positions restart
at 0 after every EOD and at every sample start) becomes one packed row of the documents, each padded at
its end to a multiple of ``multiple`` tokens (``2 x CP`` for the zigzag CP split, ``CP`` for the
contiguous one, times TP under sequence parallelism). Padding tokens come after their document's real
tokens, so causally they never influence them; their loss mask is 0. The padded boundaries are the
documents of the ``PackedSeqParams`` (``cu_seqlens_q == cu_seqlens_q_padded``).
"""
from __future__ import annotations

import torch

PACKED_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def document_multiple(cp_size: int, layout: str, tp_size: int = 1, sequence_parallel: bool = False) -> int:
    """Padded document lengths must be multiples of this for the CP split (and the SP split of the row)."""
    multiple = 2 * cp_size if (layout == "zigzag" and cp_size > 1) else cp_size
    return multiple * (tp_size if sequence_parallel else 1)


def pack_documents(batch: dict, pad_id: int, multiple: int):
    """``batch`` of ``[b, s]`` tensors (``PACKED_KEYS``) -> (dict of ``[1, T]`` tensors, PackedSeqParams).

    Documents are cut where ``position_ids == 0``; each is padded to a multiple of ``multiple``
    (tokens and labels with ``pad_id``, loss mask 0, positions continuing). ``T`` is the padded total.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    if multiple < 1:
        raise ValueError(f"multiple must be positive, got {multiple}")
    positions = batch["position_ids"].reshape(-1)
    n = positions.numel()
    device = positions.device
    starts = (positions == 0).nonzero().flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("packed micro-batches need position ids that restart at 0 (--reset-position-ids)")
    lengths = torch.diff(starts, append=torch.tensor([n], device=device))
    padded = (lengths + multiple - 1) // multiple * multiple
    cu = torch.zeros(padded.numel() + 1, dtype=torch.int64, device=device)
    cu[1:] = torch.cumsum(padded, 0)
    total = int(cu[-1])
    doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
    dest = cu[:-1][doc] + torch.arange(n, device=device) - starts[doc]
    packed = {}
    for key, fill in (("tokens", pad_id), ("labels", pad_id), ("loss_mask", 0)):
        flat = batch[key].reshape(-1)
        out = flat.new_full((total,), fill)
        out[dest] = flat
        packed[key] = out.view(1, total)
    packed["position_ids"] = (torch.arange(total, device=device)
                              - torch.repeat_interleave(cu[:-1], padded)).view(1, total)
    cu32 = cu.to(torch.int32)
    longest = int(padded.max())
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu32, cu_seqlens_kv=cu32, cu_seqlens_q_padded=cu32,
                             cu_seqlens_kv_padded=cu32, max_seqlen_q=longest, max_seqlen_kv=longest)
    return packed, params
