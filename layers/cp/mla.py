"""Context parallelism for multi-head latent attention (MLA) without Transformer Engine.

Every CP rank holds ``S = T / P`` tokens of each row (Megatron's zigzag layout, or contiguous; packed THD
documents are laid out per document). Inputs of :func:`mla_context_parallel` per rank (batch-first):

* ``kv_payload [B, S, r + p]``: the normalized KV latent (``r = kv_lora_rank``) and the shared rotary key
  (``p = qk_pos_emb_head_dim``, already rotated at global positions) of the local tokens;
* ``make_query()`` -> ``[B, S, H, d + p]``: the rotated queries of the local tokens for this rank's
  ``H`` (TP-local) heads; it is called while the first collective is in flight;
* ``kv_weight [H * (d + v), r]``: the TP-local rows of ``linear_kv_up_proj``.

Strategies (output ``[B, S, H, v]`` for the local tokens):

* ``expanded_ulysses``: expand K/V locally, all-to-all Q, K, V sequence->heads (H % P == 0), full causal
  attention over the whole sequence for H/P heads, all-to-all back. V's exchange is launched first, then
  K's, then Q's, each overlapping the projection work that follows it.
* ``latent_ulysses``: all-gather the payload (``r + p`` values per token), launched before the queries are
  projected; all-to-all Q sequence->heads; each rank expands K/V for its H/P heads only; all-to-all back.
* ``latent``: all-gather the payload; every rank expands K/V for all its H heads over the whole sequence
  and attends its local queries at their global (zigzag) ids; any head count.

The gathered payload's gradient is reduce-scattered back to its owners; that reduce-scatter is launched
before the weight gradient of the expansion is computed, so the two overlap. Bytes go into ``stats``
(``layers.cp.accounting.CommStats``) under ``mla.<strategy>.*`` names; :func:`mla_comm_bytes` gives the
closed forms.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from layers.base.choices import MLA_CP_STRATEGIES as STRATEGIES
from layers.cp.collectives import all_gather_raw, all_to_all, all_to_all_start, reduce_scatter_raw
from layers.cp.sequence import SequencePlan, sequence_plan


@dataclass(frozen=True)
class MLADims:
    """Per-head widths: ``qk`` (no-rope key/query part), ``pe`` (rotary part), ``v`` (value); ``heads`` = H."""
    heads: int
    qk: int
    pe: int
    v: int
    kv_lora_rank: int


def check_strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"MLA CP strategy must be one of {STRATEGIES}, got {strategy!r}")
    return strategy


# -- token orders: the micro-batch's SequencePlan (layers/cp/sequence.py): local_index, gathered_index, to_global
def _index(ids: torch.Tensor, device) -> torch.Tensor:
    return ids.to(device, non_blocking=True)


# -- expansion ----------------------------------------------------------------------------------------------
def expand_keys_values(latent: torch.Tensor, rope_key: torch.Tensor, kv_weight: torch.Tensor,
                       dims: MLADims, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """latent [B, T, r], rope_key [B, T, p] -> keys [B, T, h, d + p], values [B, T, h, v] (h = heads)."""
    kv = F.linear(latent, kv_weight)
    return assemble_keys_values(kv, rope_key, dims, heads)


def assemble_keys_values(kv: torch.Tensor, rope_key: torch.Tensor, dims: MLADims, heads: int):
    """kv [B, T, h * (d + v)] and the shared rope key [B, T, p] -> keys, values (see above)."""
    kv = kv.view(*kv.shape[:2], heads, dims.qk + dims.v)
    k_nope, value = kv.split((dims.qk, dims.v), dim=-1)
    key = torch.cat((k_nope, rope_key.unsqueeze(2).expand(-1, -1, heads, -1)), dim=-1)
    return key, value


def head_rows(first: int, count: int, width: int) -> slice:
    return slice(first * width, (first + count) * width)


class _ExpandGatheredLatent(torch.autograd.Function):
    """Wait for the payload all-gather, put it in global order and expand K/V through ``weight``.

    Forward (payload [B,S,r+p] local, weight [h*(d+v), r]): -> kv [B,T,h*(d+v)], rope_key [B,T,p].
    Backward: the payload gradient (global order) is permuted to gathered order and reduce-scattered to
    the owners asynchronously while the weight gradient is computed.
    """

    @staticmethod
    def forward(ctx, payload, weight, pending, order, group, stats, name):
        gathered, work = pending
        if work is not None:
            work.wait()
        P, B, S, W = gathered.shape
        flat = gathered.permute(1, 0, 2, 3).reshape(B, P * S, W)
        glob = flat.index_select(1, _index(order.to_global, flat.device))
        r = weight.shape[1]
        latent, rope_key = glob[..., :r], glob[..., r:]
        ctx.save_for_backward(latent, weight)
        ctx.meta = (order, group, stats, name, P, B, S, W)
        return F.linear(latent, weight), rope_key

    @staticmethod
    def backward(ctx, grad_kv, grad_rope_key):
        latent, weight = ctx.saved_tensors
        order, group, stats, name, P, B, S, W = ctx.meta
        grad_payload = None
        work = None
        if ctx.needs_input_grad[0]:
            grad_latent = grad_kv.matmul(weight)
            if grad_rope_key is None:
                grad_rope_key = grad_latent.new_zeros(*grad_latent.shape[:2], W - grad_latent.shape[-1])
            grad_glob = torch.cat((grad_latent, grad_rope_key.to(grad_latent.dtype)), dim=-1)
            grad_gathered = grad_glob.index_select(1, _index(order.gathered_index, grad_glob.device))
            grad_gathered = grad_gathered.view(B, P, S, W).permute(1, 0, 2, 3)
            with _call(stats, f"{name}.latent_reduce_scatter", "backward"):
                grad_payload, work = reduce_scatter_raw(grad_gathered, group, stats, async_op=True)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = grad_kv.reshape(-1, grad_kv.shape[-1]).t().matmul(latent.reshape(-1, latent.shape[-1]))
        if work is not None:
            work.wait()
        return grad_payload, grad_weight, None, None, None, None, None


class _call:
    """``stats.call(name, phase)`` when stats are given, else a no-op context."""

    def __init__(self, stats, name, phase):
        self.cm = stats.call(name, phase) if stats is not None else None

    def __enter__(self):
        if self.cm is None:
            return None
        record = self.cm.__enter__()
        if record is not None:
            record.steps = 1                      # every MLA exchange is one collective round
        return record

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc) if self.cm is not None else False


# -- sequence <-> heads all-to-all ---------------------------------------------------------------------------
def _seq_to_heads_send(x: torch.Tensor, P: int) -> torch.Tensor:
    """[B, S, H, D] -> [P, B, S, H/P, D]: head group i goes to rank i."""
    B, S, H, D = x.shape
    return x.reshape(B, S, P, H // P, D).permute(2, 0, 1, 3, 4)


def _seq_to_heads_recv(y: torch.Tensor, order: SequencePlan) -> torch.Tensor:
    """[P, B, S, h, D] (entry i = rank i's tokens) -> [B, T, h, D] in global order."""
    P, B, S, h, D = y.shape
    flat = y.permute(1, 0, 2, 3, 4).reshape(B, P * S, h, D)
    return flat.index_select(1, _index(order.to_global, flat.device))


def _heads_to_seq(x: torch.Tensor, order: SequencePlan, P: int, group, stats) -> torch.Tensor:
    """[B, T, h, D] global order -> [B, S, P*h, D] local tokens, all heads (differentiable all-to-all)."""
    B, T, h, D = x.shape
    S = T // P
    gathered = x.index_select(1, _index(order.gathered_index, x.device)).view(B, P, S, h, D)
    recv = all_to_all(gathered.permute(1, 0, 2, 3, 4), group, stats)   # entry i: my tokens, head group i
    return recv.permute(1, 2, 0, 3, 4).reshape(B, S, P * h, D)


# -- strategies ---------------------------------------------------------------------------------------------
def mla_context_parallel(strategy: str, *, kv_payload: torch.Tensor, make_query: Callable[[], torch.Tensor],
                         kv_weight: torch.Tensor, dims: MLADims, attention: Callable, group, layout: str = "zigzag",
                         cu_seqlens: Optional[torch.Tensor] = None, stats=None,
                         plan: Optional[SequencePlan] = None) -> torch.Tensor:
    """Causal MLA attention of this rank's local tokens under CP; returns ``[B, S, H, v]`` (see module doc).

    ``attention(q, k, v, q_ids=None, cu_seqlens=None)`` is the core attention with the softmax scale
    bound. ``cu_seqlens``: global packed document boundaries (B == 1), or None for BSHD rows. ``plan``: the
    micro-batch's sequence plan when the caller has it (else built from ``layout`` and ``cu_seqlens``).
    """
    check_strategy(strategy)
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    B, S, width = kv_payload.shape
    if width != dims.kv_lora_rank + dims.pe:
        raise ValueError(f"kv_payload width {width} != kv_lora_rank + qk_pos_emb_head_dim = "
                         f"{dims.kv_lora_rank + dims.pe}")
    if strategy != "latent" and dims.heads % P != 0:
        raise ValueError(f"MLA CP strategy {strategy!r} needs the TP-local head count divisible by the CP size: "
                         f"heads per TP rank = {dims.heads}, CP = {P} (use strategy 'latent' for any head count)")
    order = plan if plan is not None else sequence_plan(P, rank, layout, S * P, cu_seqlens)
    if (order.world_size, order.rank, order.seq_len) != (P, rank, S * P):
        raise ValueError(f"plan is for rank {order.rank} of {order.world_size} and {order.seq_len} tokens; the "
                         f"group gives rank {rank} of {P} and the input {S} x {P} tokens")
    name = f"mla.{strategy}"
    if strategy == "expanded_ulysses":
        return _expanded_ulysses(kv_payload, make_query, kv_weight, dims, attention, group, P, order,
                                 cu_seqlens, stats, name)
    return _latent(strategy, kv_payload, make_query, kv_weight, dims, attention, group, P, rank, order,
                   cu_seqlens, stats, name)


def _latent(strategy, payload, make_query, kv_weight, dims, attention, group, P, rank, order, cu_seqlens,
            stats, name):
    with _call(stats, f"{name}.latent_gather", "forward"):
        pending = all_gather_raw(payload.detach(), group, stats, async_op=True)
    query = make_query()                                   # overlaps the gather
    if strategy == "latent":
        kv, rope_key = _ExpandGatheredLatent.apply(payload, kv_weight, pending, order, group, stats, name)
        key, value = assemble_keys_values(kv, rope_key, dims, dims.heads)
        return attention(query, key, value, q_ids=order.local_index, cu_seqlens=cu_seqlens)
    # latent_ulysses: queries sequence -> heads while this rank expands K/V for its own head group.
    h = dims.heads // P
    with _call(stats, f"{name}.query_all_to_all", "forward"):
        q_pending = all_to_all_start(_seq_to_heads_send(query, P), group, stats)
    rows = head_rows(rank * h, h, dims.qk + dims.v)
    kv, rope_key = _ExpandGatheredLatent.apply(payload, kv_weight[rows], pending, order, group, stats, name)
    key, value = assemble_keys_values(kv, rope_key, dims, h)
    query = _seq_to_heads_recv(q_pending.wait(), order)
    out = attention(query, key, value, q_ids=None, cu_seqlens=cu_seqlens)
    with _call(stats, f"{name}.output_all_to_all", "forward"):
        return _heads_to_seq(out, order, P, group, stats)


def _expanded_ulysses(payload, make_query, kv_weight, dims, attention, group, P, order, cu_seqlens, stats,
                      name):
    r = dims.kv_lora_rank
    kv = F.linear(payload[..., :r], kv_weight)
    kv = kv.view(*kv.shape[:2], dims.heads, dims.qk + dims.v)
    k_nope, value = kv.split((dims.qk, dims.v), dim=-1)
    with _call(stats, f"{name}.value_all_to_all", "forward"):
        v_pending = all_to_all_start(_seq_to_heads_send(value, P), group, stats)
    key = torch.cat((k_nope, payload[..., r:].unsqueeze(2).expand(-1, -1, dims.heads, -1)), dim=-1)
    with _call(stats, f"{name}.key_all_to_all", "forward"):
        k_pending = all_to_all_start(_seq_to_heads_send(key, P), group, stats)
    query = make_query()                                   # overlaps the K/V exchanges
    with _call(stats, f"{name}.query_all_to_all", "forward"):
        q_pending = all_to_all_start(_seq_to_heads_send(query, P), group, stats)
    value = _seq_to_heads_recv(v_pending.wait(), order)
    key = _seq_to_heads_recv(k_pending.wait(), order)
    query = _seq_to_heads_recv(q_pending.wait(), order)
    out = attention(query, key, value, q_ids=None, cu_seqlens=cu_seqlens)
    with _call(stats, f"{name}.output_all_to_all", "forward"):
        return _heads_to_seq(out, order, P, group, stats)


# -- closed forms -------------------------------------------------------------------------------------------
def mla_comm_bytes(strategy: str, *, world_size: int, tokens_per_rank: int, heads: int, qk_head_dim: int,
                   qk_pos_emb_head_dim: int, v_head_dim: int, kv_lora_rank: int, element_size: int = 4) -> dict:
    """Bytes one rank sends (= receives) per layer: ``{"forward": n, "backward": n}``.

    ``tokens_per_rank`` = B * S local tokens; ``heads`` the TP-local head count; strategies as above.
    """
    P, n, H, es = world_size, tokens_per_rank, heads, element_size
    dq, dv = qk_head_dim + qk_pos_emb_head_dim, v_head_dim
    latent = (P - 1) * n * (kv_lora_rank + qk_pos_emb_head_dim) * es
    a2a = lambda width: (P - 1) * n * H * width * es // P  # noqa: E731  (bytes of one sequence<->heads exchange)
    if strategy == "latent":
        return {"forward": latent, "backward": latent}
    if strategy == "latent_ulysses":
        return {"forward": latent + a2a(dq) + a2a(dv), "backward": latent + a2a(dq) + a2a(dv)}
    if strategy == "expanded_ulysses":
        total = a2a(dq) + a2a(dq) + a2a(dv) + a2a(dv)
        return {"forward": total, "backward": total}
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
