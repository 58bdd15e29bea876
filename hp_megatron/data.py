"""Context-parallel batch slicing for Megatron's BSHD and THD layouts, without Transformer Engine.

``zigzag`` (Megatron's load-balanced layout; the default):
  * BSHD: each row's sequence is cut into 2P equal parts; CP rank r keeps parts r and 2P-1-r, in that
    order (``megatron.core.utils.get_batch_on_this_cp_rank``).
  * THD (packed, batch 1): every document, at its *padded* length, is cut into 2P equal parts and rank r
    keeps its parts r and 2P-1-r of each document, document after document (Transformer Engine's
    ``thd_get_partitioned_indices``, used by megatron's ``get_thd_batch_on_this_cp_rank``).
``contiguous`` (for pure linear-attention models): rank r keeps the r-th of P equal parts of each row
  (BSHD) or of the packed stream (THD).
"""
from __future__ import annotations

from typing import Optional

import torch

LAYOUTS = ("zigzag", "contiguous")


def _check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"CP layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _ranges(starts: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """Concatenation of ``arange(s, s + n)`` for every (s, n) pair (vectorized)."""
    length = length.to(torch.int64)
    total = int(length.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    first = torch.repeat_interleave(starts.to(torch.int64), length)
    seg_start = torch.repeat_interleave(torch.cumsum(length, 0) - length, length)
    return first + torch.arange(total, dtype=torch.int64) - seg_start


def cp_token_index(seq_len: int, cp_size: int, cp_rank: int, cu_seqlens: Optional[torch.Tensor] = None,
                   layout: str = "zigzag") -> torch.Tensor:
    """Global token positions held by ``cp_rank``, in local order (int64, CPU).

    ``seq_len`` is the row length (BSHD) or the packed token count (THD, equal to ``cu_seqlens[-1]``);
    ``cu_seqlens`` (``[N+1]``, padded boundaries) selects THD.
    """
    _check_layout(layout)
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"need 0 <= cp_rank < cp_size, got cp_rank={cp_rank}, cp_size={cp_size}")
    if cu_seqlens is None or layout == "contiguous":
        if cu_seqlens is not None and int(cu_seqlens[-1]) != seq_len:
            raise ValueError(f"packed length {seq_len} differs from cu_seqlens[-1]={int(cu_seqlens[-1])}")
        parts = 2 * cp_size if layout == "zigzag" else cp_size
        if seq_len % parts:
            raise ValueError(f"sequence length {seq_len} must be divisible by {parts} "
                             f"({'2 x ' if layout == 'zigzag' else ''}context-parallel size {cp_size}) "
                             f"for the {layout} layout")
        chunk = seq_len // parts
        owned = [cp_rank, parts - 1 - cp_rank] if layout == "zigzag" else [cp_rank]
        return _ranges(torch.tensor(owned) * chunk, torch.full((len(owned),), chunk))
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int64).cpu()
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must be a non-decreasing 1-D tensor starting at 0, got {cu.tolist()}")
    if int(cu[-1]) != seq_len:
        raise ValueError(f"packed length {seq_len} differs from cu_seqlens[-1]={int(cu[-1])}")
    lengths = cu[1:] - cu[:-1]
    bad = (lengths % (2 * cp_size)).nonzero().flatten()
    if bad.numel():
        raise ValueError(f"every (padded) document length must be divisible by 2 x context-parallel size = "
                         f"{2 * cp_size}; documents {bad.tolist()} have lengths {lengths[bad].tolist()}")
    chunk = lengths // (2 * cp_size)
    # per document: part r, then part 2P-1-r
    starts = torch.stack([cu[:-1] + cp_rank * chunk, cu[:-1] + (2 * cp_size - 1 - cp_rank) * chunk], 1)
    return _ranges(starts.flatten(), chunk.repeat_interleave(2))


def _cp_group_of(packed_seq_params, cp_group):
    if cp_group is not None:
        return cp_group
    group = getattr(packed_seq_params, "cp_group", None) if packed_seq_params is not None else None
    if group is not None and getattr(packed_seq_params, "local_cp_size", None):
        return group
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


def get_batch_on_this_cp_rank(batch: dict, packed_seq_params=None, *, cp_group=None, layout: str = "zigzag"):
    """This CP rank's share of a micro-batch dict of tensors; a new dict, other values unchanged.

    BSHD: tensors are ``[b, s, ...]`` (``attention_mask`` ``[b, 1, s, s]`` is sliced on its query axis,
    dim 2). THD (``packed_seq_params.qkv_format == "thd"``): tensors are ``[1, t]`` over the packed stream
    and the split follows ``cu_seqlens_q_padded`` (or ``cu_seqlens_q``); ``attention_mask`` must be None.
    The CP group is ``cp_group``, else ``packed_seq_params.cp_group`` when it carries a ``local_cp_size``
    (megatron's hybrid CP), else ``parallel_state``'s context-parallel group.
    """
    _check_layout(layout)
    group = _cp_group_of(packed_seq_params, cp_group)
    cp_size = group.size() if group is not None else 1
    if cp_size == 1:
        return dict(batch)
    cp_rank = group.rank()
    thd = packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd"
    cu = None
    if thd:
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        if cu is None:
            raise ValueError("THD batches need packed_seq_params.cu_seqlens_q(_padded)")
    out, index_cache = {}, {}
    for key, value in batch.items():
        if value is None or not isinstance(value, torch.Tensor):
            out[key] = value
            continue
        seq_dim = 2 if key == "attention_mask" else 1
        if thd and key == "attention_mask":
            raise ValueError("THD batches carry no attention_mask (document boundaries come from cu_seqlens)")
        if value.dim() <= seq_dim:
            raise ValueError(f"batch[{key!r}] has shape {tuple(value.shape)}; expected a sequence axis at dim "
                             f"{seq_dim}")
        if thd and value.shape[0] != 1:
            raise ValueError(f"THD batches have batch size 1, batch[{key!r}] has shape {tuple(value.shape)}")
        seq_len = value.shape[seq_dim]
        if (seq_len, value.device) not in index_cache:
            index_cache[(seq_len, value.device)] = cp_token_index(
                seq_len, cp_size, cp_rank, cu, layout).to(value.device)
        out[key] = value.index_select(seq_dim, index_cache[(seq_len, value.device)])
    return out
