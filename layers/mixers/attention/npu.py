"""Ascend path: ``torch_npu.npu_fusion_attention`` (imported lazily; RuntimeError names torch_npu).

Parameter names follow the torch_npu API: ``pre_tockens``/``next_tockens`` (sic), ``atten_mask`` with
True = masked out, ``actual_seq_qlen``/``actual_seq_kvlen`` cumulative ends without a leading 0 for the
TND layout, ``sparse_mode`` 2 (leftUpCausal) / 3 (rightDownCausal) with the compressed 2048 x 2048 mask.
Same shapes and mask semantics as :func:`layers.mixers.attention.eager.eager_causal_attention`.
"""
from __future__ import annotations

import importlib

import torch

from .masking import query_blocks

_COMPRESSED = 2048
_MAX_TOKENS = 2147483647


def _torch_npu():
    try:
        return importlib.import_module("torch_npu")
    except ImportError as exc:
        raise RuntimeError("the 'npu' attention backend needs the torch_npu package (pip install torch_npu) "
                           "on an Ascend NPU") from exc


def _causal_mask(device) -> torch.Tensor:
    return torch.ones(_COMPRESSED, _COMPRESSED, dtype=torch.bool, device=device).triu(1)


def npu_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                         q_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                         block_size: int = 4096) -> torch.Tensor:
    """Causal attention on Ascend; q [B,Sq,H,Dk], k [B,T,H,Dk], v [B,T,H,Dv] -> [B,Sq,H,Dv]."""
    npu = _torch_npu()
    heads, num_keys = q.shape[2], k.shape[1]
    if q_ids is None and cu_seqlens is None:
        return npu.npu_fusion_attention(
            q, k, v, heads, "BSND", atten_mask=_causal_mask(q.device), scale=scale,
            pre_tockens=_MAX_TOKENS, next_tockens=0, sparse_mode=2)[0]
    if q_ids is None and cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(f"packed (cu_seqlens) attention needs batch 1, got {q.shape[0]}")
        ends = [int(x) for x in cu_seqlens[1:].tolist()]
        out = npu.npu_fusion_attention(
            q[0], k[0], v[0], heads, "TND", atten_mask=_causal_mask(q.device), scale=scale,
            pre_tockens=_MAX_TOKENS, next_tockens=0, actual_seq_qlen=ends, actual_seq_kvlen=ends,
            sparse_mode=3)[0]
        return out.unsqueeze(0)
    pieces = []
    for blk in query_blocks(q_ids, cu_seqlens, num_keys, block_size):
        qb = q[:, blk.q_begin:blk.q_end]
        kb, vb = k[:, blk.k_begin:blk.k_end], v[:, blk.k_begin:blk.k_end]
        if blk.mask is None:
            pieces.append(npu.npu_fusion_attention(
                qb, kb, vb, heads, "BSND", atten_mask=_causal_mask(q.device), scale=scale,
                pre_tockens=_MAX_TOKENS, next_tockens=0, sparse_mode=2)[0])
        else:
            masked_out = (~blk.mask).to(q.device)[None, None]
            pieces.append(npu.npu_fusion_attention(
                qb, kb, vb, heads, "BSND", atten_mask=masked_out, scale=scale,
                pre_tockens=_MAX_TOKENS, next_tockens=_MAX_TOKENS, sparse_mode=0)[0])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
