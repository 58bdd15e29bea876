"""Top-k margins for DSA tests: top-k is discontinuous, so a test comparing two runs' selections first checks that the
reference run's k-th and (k+1)-th indexer scores differ by more than rounding for every query with more than k
visible keys. :func:`recording_margins` wraps ``select_topk`` where ``DSAttention`` calls it and records, per call,
the smallest such gap (fp64 scores from the same indexer outputs)."""
from __future__ import annotations

import contextlib

import torch


def smallest_gap(index_q, index_w, index_k, topk, q_ids=None, cu_seqlens=None, relu=True) -> float:
    from layers.mixers.mla import sparse

    ids = torch.arange(index_q.shape[1]) if q_ids is None else q_ids.cpu()
    lo, hi = sparse.visible_keys(ids, None if cu_seqlens is None else cu_seqlens.cpu())
    scores = sparse.index_scores(index_q.double(), index_w.double(), index_k.double(), relu=relu)
    keys = torch.arange(index_k.shape[1])
    scores = scores.masked_fill(~((keys[None] >= lo[:, None]) & (keys[None] < hi[:, None])), float("-inf"))
    if scores.shape[-1] <= topk:
        return float("inf")
    top = scores.topk(topk + 1, dim=-1).values
    rows = torch.isfinite(top[..., topk])
    return float((top[..., topk - 1] - top[..., topk])[rows].min()) if rows.any() else float("inf")


@contextlib.contextmanager
def recording_margins():
    """``with recording_margins() as gaps:`` every DSAttention selection inside appends its smallest gap."""
    import layers.mixers.mla.dsa as dsa_module
    import layers.mixers.mla.dsa_decode as decode_module

    gaps, plain = [], dsa_module.select_topk

    def select(index_q, index_w, index_k, topk, *, q_ids=None, cu_seqlens=None, relu=True, **kw):
        gaps.append(smallest_gap(index_q, index_w, index_k, topk, q_ids, cu_seqlens, relu))
        return plain(index_q, index_w, index_k, topk, q_ids=q_ids, cu_seqlens=cu_seqlens, relu=relu, **kw)

    dsa_module.select_topk = decode_module.select_topk = select
    try:
        yield gaps
    finally:
        dsa_module.select_topk = decode_module.select_topk = plain
