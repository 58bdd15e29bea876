"""Core softmax attention for MLA without Transformer Engine.

``causal_attention(q, k, v, scale=..., q_ids=None, cu_seqlens=None, backend="eager")``:
q ``[B, Sq, H, Dk]``, k ``[B, T, H, Dk]``, v ``[B, T, H, Dv]`` (Dk may differ from Dv) -> ``[B, Sq, H, Dv]``.
Keys are each row's whole sequence in global order; ``q_ids`` are the queries' global ids (a CP rank's
zigzag shard), ``cu_seqlens`` global document boundaries (B == 1): query i sees key j iff j <= i and
both lie in one document. Backends: ``eager`` (torch SDPA, any device) and ``npu``
(``torch_npu.npu_fusion_attention``).

``CoreAttention`` wraps it as the ``core_attention`` submodule of ``layers.MultiLatentAttention``; its
constructor accepts megatron-core's core-attention arguments. ``context_parallel.ContextParallelDotProductAttention``
is the ``core_attention`` of megatron-core's ``SelfAttention`` (the ``A`` layers) under context parallelism.
"""
from __future__ import annotations

from torch import nn

from layers.base.keywords import check_keywords, declared_keywords

from .eager import eager_causal_attention
from .masking import QueryBlock, document_starts, query_blocks
from .npu import npu_causal_attention

BACKENDS = {"eager": eager_causal_attention, "npu": npu_causal_attention}


def causal_attention(q, k, v, *, scale: float, q_ids=None, cu_seqlens=None, backend: str = "eager"):
    """Dispatch to a backend after checking shapes (ValueError names the mismatch)."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, S, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"inconsistent q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"cu_seqlens (packed documents) needs batch 1, got batch {q.shape[0]}")
    return BACKENDS[backend](q, k, v, scale=scale, q_ids=q_ids, cu_seqlens=cu_seqlens)


class CoreAttention(nn.Module):
    """Causal softmax attention submodule (megatron-style constructor; only causal self-attention).

    ``forward(q, k, v, *, scale=None, q_ids=None, cu_seqlens=None)`` with the shapes above; ``scale``
    defaults to the ``softmax_scale`` given at construction.
    """

    backend = "eager"

    def __init__(self, config=None, layer_number=None, attn_mask_type=None, attention_type="self",
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None,
                 pg_collection=None, backend: str | None = None, **kwargs):
        super().__init__()
        check_keywords(type(self).__name__, kwargs, declared_keywords(CoreAttention))
        if attention_type not in (None, "self"):
            raise ValueError(f"CoreAttention supports only self-attention, got attention_type={attention_type!r}")
        name = getattr(attn_mask_type, "name", attn_mask_type)
        if name not in (None, "causal", "padding_causal"):
            raise ValueError(f"CoreAttention supports only causal masks, got attn_mask_type={attn_mask_type!r}")
        self.backend = backend or type(self).backend
        if self.backend not in BACKENDS:
            raise ValueError(f"attention backend must be one of {sorted(BACKENDS)}, got {self.backend!r}")
        self.softmax_scale = softmax_scale

    def forward(self, q, k, v, *, scale=None, q_ids=None, cu_seqlens=None):
        scale = self.softmax_scale if scale is None else scale
        if scale is None:
            raise ValueError("CoreAttention needs a softmax scale (constructor softmax_scale or scale=)")
        return causal_attention(q, k, v, scale=scale, q_ids=q_ids, cu_seqlens=cu_seqlens, backend=self.backend)


class NPUCoreAttention(CoreAttention):
    """``CoreAttention`` on Ascend through ``torch_npu.npu_fusion_attention``."""

    backend = "npu"


__all__ = ["causal_attention", "CoreAttention", "NPUCoreAttention", "eager_causal_attention",
           "npu_causal_attention", "query_blocks", "QueryBlock", "document_starts"]
