"""Inference forward of ``DSAttention`` through megatron-core's static inference context: the indexer key cache
beside MLA's latent cache, and sparse absorbed attention over the selected cached tokens.

Cache of one layer (``layers.shared.inference``): MLA's latent cache ``[max_batch, max_seq, kv_lora_rank +
qk_pos_emb_head_dim]`` and, on layers that run an indexer, the indexer keys ``[max_batch, max_seq,
dsa_indexer_head_dim]`` (rotated, after ``k_norm``: 128 values per token for DeepSeek-V3.2 beside the latent's 576).
Skip layers (cross-layer sharing) keep only the latent and read the top-k their source layer left on the context.

Every forward (prefill or decode step, ``sequence_len_offset`` tokens already cached): the new tokens' latent and
indexer keys are written, the new queries' top-k is chosen among the cached tokens at or before them, and the
attention runs in DeepSeek's absorbed form (``layers/mixers/mla/decode.py``) over the selected tokens only::

    score[s, j] = scale * ((q_nope W_uk) . c_t + q_pe . k_pe_t),   t = topk[s, j]
    o[s]        = (sum_j softmax(score[s])_j c_t) W_uv^T

Per new token and head: ``2 k (r + p)`` multiply-adds for attention (k = ``dsa_indexer_topk``) whatever the context
length, plus the indexer's ``L * Hi * d`` over the L cached keys.
"""
from __future__ import annotations

import torch

from layers.mixers.mla.sparse import _gather_tokens, select_topk, topk_holder
from layers.shared.inference import inference_window, layer_cache
from layers.shared.rotary import apply_mla_rope


def absorbed_sparse_attention(query, payload, kv_weight, dims, scale: float, topk: torch.Tensor) -> torch.Tensor:
    """query [b, s, h, qk + pe] (rotated); payload [b, L, r + p] (cached latent and rotated rope key); kv_weight
    [h * (qk + v), r]; topk [b, s, k] (ids into payload, -1 = none) -> o [b, s, h, v], fp32 softmax."""
    heads, r = dims.heads, dims.kv_lora_rank
    weight = kv_weight.view(heads, dims.qk + dims.v, r)
    w_uk, w_uv = weight[:, :dims.qk], weight[:, dims.qk:]
    q_nope, q_pe = query.split((dims.qk, dims.pe), dim=-1)
    chosen = _gather_tokens(payload, topk.clamp_min(0))                      # [b, s, k, r + p]
    latent, rope_key = chosen.split((r, dims.pe), dim=-1)
    q_latent = torch.einsum("bshd,hdr->bshr", q_nope, w_uk)
    scores = torch.einsum("bshr,bskr->bshk", q_latent, latent) + torch.einsum("bshp,bskp->bshk", q_pe, rope_key)
    scores = (scores.float() * scale).masked_fill((topk < 0)[:, :, None, :], float("-inf"))
    o_latent = torch.einsum("bshk,bskr->bshr", scores.softmax(-1).to(latent.dtype), latent)
    return torch.einsum("bshr,hvr->bshv", o_latent, w_uv)


def dsa_inference_forward(attn, step, hidden_states, context, attention_mask):
    """``hidden_states [s, b, hidden]`` -> ``(output [s, b, hidden], bias)``, reading and filling both caches."""
    owner = type(attn).__name__
    rows, offset, seq, batch = inference_window(owner, context, hidden_states, attention_mask)
    dims = attn.dims
    latent, rope_key = attn._kv_latent(hidden_states)
    latent, rope_key = latent.transpose(0, 1), rope_key.transpose(0, 1)
    specs = [((context.max_batch_size, context.max_sequence_length, dims.kv_lora_rank + dims.pe), latent.dtype,
              latent.device)]
    if attn.indexer is not None:
        specs.append(((context.max_batch_size, context.max_sequence_length, attn.indexer.dim), latent.dtype,
                      latent.device))
    caches = layer_cache(owner, context, attn.layer_number, specs)
    positions = torch.arange(offset, offset + seq, device=latent.device)
    cos_sin = attn.rotary.cos_sin(positions)
    rope_key = apply_mla_rope(rope_key, cos_sin, token_dim=1)
    caches[0][rows, offset:offset + seq] = torch.cat((latent, rope_key), dim=-1)
    query = attn._query(hidden_states, cos_sin)                              # fills step.q_latent
    holder = topk_holder(context)
    if attn.indexer is None:
        if attn.source_layer not in holder:
            raise RuntimeError(f"DSA skip layer {attn.layer_number} needs the top-k of layer {attn.source_layer}, "
                               "which did not run before it in this step")
        topk = holder[attn.source_layer]
    else:
        index_q, index_w, index_k = attn.indexer(step.hidden_states.transpose(0, 1), step.q_latent.transpose(0, 1),
                                                 cos_sin)
        caches[1][rows, offset:offset + seq] = index_k.to(caches[1].dtype)
        topk = select_topk(index_q, index_w, caches[1][rows, :offset + seq], attn.topk, q_ids=positions.cpu(),
                           relu=attn.relu)
        holder[attn.layer_number] = topk
    out = absorbed_sparse_attention(query, caches[0][rows, :offset + seq], attn.linear_kv_up_proj.weight, dims,
                                    attn.softmax_scale, topk)
    out = out.reshape(batch, seq, dims.heads * dims.v).transpose(0, 1).contiguous()
    return attn.linear_proj(out)


__all__ = ["absorbed_sparse_attention", "dsa_inference_forward"]
