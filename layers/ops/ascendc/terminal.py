"""Terminal state gradients (``dht``) through dummy tokens, for fla-npu kernels that ignore ``dht``.

fla-npu's reverse state pass ``ChunkGatedDeltaRuleBwdDhu`` does ``(void)dht;`` in every revision read, and the
composite ``aclnnChunkGatedDeltaRuleBwd`` hands ``dht`` to that same kernel (docs/backends.md). So the gradient
of ``<S_final, dht>`` enters through tokens appended to a sequence instead, the way fla-npu's own CP examples do:

1. pad the sequence to the chunk grid with state-neutral tokens (q = k = v = 0, per-token log gate 0, so the
   cumulative gate is held and the state passes unchanged), then
2. append K tokens (two chunks of 64 for K = 128) with ``q_j = e_j`` and k = v = 0, gate 0: the state does not
   change, token j outputs ``o_j = scale S^T e_j`` (row j of the final state, times scale), and an upstream
   gradient ``d o_j = dht[j, :] / scale`` adds ``sum_j scale e_j (dht[j, :] / scale) = dht`` to the gradient of
   the state leaving the last real chunk, exactly.

:class:`Extension` is the host-side plan (which sequences get a tail, their extended boundaries) and cuts the
real tokens / chunks back out. Cost: up to ``chunk - 1 + K`` (191) extra tokens per sequence with a tail.
"""
from __future__ import annotations

import torch


class Extension:
    """Sequences of ``lengths`` tokens (one per batch row when ``packed`` is False), each with ``tails[n]``:
    padded to the chunk grid and followed by ``extra`` dummy tokens."""

    def __init__(self, lengths: list[int], tails: list[bool], chunk: int, extra: int, packed: bool):
        if len(lengths) != len(tails):
            raise ValueError(f"one tail flag per sequence: {len(lengths)} lengths, {len(tails)} flags")
        self.lengths, self.tails, self.chunk, self.extra, self.packed = lengths, tails, chunk, extra, packed
        self.pads = [(-L % chunk) if t else 0 for L, t in zip(lengths, tails)]
        self.ext_lengths = [L + p + (extra if t else 0) for L, p, t in zip(lengths, self.pads, tails)]
        self.starts = [0] + torch.tensor(self.ext_lengths[:-1], dtype=torch.int64).cumsum(0).tolist()

    @classmethod
    def of(cls, cu, T: int, tails: list[bool] | bool, chunk: int, extra: int):
        """Plan for host boundaries ``cu`` (None: every batch row is one sequence of ``T`` tokens)."""
        lengths = [T] if cu is None else [e - s for s, e in zip(cu[:-1], cu[1:])]
        flags = [tails] * len(lengths) if isinstance(tails, bool) else list(tails)
        return cls(lengths, flags, chunk, extra, cu is not None)

    @property
    def cu(self):
        """Extended host boundaries (None for the dense layout)."""
        return [0] + torch.tensor(self.ext_lengths, dtype=torch.int64).cumsum(0).tolist() if self.packed else None

    @property
    def tokens(self) -> int:
        return sum(self.ext_lengths)

    def extend(self, x, dim: int, tail=None, hold_last: bool = False):
        """``x`` with its token axis ``dim`` extended: per sequence n its tokens, the padding (zeros, or the last
        token repeated with ``hold_last``), then ``tail(n)`` (``extra`` tokens along ``dim``; zeros if None)."""
        parts, start = [], 0
        for n, (L, pad, has_tail) in enumerate(zip(self.lengths, self.pads, self.tails)):
            parts.append(x.narrow(dim, start, L))
            if pad:
                edge = x.narrow(dim, start + L - 1, 1) if hold_last else torch.zeros_like(x.narrow(dim, 0, 1))
                parts.append(edge.expand(*x.shape[:dim], pad, *x.shape[dim + 1:]))
            if has_tail:
                shape = (*x.shape[:dim], self.extra, *x.shape[dim + 1:])
                parts.append(x.new_zeros(shape) if tail is None else tail(n).to(x.dtype).expand(shape))
            start += L
        return torch.cat(parts, dim).contiguous()

    def token_index(self, device) -> torch.Tensor:
        """Positions of the real tokens in the extended token axis."""
        return torch.cat([torch.arange(a, a + L) for a, L in zip(self.starts, self.lengths)]).to(device)

    def tail_index(self, n: int, device) -> torch.Tensor:
        """Positions of sequence n's dummy tokens."""
        first = self.starts[n] + self.lengths[n] + self.pads[n]
        return torch.arange(first, first + self.extra, device=device)

    def chunk_index(self, device) -> torch.Tensor:
        """Positions of the real chunks in the extended chunk axis (each sequence's chunks follow the previous
        sequences' ceil(length / chunk) chunks)."""
        C, index, offset = self.chunk, [], 0
        for L, ext in zip(self.lengths, self.ext_lengths):
            index.append(torch.arange(offset, offset + -(-L // C)))
            offset += -(-ext // C)
        return torch.cat(index).to(device)

    def real(self, x, dim: int):
        """The real tokens of an extended tensor (token axis ``dim``)."""
        return x.index_select(dim, self.token_index(x.device))
