"""Context-parallel batch slicing for Megatron's BSHD and THD layouts, without Transformer Engine.

``zigzag`` (Megatron's load-balanced layout; the default):
  * BSHD: each row's sequence is cut into 2P equal parts; CP rank r keeps parts r and 2P-1-r, in that
    order (``megatron.core.utils.get_batch_on_this_cp_rank``).
  * THD (packed, batch 1): every document, at its *padded* length, is cut into 2P equal parts and rank r
    keeps its parts r and 2P-1-r of each document, document after document (Transformer Engine's
    ``thd_get_partitioned_indices``, used by megatron's ``get_thd_batch_on_this_cp_rank``).
``contiguous`` (for pure linear-attention models): rank r keeps the r-th of P equal parts of each row
  (BSHD) or of the packed stream (THD).
"""
from __future__ import annotations

from typing import Optional

import torch

from layers.cp.plan import LAYOUTS, check_layout
from layers.cp.sequence import plan_for_batch, sequence_plan
from layers.shared.parallel import forward_cp_group, group_rank, group_size

__all__ = ["LAYOUTS", "cp_token_index", "get_batch_on_this_cp_rank"]


def cp_token_index(seq_len: int, cp_size: int, cp_rank: int, cu_seqlens: Optional[torch.Tensor] = None,
                   layout: str = "zigzag") -> torch.Tensor:
    """Global token positions held by ``cp_rank``, in local order (int64, CPU): the sequence plan's
    ``local_index`` (``layers/cp/sequence.py``), the same index every mixer uses.

    ``seq_len`` is the row length (BSHD) or the packed token count (THD, equal to ``cu_seqlens[-1]``);
    ``cu_seqlens`` (``[N+1]``, padded boundaries) selects THD.
    """
    return sequence_plan(cp_size, cp_rank, layout, seq_len, cu_seqlens).local_index


_MODEL_GROUP = object()   # "the model's CP group" (parallel_state's), as opposed to None: no CP


def _cp_group_of(packed_seq_params, cp_group):
    # the mixers' rule (layers.shared.parallel.forward_cp_group): the micro-batch's group, else the model's
    group = cp_group if cp_group is not None else forward_cp_group(packed_seq_params, _MODEL_GROUP)
    if group is not _MODEL_GROUP:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


def _layout_of(layout, config) -> str:
    """The layout to slice for: ``layout`` and the model config's ``hp_cp_layout``, which must agree."""
    config = getattr(config, "config", config)   # a model: its config
    model_layout = None if config is None else (getattr(config, "hp_cp_layout", None) or "zigzag")
    if layout is not None and model_layout is not None and layout != model_layout:
        raise ValueError(f"get_batch_on_this_cp_rank: layout={layout!r} but the model's config.hp_cp_layout is "
                         f"{model_layout!r}; its layers expect that layout (pass config= alone)")
    return check_layout(layout or model_layout or "zigzag")


def get_batch_on_this_cp_rank(batch: dict, packed_seq_params=None, *, cp_group=None, layout=None, config=None):
    """This CP rank's share of a micro-batch dict of tensors; a new dict, other values unchanged.

    The token layout is the model's: ``config`` (the model's ``TransformerConfig``, or the model: its ``.config``)
    gives ``hp_cp_layout``, the layout every mixer of that model was built for; ``layout`` given as well must agree
    (ValueError naming both: a model built for another layout than its data computes wrong outputs). Neither given:
    ``zigzag``, Megatron's layout and the layers' default.

    BSHD: tensors are ``[b, s, ...]`` (``attention_mask`` ``[b, 1, s, s]`` is sliced on its query axis,
    dim 2). THD (``packed_seq_params.qkv_format == "thd"``): tensors are ``[1, t]`` over the packed stream
    and the split follows ``cu_seqlens_q_padded`` (or ``cu_seqlens_q``); ``attention_mask`` must be None.
    The CP group is ``cp_group``, else the one the mixers use: ``packed_seq_params.cp_group`` (megatron's hybrid
    CP), else ``parallel_state``'s context-parallel group.
    """
    layout = _layout_of(layout, config)
    group = _cp_group_of(packed_seq_params, cp_group)
    cp_size = group_size(group)
    if cp_size == 1:
        return dict(batch)
    cp_rank = group_rank(group)
    thd = packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd"
    out = {}
    for key, value in batch.items():
        if value is None or not isinstance(value, torch.Tensor):
            out[key] = value
            continue
        seq_dim = 2 if key == "attention_mask" else 1
        if thd and key == "attention_mask":
            raise ValueError("THD batches carry no attention_mask (document boundaries come from cu_seqlens)")
        if value.dim() <= seq_dim:
            raise ValueError(f"batch[{key!r}] has shape {tuple(value.shape)}; expected a sequence axis at dim "
                             f"{seq_dim}")
        if thd and value.shape[0] != 1:
            raise ValueError(f"THD batches have batch size 1, batch[{key!r}] has shape {tuple(value.shape)}")
        # the micro-batch's plan (cached on packed_seq_params): the layers of this micro-batch reuse it
        plan = plan_for_batch(packed_seq_params, cp_size, cp_rank, layout, value.shape[seq_dim])
        out[key] = plan.shard(value, seq_dim)
    return out
