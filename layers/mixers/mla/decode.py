"""Inference forward of ``MultiLatentAttention`` through megatron-core's static inference context: the latent
cache and DeepSeek's absorbed decode.

Cache of one layer (``layers.shared.inference``): ``[max_batch, max_seq, kv_lora_rank + qk_pos_emb_head_dim]`` in the
parameters' dtype, per token the normalized latent ``c`` and the rotated shared rope key ``k_pe`` (576 values for
DeepSeek-V3 against 128 heads x (192 + 128) = 40960 for expanded K/V). The latent is shared by all heads, so
every TP rank holds the whole cache (as megatron's and DeepSeek's own MLA inference do).

Prefill (``sequence_len_offset == 0``): the training path (K/V expanded from the latent, causal attention), and the
latent is stored. Later tokens (``sequence_len_offset > 0``, a decode step or a continuation): the up-projection
``linear_kv_up_proj = [W_uk | W_uv]`` per head is folded into the query and the output instead of expanding K/V
for every cached token::

    score[t] = scale * ((q_nope W_uk) . c_t + q_pe . k_pe_t)      q_nope W_uk: [heads, kv_lora_rank]
    o        = (sum_t softmax(score)_t c_t) W_uv^T                 per head [v_head_dim]

Cost per new token and head: ``2 * L * (r + p)`` multiply-adds for the scores and values over L cached tokens, plus
``r * (qk + v)`` for the two folds, against ``L * r * (qk + v)`` to re-expand K/V (or a per-head cache).
"""
from __future__ import annotations

import torch

from layers.cp.mla import expand_keys_values
from layers.shared.inference import inference_window, layer_cache
from layers.shared.rotary import apply_mla_rope


def cache_width(dims) -> int:
    """Values cached per token: the latent and the shared rotary key."""
    return dims.kv_lora_rank + dims.pe


def absorbed_attention(query, payload, kv_weight, dims, scale: float, offset: int):
    """query [b, s, h, qk + pe] (rotated) at positions ``offset..offset+s-1``; payload [b, offset + s, r + p] (the
    cache up to and including these tokens); kv_weight [h * (qk + v), r] -> o [b, s, h, v], causal, fp32 softmax."""
    heads, r = dims.heads, dims.kv_lora_rank
    weight = kv_weight.view(heads, dims.qk + dims.v, r)
    w_uk, w_uv = weight[:, :dims.qk], weight[:, dims.qk:]             # [h, qk, r], [h, v, r]
    q_nope, q_pe = query.split((dims.qk, dims.pe), dim=-1)
    latent, rope_key = payload.split((r, dims.pe), dim=-1)
    q_latent = torch.einsum("bshd,hdr->bshr", q_nope, w_uk)
    scores = torch.einsum("bshr,btr->bhst", q_latent, latent) + torch.einsum("bshp,btp->bhst", q_pe, rope_key)
    seq, total = query.shape[1], payload.shape[1]
    rows = torch.arange(offset, offset + seq, device=query.device)
    future = torch.arange(total, device=query.device)[None, :] > rows[:, None]     # [s, t]
    probs = (scores.float() * scale).masked_fill(future, float("-inf")).softmax(-1).to(latent.dtype)
    o_latent = torch.einsum("bhst,btr->bshr", probs, latent)
    return torch.einsum("bshr,hvr->bshv", o_latent, w_uv)


def mla_inference_forward(attn, hidden_states, context, attention_mask):
    """``hidden_states [s, b, hidden]`` -> ``(output [s, b, hidden], bias)``, reading and filling the latent cache."""
    owner = type(attn).__name__
    rows, offset, seq, batch = inference_window(owner, context, hidden_states, attention_mask)
    dims = attn.dims
    latent, rope_key = attn._kv_latent(hidden_states)                     # [s, b, r], [s, b, p]
    latent, rope_key = latent.transpose(0, 1), rope_key.transpose(0, 1)
    (cache,) = layer_cache(owner, context, attn.layer_number,
                           [((context.max_batch_size, context.max_sequence_length, cache_width(dims)),
                             latent.dtype, latent.device)])
    cos_sin = attn.rotary.cos_sin(torch.arange(offset, offset + seq, device=latent.device))
    rope_key = apply_mla_rope(rope_key, cos_sin, token_dim=1)
    cache[rows, offset:offset + seq] = torch.cat((latent, rope_key), dim=-1)
    query = attn._query(hidden_states, cos_sin)                            # [b, s, h, qk + pe]
    kv_weight = attn.linear_kv_up_proj.weight
    if offset == 0:
        key, value = expand_keys_values(latent, rope_key, kv_weight, dims, dims.heads)
        out = attn.core_attention(query, key, value, q_ids=None, cu_seqlens=None)
    else:
        out = absorbed_attention(query, cache[rows, :offset + seq], kv_weight, dims, attn.softmax_scale, offset)
    return attn.project_output(out, hidden_states)
