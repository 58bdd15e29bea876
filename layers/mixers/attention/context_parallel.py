"""Causal softmax core attention for megatron-core's ``SelfAttention`` with CP, without Transformer Engine.

megatron-core's local ``DotProductAttention`` refuses context parallelism and allocates CUDA buffers;
TE's attention needs TE. :class:`ContextParallelDotProductAttention` takes the same constructor and
forward arguments, so it can be the ``core_attention`` of the standard attention layers ("A" in
"GGGA") on any device:

* CP = 1: causal (per document for THD) attention of the local sequence; under megatron's static inference
  context the keys are the cached tokens plus these queries, which attend causally from their positions.
* CP > 1: all-gather K and V over the CP group and put them in global token order with the micro-batch's
  sequence plan (``layers.cp.sequence.gather_sequence``; the backward reduce-scatters their gradients back
  to their owners), and let the local (zigzag or contiguous) queries attend with global causal positions.
  Memory per rank is that of the full K/V of one layer.

The attention math is ``layers.mixers.attention.causal_attention`` (eager SDPA or Ascend's fused kernel).
"""
from __future__ import annotations

import torch
from torch import nn

from layers.cp.plan import check_layout
from layers.cp.sequence import gather_sequence, packed_cu_seqlens, plan_for_batch
from layers.base.keywords import check_keywords, declared_keywords
from layers.shared.masks import check_causal_mask, check_inference_mask


class ContextParallelDotProductAttention(nn.Module):
    """Drop-in ``core_attention`` for megatron-core ``SelfAttention`` (causal masks only).

    forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
    packed_seq_params=None): BSHD ``query [s, b, np, hn]``, ``key/value [s, b, ng, hn]`` (GQA groups,
    np % ng == 0) -> ``[s, b, np*hn]``; THD ``[t, np, hn]`` -> ``[t, np*hn]``. ``s``/``t`` are this CP
    rank's tokens. ``attention_mask`` is not read: masking is causal, per document for THD.
    """

    def __init__(self, config, layer_number, attn_mask_type=None, attention_type="self",
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None,
                 backend: str = "eager", layout: str | None = None, **kwargs):
        super().__init__()
        check_keywords(type(self).__name__, kwargs, declared_keywords(ContextParallelDotProductAttention))
        name = getattr(attn_mask_type, "name", attn_mask_type)
        if name not in (None, "causal", "padding_causal"):
            raise ValueError(f"{type(self).__name__} supports causal masks only, got attn_mask_type={attn_mask_type!r}")
        if attention_type not in ("self", None):
            raise ValueError(f"{type(self).__name__} supports self-attention only, got {attention_type!r}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"{type(self).__name__} has no attention dropout; set attention_dropout=0, got {dropout}")
        self.config = config
        self.layer_number = layer_number
        self.backend = backend
        self.layout = check_layout(layout or getattr(config, "hp_cp_layout", None) or "zigzag")
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else self.head_dim ** -0.5
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if self.cp_group is None:
            from megatron.core import parallel_state

            self.cp_group = parallel_state.get_context_parallel_group()

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        from layers.mixers.attention import causal_attention

        if attention_bias is not None:
            raise ValueError(f"{type(self).__name__} does not take an attention_bias")
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd:  # [t, n, d] -> [t, 1, n, d]
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        s_local, b, heads, _ = query.shape
        if heads % key.shape[2]:
            raise ValueError(f"query heads {heads} must be a multiple of key/value groups {key.shape[2]}")
        cu = packed_cu_seqlens(packed_seq_params) if thd else None
        group = self.cp_group
        cp_size = group.size() if group is not None else 1
        cp_rank = group.rank() if cp_size > 1 else 0
        q_ids = None
        cached = key.shape[0] - s_local   # megatron's static inference: keys = the cache up to these queries
        if cp_size == 1 and not thd and cached > 0:
            check_inference_mask(type(self).__name__, attention_mask, cached, s_local)
            q_ids = torch.arange(cached, cached + s_local)
        else:
            check_causal_mask(attention_mask, self.layout, cp_size, cp_rank, cu, owner=type(self).__name__)
        if cp_size > 1:
            plan = plan_for_batch(packed_seq_params, cp_size, cp_rank, self.layout, s_local * cp_size)
            key = gather_sequence(key, plan, group)
            value = gather_sequence(value, plan, group)
            q_ids = plan.local_index
        repeat = heads // key.shape[2]
        if repeat > 1 and q_ids is not None and s_local == 1 and cp_size == 1:
            return self._grouped_decode(query, key, value, repeat, q_ids, causal_attention)
        if repeat > 1:
            key = key.repeat_interleave(repeat, dim=2)
            value = value.repeat_interleave(repeat, dim=2)
        # [s, b, n, d] -> [b, s, n, d]
        out = causal_attention(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
                               scale=self.softmax_scale, q_ids=q_ids,
                               cu_seqlens=cu, backend=self.backend)
        out = out.transpose(0, 1).reshape(s_local, b, -1)
        return out.squeeze(1) if thd else out

    def _grouped_decode(self, query, key, value, repeat, q_ids, causal_attention):
        """A decode step (one query token per sequence at position ``q_ids[0]``) with GQA, without repeating the
        cached K/V per query head: the ``repeat`` query heads of each K/V group become ``repeat`` query rows at the
        same position (all see the whole cache), ``[1, b, ng*r, d] -> [b, r, ng, d]``. Equal to repeating K/V."""
        _, b, _, dim = query.shape
        groups = key.shape[2]
        rows = query.reshape(b, groups, repeat, dim).transpose(1, 2)               # [b, r, ng, d]
        out = causal_attention(rows, key.transpose(0, 1), value.transpose(0, 1), scale=self.softmax_scale,
                               q_ids=q_ids.expand(repeat), backend=self.backend)   # [b, r, ng, dv]
        return out.transpose(1, 2).reshape(1, b, -1)
