"""Causal visibility of packed/zigzag tokens, computed per query block (never an O(T^2) mask).

Keys are always the whole sequence in global order (key j is global token j of its row). A query with
global id ``i`` sees key ``j`` iff ``j <= i`` and ``j`` lies in the same document (``j >= start(i)``,
the start of i's document; 0 without ``cu_seqlens``). Queries may be any subset of tokens in any order
(a CP rank's zigzag shard). Block bounds are computed once on the host, so the kernels never sync.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QueryBlock:
    """Queries ``[q_begin, q_end)`` in local order read keys ``[k_begin, k_end)``; ``mask`` is None when
    the block is a plain causal square (query ids k_begin..k_end-1 in order, one document)."""
    q_begin: int
    q_end: int
    k_begin: int
    k_end: int
    mask: torch.Tensor | None  # bool [q_end-q_begin, k_end-k_begin], True = attend


def document_starts(q_ids: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Start (global id) of the document of each query id; zeros without cu_seqlens."""
    if cu_seqlens is None:
        return torch.zeros_like(q_ids)
    cu = cu_seqlens.to(device=q_ids.device, dtype=torch.int64)
    doc = torch.searchsorted(cu, q_ids, right=True) - 1
    return cu[doc]


def query_blocks(q_ids: torch.Tensor, cu_seqlens: torch.Tensor | None, num_keys: int,
                 block_size: int = 1024) -> list[QueryBlock]:
    """Split queries (int64 global ids, local order) into blocks with their key window and mask.

    Raises ValueError when an id is outside ``[0, num_keys)`` or cu_seqlens does not end at num_keys.
    """
    if q_ids.dim() != 1:
        raise ValueError(f"q_ids must be 1-D, got shape {tuple(q_ids.shape)}")
    ids = q_ids.detach().to("cpu", torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_keys):
        raise ValueError(f"query ids must lie in [0, {num_keys}), got range [{int(ids.min())}, {int(ids.max())}]")
    if cu_seqlens is not None:
        cu = cu_seqlens.detach().to("cpu", torch.int64)
        if int(cu[0]) != 0 or int(cu[-1]) != num_keys:
            raise ValueError(f"cu_seqlens must run from 0 to the number of keys {num_keys}, got "
                             f"{cu.tolist()}")
    else:
        cu = None
    starts = document_starts(ids, cu)
    blocks = []
    for begin in range(0, ids.numel(), block_size):
        end = min(begin + block_size, ids.numel())
        gid, start = ids[begin:end], starts[begin:end]
        k_begin, k_end = int(start.min()), int(gid.max()) + 1
        contiguous = (bool((gid == torch.arange(k_begin, k_begin + gid.numel())).all())
                      and k_end - k_begin == gid.numel())
        if contiguous and bool((start == k_begin).all()):
            blocks.append(QueryBlock(begin, end, k_begin, k_end, None))
            continue
        keys = torch.arange(k_begin, k_end)
        mask = (keys[None, :] <= gid[:, None]) & (keys[None, :] >= start[:, None])
        blocks.append(QueryBlock(begin, end, k_begin, k_end, mask))
    return blocks
