"""Eager causal attention through ``torch.nn.functional.scaled_dot_product_attention``.

Shapes: q ``[B, Sq, H, Dk]``, k ``[B, T, H, Dk]``, v ``[B, T, H, Dv]`` -> o ``[B, Sq, H, Dv]``. Keys are
the whole sequence of each row in global order. ``q_ids`` (int64 ``[Sq]``, the global ids of the
queries, shared by all rows) defaults to ``arange(T)``; ``cu_seqlens`` (global document boundaries,
B == 1) makes the mask block-diagonal causal. Masks exist only per query block (``masking.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .masking import query_blocks


def _sdpa(q, k, v, scale, mask=None, causal=False):
    # [B, S, H, D] -> [B, H, S, D] for sdpa, and back.
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, is_causal=causal, scale=scale)
    return out.transpose(1, 2)


def eager_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                           q_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                           block_size: int = 1024) -> torch.Tensor:
    """Causal (per-document when cu_seqlens is given) softmax attention; see the module docstring."""
    num_keys = k.shape[1]
    if q_ids is None and cu_seqlens is None:
        if q.shape[1] != num_keys:
            raise ValueError(f"without q_ids the queries must be the whole sequence: Sq={q.shape[1]} != T={num_keys}")
        return _sdpa(q, k, v, scale, causal=True)
    if q_ids is None:
        q_ids = torch.arange(num_keys)
    if q_ids.numel() != q.shape[1]:
        raise ValueError(f"q_ids has {q_ids.numel()} ids for {q.shape[1]} queries")
    pieces = []
    for blk in query_blocks(q_ids, cu_seqlens, num_keys, block_size):
        qb = q[:, blk.q_begin:blk.q_end]
        kb, vb = k[:, blk.k_begin:blk.k_end], v[:, blk.k_begin:blk.k_end]
        if blk.mask is None:
            pieces.append(_sdpa(qb, kb, vb, scale, causal=True))
        else:
            pieces.append(_sdpa(qb, kb, vb, scale, mask=blk.mask.to(q.device)))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
