"""The one attention mask our causal mixers accept: None or megatron's plain causal mask (of the CP-local rows in
training, of the cached window in inference)."""
from __future__ import annotations

import torch

from layers.base.compat import tensor_version
from layers.cp.plan import local_seq_index

_LAST_CHECKED: dict = {}


def check_causal_mask(mask, layout: str, cp_size: int, cp_rank: int, cu_seqlens=None, owner: str = "layer") -> None:
    """Accept None or megatron's causal mask (bool, True = masked, ``[b|1, 1, s_local, s_global]``).

    Under CP the rows are this rank's tokens in the CP layout (per document for packed THD input). Anything
    else (padding or document masks) raises ValueError: ``owner`` is causal and packs documents through
    PackedSeqParams instead. The last accepted mask is remembered, so a micro-batch is checked once.
    """
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attention_mask must be None or a bool tensor, got {type(mask).__name__}")
    cu_key = None if cu_seqlens is None else tuple(cu_seqlens.tolist())
    key = (tensor_version(mask), layout, cp_size, cp_rank, cu_key)
    if _LAST_CHECKED.get("mask") is mask and _LAST_CHECKED.get("key") == key:   # the same object, unchanged
        return
    if mask.dtype != torch.bool or mask.ndim != 4 or mask.shape[1] != 1:
        raise ValueError("attention_mask must be None or megatron's causal bool mask [b, 1, s_q, s_kv] "
                         f"(True = masked); got dtype {mask.dtype}, shape {tuple(mask.shape)}")
    sq, skv = mask.shape[-2:]
    if sq * cp_size != skv:
        raise ValueError(f"attention_mask [.., s_q={sq}, s_kv={skv}] does not match a causal mask for "
                         f"context-parallel size {cp_size} (expected s_kv = s_q * cp)")
    # without CP every layout is the identity (and any length is valid, odd ones too)
    rows = torch.arange(skv) if cp_size == 1 else local_seq_index(cp_size, cp_rank, layout, skv, cu_seqlens)
    if rows.numel() != sq:
        raise ValueError(f"attention_mask has {sq} query rows but this rank holds {rows.numel()} tokens in the "
                         f"{layout} layout of {skv} tokens over {cp_size} CP ranks")
    if not _is_causal(mask, rows):
        raise ValueError(f"{owner} is causal and cannot apply a non-causal attention_mask (padding or document "
                         "masks); pass attention_mask=None or the plain causal mask, and pack documents with "
                         "PackedSeqParams(qkv_format='thd', cu_seqlens_q=...)")
    _LAST_CHECKED.update(mask=mask, key=key)   # holding the mask keeps its identity from being reused


def _is_causal(mask, rows) -> bool:
    """Whether ``mask [b, 1, len(rows), s_kv]`` masks exactly the keys after each query row's position ``rows``."""
    rows = rows.to(mask.device)
    expected = torch.arange(mask.shape[-1], device=mask.device)[None, :] > rows[:, None]
    return bool((mask[:, 0] == expected).all())


def check_inference_mask(owner: str, mask, offset: int, seq: int) -> None:
    """Accept None or megatron's causal mask of this window: ``[.., seq, offset + seq]`` with query row i at
    position ``offset + i`` (what megatron's GPT inference wrapper slices out of its full mask)."""
    if mask is None:
        return
    if mask.dtype != torch.bool or mask.ndim != 4 or tuple(mask.shape[-2:]) != (seq, offset + seq):
        raise ValueError(f"{owner}: attention_mask in inference must be None or the causal bool mask "
                         f"[b, 1, {seq}, {offset + seq}] of this window; got {mask.dtype} {tuple(mask.shape)}")
    if not _is_causal(mask, torch.arange(offset, offset + seq)):
        raise ValueError(f"{owner} is causal and cannot apply a non-causal attention_mask in inference (padding "
                         "masks: megatron's static controller feeds each sequence's own tokens, no padding)")
