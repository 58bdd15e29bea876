"""Chunk layout: where each token of each sequence sits in a flat list of fixed-size chunks.

Chunks never cross sequence boundaries; each sequence is padded to a multiple of the chunk size with
identity steps (k = v = 0, beta = 0, g = 0). Chunks are stored *step-major*: all sequences' first chunks,
then all second chunks, ..., with sequences sorted by chunk count (longest first), so the sequential
state pass over step j touches a contiguous block of chunks and a prefix of the (sorted) states.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class ChunkLayout:
    chunk_size: int
    num_tokens: int                 # flat tokens B*T
    num_seqs: int                   # N
    num_chunks: int                 # total chunks over all sequences
    gather_index: torch.Tensor      # int64 [num_chunks*C]: flat token per chunk slot, num_tokens = padding
    scatter_index: torch.Tensor     # int64 [num_tokens]: chunk slot of each flat token
    seq_order: torch.Tensor         # int64 [N]: sorted position -> sequence index
    seq_inverse: torch.Tensor       # int64 [N]: sequence index -> sorted position
    step_offsets: tuple             # first chunk of each step
    step_counts: tuple              # active sequences (a prefix of the sorted order) at each step
    dense: bool                     # equal-length rows without cu_seqlens: chunking is pad + reshape

    def to(self, device) -> "ChunkLayout":
        if self.gather_index.device == torch.device(device):
            return self
        return ChunkLayout(self.chunk_size, self.num_tokens, self.num_seqs, self.num_chunks,
                           self.gather_index.to(device), self.scatter_index.to(device), self.seq_order.to(device),
                           self.seq_inverse.to(device),
                           self.step_offsets, self.step_counts, self.dense)


def chunk_size_for(longest: int, max_chunk: int) -> int:
    """``max_chunk``, or the smallest power of two that holds ``longest`` tokens when that is shorter: sequences all
    shorter than a chunk are not padded to a whole one."""
    return min(max_chunk, 1 << max(longest - 1, 0).bit_length())


@lru_cache(maxsize=64)
def _build(batch: int, seq_len: int, cu_key: tuple | None, max_chunk: int) -> ChunkLayout:
    if cu_key is None:
        starts = torch.arange(batch, dtype=torch.int64) * seq_len
        lengths = torch.full((batch,), seq_len, dtype=torch.int64)
    else:
        cu = torch.tensor(cu_key, dtype=torch.int64)
        starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    chunk_size = chunk_size_for(int(lengths.max()) if len(lengths) else 1, max_chunk)
    num_tokens = batch * seq_len
    chunks = (lengths + chunk_size - 1) // chunk_size
    order = torch.argsort(-chunks, stable=True)
    chunks_sorted = chunks[order]
    max_chunks = int(chunks_sorted[0]) if len(chunks_sorted) else 0
    steps = torch.arange(max_chunks)
    active = steps[:, None] < chunks_sorted[None, :]            # [steps, N] (prefix-shaped rows)
    step_idx, seq_rank = active.nonzero(as_tuple=True)          # step-major chunk slots
    seq = order[seq_rank]
    offs = torch.arange(chunk_size)
    pos = step_idx[:, None] * chunk_size + offs[None, :]        # position inside the sequence
    valid = pos < lengths[seq][:, None]
    gather = torch.where(valid, starts[seq][:, None] + pos, torch.full_like(pos, num_tokens)).reshape(-1)
    scatter = torch.empty(num_tokens, dtype=torch.int64)
    slots = torch.arange(gather.numel())
    keep = gather < num_tokens
    scatter[gather[keep]] = slots[keep]
    counts = active.sum(1)
    offsets = torch.cumsum(counts, 0) - counts
    return ChunkLayout(chunk_size, num_tokens, len(lengths), int(step_idx.numel()), gather, scatter, order,
                       torch.argsort(order),
                       tuple(offsets.tolist()), tuple(counts.tolist()), cu_key is None)


def chunk_layout(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None, max_chunk: int,
                 device) -> ChunkLayout:
    """Layout for [B, T] input (or [1, T] with CPU ``cu_seqlens``), cached per shape and boundaries.

    Chunks hold ``max_chunk`` tokens, or the smallest power of two that holds the longest sequence when that is
    shorter (a CP rank's pieces of short documents are not padded to a whole chunk)."""
    key = None if cu_seqlens is None else tuple(cu_seqlens.tolist())
    return _on_device(batch, seq_len, key, max_chunk, str(torch.device(device)))


@lru_cache(maxsize=64)
def _on_device(batch, seq_len, cu_key, max_chunk, device: str) -> ChunkLayout:
    """The cached layout with its index tensors on ``device`` (copied once, not per call)."""
    return _build(batch, seq_len, cu_key, max_chunk).to(device)


def to_chunks(x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """[B, T, HV, *F] -> [num_chunks, HV, C, *F] (zero padding), differentiable."""
    if layout.dense:   # slot j*B + b holds chunk j of row b
        B, T, C = x.shape[0], x.shape[1], layout.chunk_size
        n = layout.num_chunks // B
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, n * C - T)) if n * C != T else x
        x = x.view(B, n, C, *x.shape[2:]).transpose(0, 1).transpose(2, 3)
        return x.reshape(n * B, *x.shape[2:])
    flat = x.reshape(layout.num_tokens, *x.shape[2:])
    flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
    y = flat.index_select(0, layout.gather_index).view(layout.num_chunks, layout.chunk_size, *x.shape[2:])
    return y.transpose(1, 2)


def from_chunks(y: torch.Tensor, layout: ChunkLayout, batch: int, seq_len: int) -> torch.Tensor:
    """[num_chunks, HV, C, *F] -> [B, T, HV, *F], dropping padding, differentiable."""
    if layout.dense:
        n, C = layout.num_chunks // batch, layout.chunk_size
        x = y.view(n, batch, *y.shape[1:]).transpose(0, 1).transpose(2, 3)
        return x.reshape(batch, n * C, *x.shape[3:])[:, :seq_len]
    flat = y.transpose(1, 2).reshape(layout.num_chunks * layout.chunk_size, *y.shape[1:2], *y.shape[3:])
    return flat.index_select(0, layout.scatter_index).view(batch, seq_len, *flat.shape[1:])
