"""Layouts and chain plans: which global tokens a CP rank holds and how the recurrent state flows.

Layouts (P ranks, global sequence length T per row, or T packed tokens with global ``cu_seqlens``):

* ``zigzag`` (Megatron). BSHD: every row is cut into 2P equal parts and rank r holds parts r and 2P-1-r,
  concatenated (``megatron.core.utils.get_batch_on_this_cp_rank``). THD: every document is cut into 2P
  equal parts (length % 2P == 0) and rank r holds, document after document, its parts r and 2P-1-r
  (Transformer Engine's ``thd_get_partitioned_indices``).
* ``contiguous``. BSHD: every row is cut into P equal parts, rank r holds part r. THD: the packed stream is
  cut into P equal parts (T % P == 0), so documents span ranks arbitrarily.

A *chain* is the path of the recurrent state through one BSHD row, one THD document (zigzag) or the whole
packed stream (contiguous THD). Its *positions* are the rank-owned segments in global token order:

* zigzag: L = 2P positions, position t owned by rank t (t < P) or 2P-1-t (t >= P); D = B rows or N docs.
* contiguous: L = P positions, position t owned by rank t; D = B rows, or D = 1 for THD (documents that
  start at a segment boundary cut the chain, see ``link_mask``).

The rank's local tokens (flattened over the batch, ``B * T_local``) are split into *pieces* that never cross
a document or a position boundary (``local_cu_seqlens``); a local op run with these pieces as its varlen
boundaries sees every segment of every document separately.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from layers.base.choices import CP_LAYOUTS as LAYOUTS
from layers.ops.validation import as_cu_seqlens


@dataclass(frozen=True, eq=False)
class ChainPlan:
    """How one rank's local tokens map to global tokens and to chain positions (all tensors CPU int64/bool).

    Fields:
        world_size, rank, layout: the ranks the plan is for (P, this rank's index in the group, layout).
        num_chains: D (B rows for BSHD; N documents for zigzag THD; 1 for contiguous THD).
        chain_length: L (2P for zigzag, P for contiguous).
        owners: owner rank of each chain position, length L (the same for every chain).
        own_positions: positions owned by this rank, ascending (= local token order), length n_own.
        owner_slot: for every position t, its index in ``own_positions`` of its owner, length L.
        link_mask: bool [D, L]; ``link_mask[d, t]`` says the state at the end of position t flows into
            position t + 1 of chain d (False in the last column and where a document starts exactly at the
            start of position t + 1).
        local_cu_seqlens: int64 [n_pieces + 1] piece boundaries over the flattened local tokens.
        entry_piece: int64 [D, n_own]; the local piece that begins the segment at each own position (its
            initial state is the state flowing in from the previous position).
        exit_piece: int64 [D, n_own]; the local piece whose final state ends that segment.
        exit_has_transition: bool [D, n_own]; False where a document starts inside the segment after its
            first token, so the state leaving the segment does not depend on the state entering it (M = 0).
        segment_bounds: int64 [D, n_own, 2]; [start, end) of each own segment in flattened local tokens.
        entry_tokens: int64 [n_ch, C]; the entry pieces' tokens (flattened local ids) in chunks of C tokens, a chunk
            never spanning two pieces; padding slots hold B * T_local. entry_segment: int64 [n_ch]; the own
            segment (flattened ``[D, n_own]`` index) of each chunk. entry_valid: int64 [n_valid], the non-padding
            slots of ``entry_tokens.reshape(-1)``, or None without padding. Where the incoming state is applied.
        local_token_ids: int64 [B * T_local]; the global flat token id of every local token in local order
            (``b * T + t`` for BSHD, ``t`` for THD).
        seq_index: int64 [T_local]; indices along the sequence dimension of a global tensor that give this
            rank's local tokens (one row for BSHD; the packed stream for THD). ``x.index_select(seq_dim,
            seq_index)`` is the shard.
        batch, seq_len, local_len: B, the global T, and T_local = T / P.
    """

    world_size: int
    rank: int
    layout: str
    num_chains: int
    chain_length: int
    owners: tuple
    own_positions: tuple
    owner_slot: tuple
    link_mask: torch.Tensor
    local_cu_seqlens: torch.Tensor
    entry_piece: torch.Tensor
    exit_piece: torch.Tensor
    exit_has_transition: torch.Tensor
    segment_bounds: torch.Tensor
    entry_tokens: torch.Tensor
    entry_segment: torch.Tensor
    entry_valid: torch.Tensor | None
    local_token_ids: torch.Tensor
    seq_index: torch.Tensor
    batch: int
    seq_len: int
    local_len: int

    @property
    def num_pieces(self) -> int:
        return self.local_cu_seqlens.numel() - 1

    @property
    def n_own(self) -> int:
        return len(self.own_positions)

    def link_keep(self, device, dtype) -> torch.Tensor:
        """[D, n_own, 1, 1, 1]: 1 where the state leaving an own segment flows on to the next position, else 0."""
        keep = self.link_mask[:, list(self.own_positions)].to(device, dtype)
        return keep[..., None, None, None]

    def own_summaries(self, final: torch.Tensor):
        """Per-piece final states ``[E | M]`` ``[n_pieces, HV, K, V+K]`` -> ``(M, E)`` of each own position,
        ``[D, n_own, HV, K, K]`` and ``[D, n_own, HV, K, V]``: M is zeroed where a document starts inside the
        segment, and both where the link to the next position is cut (the chain scan then needs no masks)."""
        D, n_own = self.exit_piece.shape
        HV, K, W = final.shape[1:]
        summary = final.index_select(0, self.exit_piece.reshape(-1).to(final.device)).view(D, n_own, HV, K, W)
        keep_link = self.link_keep(final.device, final.dtype)
        keep_m = keep_link * self.exit_has_transition.to(final.device, final.dtype)[..., None, None, None]
        return summary[..., W - K:] * keep_m, summary[..., :W - K] * keep_link

    def entry_states(self, S_in: torch.Tensor) -> torch.Tensor:
        """``[D, n_own, HV, K, V]`` incoming states -> initial states of the local pieces ``[n_pieces, HV, K, V]``
        (S_in at each entry piece, zero elsewhere); differentiable."""
        HV, K, V = S_in.shape[2:]
        return S_in.new_zeros(self.num_pieces, HV, K, V).index_copy(
            0, self.entry_piece.reshape(-1).to(S_in.device), S_in.reshape(-1, HV, K, V))


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def chain_owners(world_size: int, layout: str) -> tuple:
    """Owner rank of every chain position: zigzag ``0..P-1, P-1..0``; contiguous ``0..P-1``."""
    check_layout(layout)
    forward = tuple(range(world_size))
    return forward + tuple(reversed(forward)) if layout == "zigzag" else forward


def normalize_global_cu_seqlens(cu_seqlens) -> torch.Tensor | None:
    """Global packed boundaries as a CPU int64 tensor [N+1] (integers, 0 first, strictly increasing)."""
    return None if cu_seqlens is None else as_cu_seqlens(cu_seqlens)


def check_divisibility(world_size: int, layout: str, seq_len: int, cu_seqlens: torch.Tensor | None) -> None:
    """ValueError naming the constraint when a global sequence cannot be laid out on ``world_size`` ranks."""
    P = world_size
    if cu_seqlens is not None and int(cu_seqlens[-1]) != seq_len:
        raise ValueError(f"cu_seqlens[-1]={int(cu_seqlens[-1])} must equal the packed token count T={seq_len}")
    if layout == "zigzag":
        if cu_seqlens is None:
            if seq_len % (2 * P) != 0:
                raise ValueError(f"zigzag layout needs the sequence length divisible by 2*P={2 * P} "
                                 f"(2 x CP size), got T={seq_len}")
        else:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
            bad = [(i, n) for i, n in enumerate(lengths) if n % (2 * P) != 0]
            if bad:
                raise ValueError(f"zigzag THD layout needs every document length divisible by 2*P={2 * P} "
                                 f"(pad documents as Megatron's cu_seqlens_padded does); (document, length) "
                                 f"pairs violating it: {bad[:8]}")
    else:
        if seq_len % P != 0:
            what = "packed token count" if cu_seqlens is not None else "sequence length"
            raise ValueError(f"contiguous layout needs the {what} divisible by P={P} (CP size), got T={seq_len}")


@lru_cache(maxsize=256)
def _seq_index_cached(world_size, rank, layout, seq_len, cu_key):
    P, r = world_size, rank
    if layout == "contiguous":
        c = seq_len // P
        return torch.arange(r * c, (r + 1) * c, dtype=torch.int64)
    if cu_key is None:
        c = seq_len // (2 * P)
        return torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * P - 1 - r) * c, (2 * P - r) * c)])
    cu = torch.tensor(cu_key, dtype=torch.int64)
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    c = lengths // (2 * P)                                       # part length per document
    # pieces in local order: (doc 0 part r, doc 0 part 2P-1-r, doc 1 part r, ...)
    piece_start = torch.stack([starts + r * c, starts + (2 * P - 1 - r) * c], dim=1).reshape(-1)
    piece_len = torch.stack([c, c], dim=1).reshape(-1)
    return _ranges(piece_start, piece_len)


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of ``arange(s, s + n)`` for every (s, n), vectorized."""
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    offsets = torch.cumsum(lengths, 0) - lengths
    owner = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    return starts[owner] + torch.arange(total) - offsets[owner]


def local_seq_index(world_size: int, rank: int, layout: str, seq_len: int, cu_seqlens=None) -> torch.Tensor:
    """int64 [T/P]: the sequence indices (of one BSHD row, or of the packed THD stream) rank holds, in order."""
    cu = normalize_global_cu_seqlens(cu_seqlens)
    check_layout(layout)
    _check_rank(world_size, rank)
    check_divisibility(world_size, layout, seq_len, cu)
    return _seq_index_cached(world_size, rank, layout, seq_len, None if cu is None else tuple(cu.tolist()))


def _check_rank(world_size, rank):
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")


def build_chain_plan(world_size: int, rank: int, layout: str, *, batch: int, seq_len: int,
                     cu_seqlens=None) -> ChainPlan:
    """The ChainPlan of ``rank`` among ``world_size`` ranks for a global batch.

    ``seq_len`` is the GLOBAL length T (per BSHD row, or the packed THD token count); ``cu_seqlens`` the
    global packed boundaries (then ``batch`` must be 1). Plans are cached per arguments.
    """
    check_layout(layout)
    _check_rank(world_size, rank)
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    cu = normalize_global_cu_seqlens(cu_seqlens)
    if cu is not None and batch != 1:
        raise ValueError(f"packed input (cu_seqlens) needs batch == 1, got batch={batch}")
    check_divisibility(world_size, layout, seq_len, cu)
    return _build_cached(world_size, rank, layout, batch, seq_len, None if cu is None else tuple(cu.tolist()))


def _entry_chunks(local_cu: torch.Tensor, entry: torch.Tensor, num_tokens: int, max_chunk: int = 64):
    """(tokens [n_ch, C], segment [n_ch], valid slots or None) of the pieces ``entry`` (one per segment) cut into
    chunks of C = min(max_chunk, longest piece) tokens; padding slots hold ``num_tokens``."""
    starts = local_cu[entry]
    lengths = local_cu[entry + 1] - starts
    C = max(1, min(max_chunk, int(lengths.max())))
    per_piece = (lengths + C - 1) // C
    segment = torch.repeat_interleave(torch.arange(entry.numel()), per_piece)
    first = torch.cumsum(per_piece, 0) - per_piece
    offset = (torch.arange(segment.numel()) - first[segment])[:, None] * C + torch.arange(C)
    inside = offset < lengths[segment][:, None]
    tokens = torch.where(inside, starts[segment][:, None] + offset, num_tokens)
    valid = None if bool(inside.all()) else inside.reshape(-1).nonzero().squeeze(1)
    return tokens, segment, valid


@lru_cache(maxsize=256)
def _build_cached(P, r, layout, B, T, cu_key) -> ChainPlan:
    owners = chain_owners(P, layout)
    L = len(owners)
    own = tuple(t for t in range(L) if owners[t] == r)
    slot, counters = [], [0] * P
    for o in owners:
        slot.append(counters[o])
        counters[o] += 1
    n_own = len(own)
    seq_index = _seq_index_cached(P, r, layout, T, cu_key)
    T_loc = seq_index.numel()
    local_token_ids = seq_index if cu_key is not None else (
        torch.arange(B).unsqueeze(1) * T + seq_index.unsqueeze(0)).reshape(-1)

    if cu_key is None:
        # BSHD: every row is one chain; every own position is one piece of its row.
        D = B
        piece_len = T_loc // n_own
        local_cu = torch.arange(B * n_own + 1, dtype=torch.int64) * piece_len
        pieces = torch.arange(B * n_own, dtype=torch.int64).reshape(B, n_own)
        entry = exit_ = pieces
        has_tr = torch.ones(D, n_own, dtype=torch.bool)
        link = torch.ones(D, L, dtype=torch.bool)
        link[:, -1] = False
    elif layout == "zigzag":
        # THD zigzag: every document is one chain; its two parts on this rank are two pieces.
        cu = torch.tensor(cu_key, dtype=torch.int64)
        D = cu.numel() - 1
        c = (cu[1:] - cu[:-1]) // (2 * P)
        local_cu = torch.zeros(2 * D + 1, dtype=torch.int64)
        local_cu[1:] = torch.cumsum(c.repeat_interleave(2), 0)
        pieces = torch.arange(2 * D, dtype=torch.int64).reshape(D, 2)
        entry = exit_ = pieces
        has_tr = torch.ones(D, n_own, dtype=torch.bool)
        link = torch.ones(D, L, dtype=torch.bool)
        link[:, -1] = False
    else:
        # THD contiguous: one chain (the stream); pieces are the documents cut at the rank's range.
        cu = torch.tensor(cu_key, dtype=torch.int64)
        D = 1
        c = T // P
        lo, hi = r * c, (r + 1) * c
        inner = cu[(cu > lo) & (cu < hi)]
        local_cu = torch.cat([torch.tensor([lo]), torch.unique(inner), torch.tensor([hi])]) - lo
        n_pieces = local_cu.numel() - 1
        entry = torch.zeros(1, 1, dtype=torch.int64)
        exit_ = torch.full((1, 1), n_pieces - 1, dtype=torch.int64)
        has_tr = torch.tensor([[n_pieces == 1]])
        boundaries = torch.arange(1, P, dtype=torch.int64) * c
        starts_doc = torch.isin(boundaries, cu)     # a document starts exactly at position t+1's start
        link = torch.zeros(1, L, dtype=torch.bool)
        link[0, :-1] = ~starts_doc
    seg_lo = local_cu[entry]
    seg_hi = local_cu[exit_ + 1]
    entry_tokens, entry_segment, entry_valid = _entry_chunks(local_cu, entry.reshape(-1), B * T_loc)
    return ChainPlan(world_size=P, rank=r, layout=layout, num_chains=D, chain_length=L, owners=owners,
                     own_positions=own, owner_slot=tuple(slot), link_mask=link, local_cu_seqlens=local_cu,
                     entry_piece=entry, exit_piece=exit_, exit_has_transition=has_tr,
                     segment_bounds=torch.stack([seg_lo, seg_hi], dim=-1), entry_tokens=entry_tokens,
                     entry_segment=entry_segment, entry_valid=entry_valid, local_token_ids=local_token_ids,
                     seq_index=seq_index, batch=B, seq_len=T, local_len=T_loc)
