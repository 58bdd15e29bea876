"""DeepSeek Sparse Attention (DSA) math in plain PyTorch, query block by query block: the lightning indexer's
scores and causal top-k selection, MLA attention over the selected tokens, and the indexer's KL loss.

Shapes (batch-first; keys are every row's whole sequence in global order, queries any subset in local order with
global ids ``q_ids [S]``; ``cu_seqlens`` = global document boundaries, B == 1)::

    index_q [B, S, Hi, d]  (rotated)     index_w [B, S, Hi] (fp32, H^-1/2 * d^-1/2 folded in)   index_k [B, T, d]
    score[s, t] = sum_h index_w[s, h] * act(index_q[s, h] . index_k[t])       act = ReLU (or identity)
    topk [B, S, k] int64: the k visible keys of highest score (visible: t <= id(s), same document); -1 pads
                          queries that see fewer than k keys
    q [B, S, H, dq], key [B, T, H, dq], value [B, T, H, dv] -> o [B, S, H, dv]: softmax over the selected keys only

Memory: a block of ``Sb`` queries holds ``Sb * Hi * W`` indexer products (W = its key window) and ``Sb * k * H * (dq
+ dv)`` gathered keys/values, so nothing is ``[heads, T, T]``; only ``topk`` survives the indexer. Under autograd
each block's attention is recomputed in backward (``torch.utils.checkpoint``), so the saved activations are the
inputs, ``topk`` and the outputs: bytes per token flat in T. Top-k is discontinuous: two layouts agree on the
selection only where the k-th and (k+1)-th scores differ by more than rounding.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from layers.mixers.attention.masking import document_starts

INDEXER_LOSS_EPS = 1e-10   # clamp of the KL target's log, as megatron-core's dsa_indexer_loss.py
TOPK_ATTR = "_hp_dsa_topk"     # {source layer number: top-k [B, S, k]} on the micro-batch's carrier object


def topk_holder(carrier) -> dict:
    """The ``{layer number: top-k}`` dict of cross-layer top-k sharing kept on ``carrier`` (the micro-batch's
    ``PackedSeqParams``, attention mask, config or inference context), made on first use."""
    holder = getattr(carrier, TOPK_ATTR, None)
    if holder is None:
        holder = {}
        setattr(carrier, TOPK_ATTR, holder)
    return holder


def _acc(x: torch.Tensor) -> torch.Tensor:
    """x in its accumulation dtype: fp32 for 16-bit inputs, else its own (fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def visible_keys(q_ids: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (first visible key, last visible key + 1) per query id: its document start and id + 1."""
    return document_starts(q_ids, cu_seqlens), q_ids + 1


def _blocks(n: int, block_size: int):
    for begin in range(0, n, block_size):
        yield begin, min(begin + block_size, n)


def _window(lo: torch.Tensor, hi: torch.Tensor) -> tuple[int, int]:
    return int(lo.min()), int(hi.max())


def index_scores(index_q, index_w, index_k, *, relu: bool = True) -> torch.Tensor:
    """index_q [B, s, Hi, d], index_w [B, s, Hi], index_k [B, w, d] -> fp32 scores [B, s, w] (module doc)."""
    dots = torch.einsum("bshd,btd->bsht", _acc(index_q), _acc(index_k))
    if relu:
        dots = torch.relu(dots)
    return torch.einsum("bsht,bsh->bst", dots, _acc(index_w))


def select_topk(index_q, index_w, index_k, topk: int, *, q_ids=None, cu_seqlens=None, relu: bool = True,
                block_size: int = 256) -> torch.Tensor:
    """Causal (per-document) top-k of the indexer scores -> int64 ``[B, S, topk]`` global key ids, -1 where a
    query sees fewer than ``topk`` keys; no gradient."""
    B, S = index_q.shape[:2]
    if topk < 1:
        raise ValueError(f"dsa_indexer_topk must be positive, got {topk}")
    ids = torch.arange(S) if q_ids is None else q_ids.detach().cpu().long()
    lo, hi = visible_keys(ids, None if cu_seqlens is None else cu_seqlens.cpu())
    out = torch.full((B, S, topk), -1, dtype=torch.int64, device=index_q.device)
    with torch.no_grad():
        for begin, end in _blocks(S, block_size):
            k0, k1 = _window(lo[begin:end], hi[begin:end])
            scores = index_scores(index_q[:, begin:end], index_w[:, begin:end], index_k[:, k0:k1], relu=relu)
            keys = torch.arange(k0, k1)
            visible = (keys[None] >= lo[begin:end, None]) & (keys[None] < hi[begin:end, None])
            visible = visible.to(scores.device)
            scores = scores.masked_fill(~visible, float("-inf"))
            n = min(topk, k1 - k0)
            idx = scores.topk(n, dim=-1).indices                       # [B, s, n] window-local
            chosen = visible.expand(B, -1, -1).gather(-1, idx)
            out[:, begin:end, :n] = torch.where(chosen, idx + k0, torch.full_like(idx, -1))
    return out


def _gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, T, ...], idx [B, s, k] (>= 0) -> [B, s, k, ...]."""
    B, s, k = idx.shape
    flat = idx.reshape(B, s * k)
    picked = torch.stack([x[b].index_select(0, flat[b]) for b in range(B)]) if B > 1 else \
        x[0].index_select(0, flat[0]).unsqueeze(0)
    return picked.view(B, s, k, *x.shape[2:])


def _selected_logits(q, key, idx, scale):
    """q [B, s, H, dq], key [B, T, H, dq], idx [B, s, k] -> fp32 logits [B, s, H, k] (-inf at idx == -1)."""
    valid = idx >= 0
    k_sel = _gather_tokens(key, idx.clamp_min(0))                      # [B, s, k, H, dq]
    logits = torch.einsum("bshd,bskhd->bshk", _acc(q), _acc(k_sel)) * scale
    return logits.masked_fill(~valid[:, :, None, :], float("-inf"))


def _sparse_block(q, key, value, idx, scale):
    probs = torch.softmax(_selected_logits(q, key, idx, scale), dim=-1)
    v_sel = _gather_tokens(value, idx.clamp_min(0))                    # [B, s, k, H, dv]
    return torch.einsum("bshk,bskhd->bshd", probs, _acc(v_sel)).to(q.dtype)


def sparse_attention(q, key, value, topk: torch.Tensor, *, scale: float, block_size: int = 64) -> torch.Tensor:
    """Softmax attention of each query over its ``topk`` keys only (module doc); recomputed per block in backward."""
    if topk.shape[:2] != q.shape[:2]:
        raise ValueError(f"topk {tuple(topk.shape)} must be [B, S, k] for queries {tuple(q.shape)}")
    recompute = torch.is_grad_enabled() and (q.requires_grad or key.requires_grad or value.requires_grad)
    pieces = []
    for begin, end in _blocks(q.shape[1], block_size):
        args = (q[:, begin:end], key, value, topk[:, begin:end], scale)
        pieces.append(checkpoint(_sparse_block, *args, use_reentrant=False) if recompute else _sparse_block(*args))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)


# -- the indexer's KL loss ---------------------------------------------------------------------------------
def _kl_rows(target, log_pred, valid):
    """Per-row KL(target || pred) over the last dim, entries outside ``valid`` contributing 0."""
    terms = target * (torch.log(target.clamp_min(INDEXER_LOSS_EPS)) - log_pred)
    return terms.masked_fill(~valid, 0.0).sum(-1)


def _masked_log_softmax(x, valid):
    return torch.log_softmax(x.masked_fill(~valid, float("-inf")), dim=-1).masked_fill(~valid, 0.0)


def _dense_loss_block(q, key, index_q, index_w, index_k, lo, hi, k0, scale, relu, tp_group):
    keys = torch.arange(k0, k0 + key.shape[1], device=q.device)
    valid = (keys[None] >= lo[:, None]) & (keys[None] < hi[:, None])  # [s, w]
    logits = torch.einsum("bshd,bthd->bsht", _acc(q), _acc(key)) * scale
    target = torch.softmax(logits.masked_fill(~valid[None, :, None], float("-inf")), dim=-1).sum(2)
    target = _reduce_heads(target, tp_group)
    target = target / target.sum(-1, keepdim=True).clamp_min(INDEXER_LOSS_EPS)
    scores = index_scores(index_q, index_w, index_k, relu=relu)
    return _kl_rows(target, _masked_log_softmax(scores, valid[None]), valid[None]).sum()


def _sparse_loss_block(q, key, index_q, index_w, index_k, idx, scale, relu, tp_group):
    valid = idx >= 0                                                    # [B, s, k]
    target = torch.softmax(_selected_logits(q, key, idx, scale), dim=-1).sum(2)
    target = _reduce_heads(target, tp_group)
    target = target / target.sum(-1, keepdim=True).clamp_min(INDEXER_LOSS_EPS)
    k_sel = _gather_tokens(index_k, idx.clamp_min(0))                   # [B, s, k, d]
    dots = torch.einsum("bshd,bskd->bshk", _acc(index_q), _acc(k_sel))
    if relu:
        dots = torch.relu(dots)
    scores = torch.einsum("bshk,bsh->bsk", dots, _acc(index_w))
    return _kl_rows(target, _masked_log_softmax(scores, valid), valid).sum()


def _reduce_heads(target, tp_group):
    """Sum the per-query attention mass over the heads of every TP rank (the target is detached)."""
    if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
        target = target.contiguous()
        torch.distributed.all_reduce(target, group=tp_group)
    return target


def indexer_loss(q, key, index_q, index_w, index_k, topk, *, scale: float, sparse: bool, q_ids=None,
                 cu_seqlens=None, relu: bool = True, tp_group=None, block_size: int = 64) -> torch.Tensor:
    """The DSA indexer's KL loss, mean over this rank's queries (megatron-core's token-mean reduction).

    Target: the main attention's probabilities (``q``, ``key`` detached; softmax scale ``scale``) summed over all
    heads (TP ranks' heads all-reduced) and L1-normalized; prediction: softmax of the indexer scores. Dense stage
    (``sparse=False``): both over every visible key; sparse stage: both over the selected ``topk`` keys only.
    Gradients reach only ``index_q``, ``index_w``, ``index_k``; blocks are recomputed in backward.
    """
    B, S = q.shape[:2]
    q, key = q.detach(), key.detach()
    ids = torch.arange(S) if q_ids is None else q_ids.detach().cpu().long()
    lo, hi = visible_keys(ids, None if cu_seqlens is None else cu_seqlens.cpu())
    total = q.new_zeros((), dtype=torch.float32)
    grad = torch.is_grad_enabled()
    for begin, end in _blocks(S, block_size):
        if sparse:
            fn = _sparse_loss_block
            args = (q[:, begin:end], key, index_q[:, begin:end], index_w[:, begin:end], index_k,
                    topk[:, begin:end], scale, relu, tp_group)
        else:
            k0, k1 = _window(lo[begin:end], hi[begin:end])
            fn = _dense_loss_block
            args = (q[:, begin:end], key[:, k0:k1], index_q[:, begin:end], index_w[:, begin:end], index_k[:, k0:k1],
                    lo[begin:end].to(q.device), hi[begin:end].to(q.device), k0, scale, relu, tp_group)
        total = total + (checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args))
    return total / max(B * S, 1)


__all__ = ["index_scores", "indexer_loss", "select_topk", "sparse_attention", "topk_holder", "visible_keys"]
