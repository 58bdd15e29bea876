"""Ulysses token exchange: sequence-parallel <-> head-parallel inside the Ulysses group of a CPContext.

``seq_to_heads(x, ctx, head_dim)``: x ``[B, T_local, ...]`` holds this rank's tokens (ctx.layout order) with
all heads along ``head_dim``; the result ``[B, U * T_local, ...]`` holds head slice ``ctx.ulysses_rank`` (of
U equal slices) of the union of the Ulysses group's tokens, in the local order of the *inner* plan
(``ctx.state_plan_for``: the Q = P/U-rank layout, natural token order when U == P). ``heads_to_seq`` is the
inverse. Both are differentiable (each one's backward is the other) and identity when U == 1.

The token permutation (gathered order -> inner order) is computed once per (context layout, B, T_local) from
the plans' ``local_token_ids`` and cached.
"""
from __future__ import annotations

import torch

from layers.cp.collectives import all_to_all_raw
from layers.cp.plan import build_chain_plan

def _permutation(ctx, B: int, T_loc: int):
    """(perm, inverse): inner[k] = gathered[perm[k]], gathered[j] = inner[inverse[j]] (flat B*T tokens);
    memoized on the context (one per micro-batch shape)."""
    return ctx.cached(("ulysses_permutation", B, T_loc), lambda: _build_permutation(ctx, B, T_loc))


def _build_permutation(ctx, B: int, T_loc: int):
    T = ctx.global_len(T_loc)
    U, q = ctx.ulysses_degree, ctx.rank // ctx.ulysses_degree
    gathered_ids = torch.cat([build_chain_plan(ctx.world_size, q * U + v, ctx.layout, batch=B, seq_len=T,
                                               cu_seqlens=ctx.cu_seqlens).local_token_ids for v in range(U)])
    inner_ids = ctx.state_plan_for(B, T_loc).local_token_ids
    order = torch.argsort(gathered_ids)
    perm = order[torch.searchsorted(gathered_ids[order], inner_ids)]
    if not torch.equal(gathered_ids[perm], inner_ids):
        raise AssertionError("Ulysses token sets of the outer and inner layouts differ (internal error)")
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel())
    return perm, inverse


def _check(x, head_dim, what):
    if x.dim() < 3:
        raise ValueError(f"{what} needs x [B, T, ..., heads, ...] with at least 3 dims, got {tuple(x.shape)}")
    hd = head_dim % x.dim()
    if hd < 2:
        raise ValueError(f"head_dim must index a dim after [B, T], got {head_dim} for shape {tuple(x.shape)}")
    return hd


def _seq_to_heads_raw(x, ctx, hd, stats):
    U = ctx.ulysses_degree
    B, T_loc = x.shape[:2]
    H = x.shape[hd]
    if H % U != 0:
        raise ValueError(f"Ulysses needs the head dim (dim {hd}, size {H}) divisible by the Ulysses degree U={U}")
    perm, _ = _permutation(ctx, B, T_loc)
    y = x.reshape((B * T_loc,) + tuple(x.shape[2:]))
    y = y.unflatten(hd - 1, (U, H // U)).movedim(hd - 1, 0)                 # [U, B*T_loc, ..., H/U, ...]
    r = all_to_all_raw(y, ctx.ulysses_group, stats)                        # entry v: rank v's tokens, my heads
    r = r.reshape((U * B * T_loc,) + tuple(r.shape[2:]))
    out = r.index_select(0, perm.to(r.device))
    return out.reshape((B, U * T_loc) + tuple(out.shape[1:]))


def _heads_to_seq_raw(x, ctx, hd, stats):
    U = ctx.ulysses_degree
    B, T_in = x.shape[:2]
    if T_in % U != 0:
        raise ValueError(f"heads_to_seq needs the token count {T_in} divisible by the Ulysses degree U={U}")
    T_loc = T_in // U
    _, inverse = _permutation(ctx, B, T_loc)
    y = x.reshape((B * T_in,) + tuple(x.shape[2:])).index_select(0, inverse.to(x.device))
    y = y.reshape((U, B * T_loc) + tuple(x.shape[2:]))                      # entry v: rank v's tokens
    r = all_to_all_raw(y, ctx.ulysses_group, stats)                        # entry v: my tokens, head slice v
    r = r.movedim(0, hd - 1).flatten(hd - 1, hd)                           # [B*T_loc, ..., H, ...]
    return r.reshape((B, T_loc) + tuple(r.shape[1:]))


def _call(ctx, name, fn, x, hd):
    stats = ctx.stats
    if stats is None or not stats.enabled:
        return fn(x, ctx, hd, None)
    from layers.cp.accounting import current_phase

    with stats.call(name, current_phase()) as rec:
        rec.steps += 1
        return fn(x, ctx, hd, stats)


_DIRECTIONS = {"seq_to_heads": ("heads_to_seq", _seq_to_heads_raw),   # direction -> (its inverse, raw exchange)
               "heads_to_seq": ("seq_to_heads", _heads_to_seq_raw)}


class _UlyssesExchange(torch.autograd.Function):
    """One Ulysses direction in forward, the other in backward (the exchange is a permutation)."""

    @staticmethod
    def forward(ctx_, x, ctx, hd, direction):
        ctx_.cp, ctx_.hd, ctx_.direction = ctx, hd, direction
        return _call(ctx, f"ulysses.{direction}", _DIRECTIONS[direction][1], x, hd)

    @staticmethod
    def backward(ctx_, g):
        back = _DIRECTIONS[ctx_.direction][0]
        return _call(ctx_.cp, f"ulysses.{back}", _DIRECTIONS[back][1], g.contiguous(), ctx_.hd), None, None, None


def seq_to_heads(x: torch.Tensor, ctx, head_dim: int = 2) -> torch.Tensor:
    """[B, T_local, ..., H, ...] (sequence-parallel) -> [B, U*T_local, ..., H/U, ...] (head-parallel, inner
    layout order). Identity when ctx.ulysses_degree == 1."""
    if ctx.ulysses_degree == 1:
        return x
    hd = _check(x, head_dim, "seq_to_heads")
    if x.shape[hd] % ctx.ulysses_degree != 0:
        raise ValueError(f"Ulysses needs the head dim (dim {hd}, size {x.shape[hd]}) divisible by the Ulysses "
                         f"degree U={ctx.ulysses_degree}")
    return _UlyssesExchange.apply(x, ctx, hd, "seq_to_heads")


def seq_to_heads_packed(tensors, ctx) -> list:
    """``seq_to_heads`` of several ``[B, T_local, H_i, ...]`` tensors (heads at dim 2) in one all-to-all per dtype:
    each is viewed as ``[B, T_local, U, F_i]`` (its U head groups), the groups are concatenated along F, exchanged,
    and split back to ``[B, U*T_local, H_i/U, ...]``. Differentiable (the backward is one exchange per dtype too).
    """
    U = ctx.ulysses_degree
    if U == 1:
        return list(tensors)
    for x in tensors:
        _check(x, 2, "seq_to_heads")
        if x.shape[2] % U:
            raise ValueError(f"Ulysses needs the head dim (dim 2, size {x.shape[2]}) divisible by the Ulysses "
                             f"degree U={U}")
    out = [None] * len(tensors)
    for dtype in dict.fromkeys(x.dtype for x in tensors):
        members = [i for i, x in enumerate(tensors) if x.dtype == dtype]
        flat = [tensors[i].reshape(*tensors[i].shape[:2], U, -1) for i in members]
        moved = seq_to_heads(torch.cat(flat, dim=-1), ctx, head_dim=2)      # [B, U*T_local, 1, sum F_i]
        for i, part in zip(members, moved.split([f.shape[-1] for f in flat], dim=-1)):
            x = tensors[i]
            out[i] = part.reshape(x.shape[0], U * x.shape[1], x.shape[2] // U, *x.shape[3:])
    return out


def heads_to_seq(x: torch.Tensor, ctx, head_dim: int = 2) -> torch.Tensor:
    """Inverse of ``seq_to_heads``: [B, U*T_local, ..., H/U, ...] -> [B, T_local, ..., H, ...]."""
    if ctx.ulysses_degree == 1:
        return x
    hd = _check(x, head_dim, "heads_to_seq")
    return _UlyssesExchange.apply(x, ctx, hd, "heads_to_seq")
