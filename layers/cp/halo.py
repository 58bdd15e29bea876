"""The short-convolution halo: the W-1 tokens before each local piece in chain order, from their owners.

A depthwise causal conv of width W at a rank's piece needs the W-1 global tokens that precede the piece's
first token in its document (zeros before the document start). Those tokens belong to whichever ranks own
them under the layout; a piece shorter than W-1 makes its successors reach further back, possibly across
several ranks. The exchange pattern is a pure function of the layout, so every rank derives the whole pattern
itself (no metadata exchange):

* ownership changes only at chain-position starts, so the candidates are the W-1 tokens before every
  position start (clipped to its document);
* token g is needed by rank q iff q owns a token g' of the same document with 0 < g' - g <= W-1 and g is not
  q's own; every (q, g) pair is sent once, in ascending g, by g's owner.

One batch of point-to-point messages, only between ranks that share a boundary (``collectives.send_recv``,
differentiable: backward returns the halo gradients to their owners), moves the tokens; each piece's history
``[W-1, D]`` is then gathered from ``[local tokens | received | zero row]`` and the backend's conv runs once
over all local pieces with ``cu_seqlens`` = the pieces. The conv always uses the full P-rank layout of the
op's input (``ctx.plan_for``), whatever the state method (Ulysses included).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache

import torch

from layers.cp.collectives import send_recv
from layers.cp.plan import ChainPlan


@dataclass(frozen=True, eq=False)
class HaloPattern:
    """What one rank sends, receives and gathers for a conv of width W (CPU int64 tensors).

    send_index: local flat token indices to send, grouped by destination rank (ascending), [n_send].
    send_counts / recv_counts: tokens sent to / received from every rank of the group (length P).
    piece_cu_seqlens: the plan's local pieces without empty ones, [n_pieces + 1].
    history_index: [n_pieces, W-1] rows of ``cat([local tokens (n_local), received (n_recv), zero row])``.
    communicates: whether any rank of the group sends anything (the same on every rank).
    """

    send_index: torch.Tensor
    send_counts: tuple
    recv_counts: tuple
    piece_cu_seqlens: torch.Tensor
    history_index: torch.Tensor
    communicates: bool
    device_copies: dict  # (name, device) -> the index tensor on that device

    def index_on(self, name: str, device: torch.device) -> torch.Tensor:
        """``send_index`` / ``history_index`` on ``device`` (copied once per device)."""
        key = (name, device)
        if key not in self.device_copies:
            self.device_copies[key] = getattr(self, name).to(device)
        return self.device_copies[key]


class _GlobalLayout:
    """Vectorized owner / local index / document bounds of global flat token ids for one layout."""

    def __init__(self, layout: str, P: int, B: int, T: int, cu: torch.Tensor | None):
        self.layout, self.P, self.B, self.T, self.cu = layout, P, B, T, cu

    def doc_bounds(self, ids: torch.Tensor):
        """[start, end) of the document (BSHD: the row) holding each id."""
        if self.cu is None:
            start = torch.div(ids, self.T, rounding_mode="floor") * self.T
            return start, start + self.T
        n = torch.searchsorted(self.cu, ids, right=True) - 1
        return self.cu[n], self.cu[n + 1]

    def owner_and_local(self, ids: torch.Tensor):
        """Owner rank and index among the owner's flattened local tokens of each global id."""
        P, T = self.P, self.T
        if self.layout == "contiguous":
            chunk = T // P
            t = ids % T if self.cu is None else ids
            row = torch.div(ids, T, rounding_mode="floor") if self.cu is None else torch.zeros_like(ids)
            owner = torch.div(t, chunk, rounding_mode="floor")
            return owner, row * chunk + t % chunk
        start, end = self.doc_bounds(ids)
        part = torch.div(end - start, 2 * P, rounding_mode="floor")  # zigzag part length of the document
        t = ids - start
        c = torch.div(t, part, rounding_mode="floor")
        first_half = c < P
        owner = torch.where(first_half, c, 2 * P - 1 - c)
        within = t - c * part + torch.where(first_half, torch.zeros_like(part), part)
        # every earlier row / document contributes length / P tokens to each rank
        base = (torch.div(ids, T, rounding_mode="floor") * (T // P)) if self.cu is None else \
            torch.div(start, P, rounding_mode="floor")
        return owner, base + within

    def position_starts(self) -> torch.Tensor:
        """Global ids where a chain position begins inside a document (where ownership may change)."""
        P, B, T, cu = self.P, self.B, self.T, self.cu
        if self.layout == "contiguous":
            k = torch.arange(1, P, dtype=torch.int64) * (T // P)
            return (torch.arange(B, dtype=torch.int64)[:, None] * T + k).reshape(-1) if cu is None else k
        k = torch.arange(1, 2 * P, dtype=torch.int64)
        if cu is None:
            return (torch.arange(B, dtype=torch.int64)[:, None] * T + k * (T // (2 * P))).reshape(-1)
        lengths = cu[1:] - cu[:-1]
        keep = lengths > 0
        return (cu[:-1][keep][:, None] + k * (lengths[keep] // (2 * P))[:, None]).reshape(-1)


def _check_against_plan(lay: _GlobalLayout, plan: ChainPlan) -> None:
    owner, local = lay.owner_and_local(plan.local_token_ids)
    expected = torch.arange(plan.local_token_ids.numel(), dtype=torch.int64)
    if not (bool((owner == plan.rank).all()) and torch.equal(local, expected)):
        raise RuntimeError(f"halo ownership disagrees with the chain plan (layout={plan.layout}, "
                           f"P={plan.world_size}, rank={plan.rank}); layers/cp/halo.py and plan.py are out of sync")


@lru_cache(maxsize=128)
def _pattern_cached(plan: ChainPlan, cu_key, W: int) -> HaloPattern:
    P, r, B, T = plan.world_size, plan.rank, plan.batch, plan.seq_len
    cu = None if cu_key is None else torch.tensor(cu_key, dtype=torch.int64)
    lay = _GlobalLayout(plan.layout, P, B, T, cu)
    _check_against_plan(lay, plan)
    H = W - 1
    n_local = plan.local_token_ids.numel()
    shifts = torch.arange(1, H + 1, dtype=torch.int64)

    # every (requester, token) pair of the group, sorted by requester then token
    starts = lay.position_starts()
    cand = (starts[:, None] - shifts).reshape(-1)
    cand = cand[cand >= lay.doc_bounds(starts)[0].repeat_interleave(H)]
    cand = torch.unique(cand)
    cand_owner = lay.owner_and_local(cand)[0]
    later = cand[:, None] + shifts  # [n_cand, H] tokens whose window holds the candidate
    in_doc = later < lay.doc_bounds(cand)[1][:, None]
    req = lay.owner_and_local(later.clamp_max(B * T - 1))[0]
    need = in_doc & (req != cand_owner[:, None])
    pair_key = torch.unique(req[need] * (B * T) + cand[:, None].expand_as(req)[need])
    pair_req = torch.div(pair_key, B * T, rounding_mode="floor")
    pair_tok = pair_key % (B * T)
    pair_src, pair_src_local = lay.owner_and_local(pair_tok)

    mine_out = pair_src == r  # already ordered by (requester, token)
    send_index = pair_src_local[mine_out]
    send_counts = torch.bincount(pair_req[mine_out], minlength=P)
    mine_in = pair_req == r
    recv_tok, recv_src = pair_tok[mine_in], pair_src[mine_in]
    order = torch.argsort(recv_src * (B * T) + recv_tok)  # arrival order: by source rank, then token
    recv_tok = recv_tok[order]
    recv_counts = torch.bincount(recv_src[order], minlength=P)

    # history rows of every non-empty local piece
    piece_cu = torch.unique_consecutive(plan.local_cu_seqlens)
    first = plan.local_token_ids[piece_cu[:-1]]
    hist_ids = first[:, None] - H + torch.arange(H, dtype=torch.int64)  # [n_pieces, H]
    valid = hist_ids >= lay.doc_bounds(first)[0][:, None]
    owner, local = lay.owner_and_local(torch.where(valid, hist_ids, first[:, None]))
    n_recv = recv_tok.numel()
    remote = valid & (owner != r)
    sorted_tok, perm = torch.sort(recv_tok)
    slot = torch.searchsorted(sorted_tok, hist_ids).clamp_max(max(n_recv - 1, 0))
    found = sorted_tok[slot] == hist_ids if n_recv else torch.zeros_like(remote)
    if bool((remote & ~found).any()):
        raise RuntimeError("halo pattern misses tokens a local piece needs (internal error in layers/cp/halo.py)")
    recv_row = perm[slot] if n_recv else torch.zeros_like(hist_ids)
    history_index = torch.where(valid, torch.where(owner == r, local, n_local + recv_row),
                                torch.full_like(hist_ids, n_local + n_recv))
    return HaloPattern(send_index=send_index, send_counts=tuple(send_counts.tolist()),
                       recv_counts=tuple(recv_counts.tolist()), piece_cu_seqlens=piece_cu,
                       history_index=history_index, communicates=bool(pair_key.numel() > 0), device_copies={})


def halo_pattern(plan: ChainPlan, cu_seqlens: torch.Tensor | None, kernel_size: int) -> HaloPattern:
    """The exchange and gather pattern of ``plan``'s rank for a conv of width ``kernel_size`` (cached)."""
    return _pattern_cached(plan, None if cu_seqlens is None else tuple(cu_seqlens.tolist()), int(kernel_size))


def _exchange(x_flat: torch.Tensor, pattern: HaloPattern, group, stats):
    """Differentiable: send ``x_flat[send_index]`` to their requesters.

    Returns ``(received [n_recv, D], x_anchor)``. ``x_anchor`` is ``x_flat`` routed through the exchange, so
    that its backward (which communicates) runs on every rank, also on ranks that receive nothing.
    """
    D = x_flat.shape[1]
    sent = x_flat.index_select(0, pattern.index_on("send_index", x_flat.device))
    chunks = torch.split(sent, list(pattern.send_counts))
    dsts = [q for q, n in enumerate(pattern.send_counts) if n > 0]
    srcs = [p for p, n in enumerate(pattern.recv_counts) if n > 0]
    received, x_anchor = send_recv([chunks[q] for q in dsts], dsts, [(pattern.recv_counts[p], D) for p in srcs],
                                   srcs, group=group, stats=stats, anchor=x_flat)
    return (torch.cat(received, dim=0) if received else x_flat.new_zeros(0, D)), x_anchor


def causal_conv1d_with_cp(impl, ctx, x: torch.Tensor, weight: torch.Tensor, *, bias=None, activation=None):
    """This rank's causal conv over a CP-sharded sequence (any CP method: always the full CP layout).

    x ``[B, T_local, D]`` is the rank's shard in local order (``layers.cp.shard``); the context holds the
    layout and, for packed input, the global ``cu_seqlens``. Returns y ``[B, T_local, D]``, equal to the
    rank's shard of the single-rank conv of the global input; gradients of the halo return to its owners.
    """
    B, T_local, D = x.shape
    W = weight.shape[1]
    expected = getattr(ctx, "conv_kernel_size", None)
    if expected is not None and expected != W:
        raise ValueError(f"the CP context was built for conv_kernel_size={expected}, got weight of kernel size "
                         f"W={W} (shape {tuple(weight.shape)})")
    plan = ctx.plan_for(B, T_local)
    pattern = ctx.cached(("halo", B, T_local, W), lambda: halo_pattern(plan, ctx.cu_seqlens, W))
    x_flat = x.reshape(B * T_local, D)
    if pattern.communicates:
        stats = getattr(ctx, "stats", None)
        with (stats.call("conv_halo", "forward") if stats is not None else nullcontext()) as record:
            if record is not None:
                record.steps = 1
            received, x_flat = _exchange(x_flat, pattern, ctx.group, stats)
    else:
        received = x_flat.new_zeros(0, D)
    table = torch.cat([x_flat, received, x_flat.new_zeros(1, D)], dim=0)
    index = pattern.index_on("history_index", x.device)
    history = table.index_select(0, index.reshape(-1)).reshape(index.shape[0], W - 1, D)
    y = impl.causal_conv1d(x_flat[None], weight, bias=bias, activation=activation,
                           cu_seqlens=pattern.piece_cu_seqlens, history=history)
    return y.reshape(B, T_local, D)
