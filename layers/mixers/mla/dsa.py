"""``DSAttention``: DeepSeek Sparse Attention on our MLA (DeepSeek-V3.2, GLM-5), a subclass of
``MultiLatentAttention`` that keeps its projections, rotary embedding, TP/SP and CP, and replaces the core attention
by attention over the top-k tokens a lightning indexer selects (``layers/mixers/mla/sparse.py`` holds the math).

Indexer (``DSAIndexer``; megatron-core 0.19's ``DSAIndexer`` parameter names; transformers' ``wq_b``, ``wk``,
``k_norm``, ``weights_proj``), per token, from inputs detached from the main model::

    index_q = rope(linear_wq_b(q_latent))            [Hi, d]  q_latent = q_layernorm(linear_q_down_proj(x))
    index_k = rope(k_norm(linear_wk(x)))             [d]      k_norm: LayerNorm with bias
    index_w = linear_weights_proj(x) (fp32) * Hi^-1/2 * d^-1/2
    score[s, t] = sum_h index_w[s, h] * ReLU(index_q[s, h] . index_k[t])

RoPE rotates the first ``qk_pos_emb_head_dim`` channels at the main attention's positions: half-split pairs
(``dsa_indexer_rope_interleaved=False``, DeepSeek-V3.2) or interleaved pairs (True, GLM-5). Where the references
differ: transformers applies d^-1/2 inside the ReLU, megatron-core folds it into the weights (equal, the scale is
positive); megatron-core's ``dsa_indexer_scoring_relu`` can drop the ReLU (its comment says GLM-5 scores without
it; transformers' GLM-5 applies it: our presets follow transformers); megatron-core's ``dsa_indexer_rotate_activation``
(a Hadamard rotation of q and k, orthogonal, for FP8 scoring) leaves the exact scores unchanged, so the eager path
computes the unrotated scores whatever the flag says.

TP: attention heads split as our MLA's; the indexer is replicated on every TP rank (as megatron-core's): its heads
are summed into one score per (query, key) before the top-k, so splitting them would cost an all-reduce of
``[S, T]`` scores per layer against ``Hi * d * q_lora_rank`` duplicated weights; its gradients (from the indexer
loss, whose target is all-reduced over TP) are equal on every TP rank and averaged by megatron's
``finalize_model_grads`` (``average_gradients_across_tp_domain``). CP: only the ``latent`` strategy (each rank
all-gathers the latent and the indexer keys, then selects among the tokens its queries may see). Cross-layer sharing
(GLM-5's ``indexer_types``; megatron-core's ``dsa_indexer_topk_freq`` / ``dsa_indexer_skip_topk_offset``): a skip
layer has no indexer and reuses the top-k of its source layer, carried on the micro-batch's ``PackedSeqParams``
(else the attention mask, else the config) as megatron-core does; with full-layer recompute and several pipeline
micro-batches in flight, give the forward an attention mask or packed_seq_params so the carrier is per micro-batch.

Indexer loss (``dsa_indexer_loss_coeff`` > 0, training): KL from the main attention's head-summed distribution to
the indexer's (``dsa_indexer_use_sparse_loss``: over the selected tokens, else over every visible token: the dense
warm-up), attached to the output with megatron-core's ``DSAIndexerLossAutoScaler`` (scaled like the lm loss by its
schedules) and logged through ``DSAIndexerLossLoggingHelper`` (Megatron-LM logs "indexer loss" beside "lm loss").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from torch import nn

from layers.cp.sequence import gather_sequence
from layers.mixers.mla.dsa_decode import dsa_inference_forward
from layers.mixers.mla.layer import MLASelfAttentionSubmodules, MultiLatentAttention
from layers.mixers.mla.sparse import indexer_loss, select_topk, sparse_attention, topk_holder
from layers.shared.inference import static_context
from layers.shared.parallel import group_size
from layers.shared.rotary import apply_mla_rope

def apply_half_rope(x: torch.Tensor, cos_sin, token_dim: int) -> torch.Tensor:
    """Rotate the first ``r`` channels of ``x`` as half-split pairs ``(x_i, x_{i+r/2})`` (transformers'
    ``rotate_half``); cos/sin ``[tokens, r/2]``; None returns x."""
    if cos_sin is None:
        return x
    cos, sin = cos_sin
    half = cos.shape[-1]
    shape = [1] * x.dim()
    shape[token_dim % x.dim()] = cos.shape[0]
    shape[-1] = half
    cos, sin = cos.reshape(shape).to(x.dtype), sin.reshape(shape).to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def is_skip_topk_layer(layer_number: int, skip_topk_offset: int, topk_freq: int) -> bool:
    """Whether 1-indexed ``layer_number`` reuses an earlier layer's top-k (megatron-core's rule, = GLM-5's
    ``indexer_types`` built from ``index_topk_freq`` / ``index_skip_topk_offset``)."""
    if layer_number < 1 or skip_topk_offset < 0 or topk_freq < 1:
        raise ValueError(f"need layer_number >= 1, dsa_indexer_skip_topk_offset >= 0, dsa_indexer_topk_freq >= 1; "
                         f"got {layer_number}, {skip_topk_offset}, {topk_freq}")
    return max(layer_number - max(skip_topk_offset, 1), 0) % topk_freq != 0


def source_topk_layer(layer_number: int, skip_topk_offset: int, topk_freq: int) -> int:
    """The layer whose top-k ``layer_number`` uses (itself when it runs an indexer)."""
    if not is_skip_topk_layer(layer_number, skip_topk_offset, topk_freq):
        return layer_number
    return layer_number - (layer_number - max(skip_topk_offset, 1)) % topk_freq


class DSAIndexer(nn.Module):
    """The lightning indexer (module doc); replicated over TP. ``forward(x [B, S, h], q_latent [B, S, q_lora_rank],
    cos_sin) -> index_q [B, S, Hi, d], index_w [B, S, Hi] (fp32, scales folded in), index_k [B, S, d]``."""

    def __init__(self, config, q_lora_rank: int):
        super().__init__()
        heads, dim, pe = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim, config.qk_pos_emb_head_dim
        if not heads or not dim:
            raise ValueError(f"DSA needs dsa_indexer_n_heads and dsa_indexer_head_dim, got {heads}, {dim}")
        if dim < pe:
            raise ValueError(f"dsa_indexer_head_dim={dim} must be >= qk_pos_emb_head_dim={pe} (RoPE on its first "
                             "qk_pos_emb_head_dim channels)")
        eps = config.dsa_indexer_k_norm_epsilon
        self.heads, self.dim = heads, dim
        self.interleaved = bool(config.dsa_indexer_rope_interleaved)
        dtype = config.params_dtype
        self.linear_wq_b = nn.Linear(q_lora_rank, heads * dim, bias=False, dtype=dtype)
        self.linear_wk = nn.Linear(config.hidden_size, dim, bias=False, dtype=dtype)
        self.k_norm = nn.LayerNorm(dim, eps=config.layernorm_epsilon if eps is None else eps, dtype=dtype)
        self.linear_weights_proj = nn.Linear(config.hidden_size, heads, bias=False, dtype=torch.float32)
        for linear in (self.linear_wq_b, self.linear_wk, self.linear_weights_proj):
            config.init_method(linear.weight.data)
        for param in self.parameters():
            param.average_gradients_across_tp_domain = True

    def _rope(self, x, cos_sin):
        rotate = apply_mla_rope if self.interleaved else apply_half_rope
        return rotate(x, cos_sin, token_dim=1)

    def forward(self, x, q_latent, cos_sin):
        B, S = x.shape[:2]
        index_q = self.linear_wq_b(q_latent).view(B, S, self.heads, self.dim)
        index_q = self._rope(index_q, cos_sin)
        index_k = self._rope(self.k_norm(self.linear_wk(x)), cos_sin)
        weights = self.linear_weights_proj.weight   # fp32 unless a bf16 wrapper cast the module (then in its dtype)
        index_w = self.linear_weights_proj(x.to(weights.dtype)).float() * (self.heads ** -0.5 * self.dim ** -0.5)
        return index_q, index_w, index_k


@dataclass
class _Step:
    """What one forward's sparse core attention needs beyond q/k/v (set by ``DSAttention.forward``)."""

    hidden_states: torch.Tensor            # [s, b, h], detached
    carrier: object
    q_latent: Optional[torch.Tensor] = None
    plan: object = None
    positions: Optional[torch.Tensor] = None
    cp_group: object = None


class DSAttention(MultiLatentAttention):
    """MLA whose attention reads only the indexer's top-k tokens (module doc). Config fields (megatron-core's):
    ``dsa_indexer_n_heads``, ``dsa_indexer_head_dim``, ``dsa_indexer_topk``, ``dsa_indexer_topk_freq``,
    ``dsa_indexer_skip_topk_offset``, ``dsa_indexer_loss_coeff``, ``dsa_indexer_use_sparse_loss``,
    ``dsa_indexer_rope_interleaved``, ``dsa_indexer_scoring_relu``, ``dsa_indexer_k_norm_epsilon``. Extra keyword:
    ``block_size`` (queries per block of the eager sparse path)."""

    def __init__(self, config, submodules: MLASelfAttentionSubmodules, layer_number: Optional[int] = None,
                 attn_mask_type=None, cp_comm_type: Optional[str] = None, pg_collection=None, *,
                 block_size: int = 64, **kwargs):
        super().__init__(config, submodules, layer_number, attn_mask_type, cp_comm_type, pg_collection, **kwargs)
        c = config
        if c.q_lora_rank is None:
            raise ValueError("DSA needs q_lora_rank (the indexer's queries come from the query latent), got None")
        if not c.dsa_indexer_topk or c.dsa_indexer_topk < 1:
            raise ValueError(f"DSA needs a positive dsa_indexer_topk, got {c.dsa_indexer_topk}")
        if self.cp_strategy != "latent":
            raise ValueError(f"DSA runs under context parallelism with the 'latent' strategy only (each rank gathers "
                             f"the latent and the indexer keys), got cp_strategy={self.cp_strategy!r}")
        if self.recompute_up_proj:
            raise ValueError("--recompute-modules hp_mla_up_proj is not supported by DSA layers (their sparse "
                             "attention already recomputes per query block in backward and keeps K/V as its input)")
        self.block_size = block_size
        self.topk = c.dsa_indexer_topk
        freq, offset = c.dsa_indexer_topk_freq or 1, c.dsa_indexer_skip_topk_offset or 0
        # the schedule counts the model's mixer layers: a HybridModel numbers its MLP layers too, and its config says
        # which GPT layer each of its layers is half of (hp_gpt_layer_numbers, hp_megatron.model_builders)
        number = (getattr(c, "hp_gpt_layer_numbers", None) or {}).get(layer_number, layer_number or 1)
        self.topk_layer = number
        self.source_layer = source_topk_layer(number, offset, freq) if freq > 1 else number
        self.indexer = DSAIndexer(c, c.q_lora_rank) if self.source_layer == number else None
        self.loss_coeff = float(c.dsa_indexer_loss_coeff or 0.0)
        if self.loss_coeff > 0 and getattr(c, "experimental_attention_variant_loss_scale_func", None) is None:
            # megatron-core's schedules scale the attached loss's gradient through this hook (as they do for its DSA)
            from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

            c.experimental_attention_variant_loss_scale_func = DSAIndexerLossAutoScaler.set_loss_scale
        self.sparse_loss = bool(c.dsa_indexer_use_sparse_loss)
        self.relu = bool(getattr(c, "dsa_indexer_scoring_relu", True))
        self._step: Optional[_Step] = None

    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, position_ids=None, sequence_len_offset=None, *,
                inference_params=None, **kwargs):
        """As ``MultiLatentAttention.forward``; with megatron-core's ``StaticInferenceContext`` (eval mode) the layer
        keeps its latent and indexer key caches there (``layers/mixers/mla/dsa_decode.py``)."""
        carrier = packed_seq_params if packed_seq_params is not None else (
            attention_mask if attention_mask is not None else self.config)
        self._step = _Step(hidden_states=hidden_states.detach(), carrier=carrier,
                           cp_group=self.cp_group_for(packed_seq_params))
        try:
            context = static_context("DSAttention", self, inference_context, inference_params,
                                     cp_size=group_size(self._step.cp_group),
                                     sequence_parallel=self.config.sequence_parallel and self.tp_size > 1,
                                     packed_seq_params=packed_seq_params)
            if context is not None:
                return dsa_inference_forward(self, self._step, hidden_states, context, attention_mask)
            return super().forward(hidden_states, attention_mask, key_value_states, inference_context,
                                   rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin, attention_bias,
                                   packed_seq_params, position_ids, sequence_len_offset,
                                   inference_params=inference_params, **kwargs)
        finally:
            self._step = None

    # -- hooks of MultiLatentAttention.forward ----------------------------------------------------------------
    def _token_positions(self, *args):
        plan, positions = super()._token_positions(*args)
        if self._step is not None:
            self._step.plan, self._step.positions = plan, positions
        return plan, positions

    def _q_latent(self, hidden_states):
        latent = super()._q_latent(hidden_states)
        if self._step is not None:
            full = latent.detach()
            if self.config.sequence_parallel and self.tp_size > 1:
                full = gather_from_sequence_parallel_region(full, group=self.tp_group)
            self._step.q_latent = full
        return latent

    def _attention(self):
        step = self._step
        return lambda q, k, v, q_ids=None, cu_seqlens=None: self._sparse_core(step, q, k, v, q_ids, cu_seqlens)

    # -- the sparse core -------------------------------------------------------------------------------------
    def _sparse_core(self, step, query, key, value, q_ids, cu_seqlens):
        """query [B, S, H, dq] (local tokens), key/value [B, T, H, *] (global order) -> [B, S, H, dv]."""
        holder = topk_holder(step.carrier)
        index = None
        if self.indexer is None:
            if self.source_layer not in holder:
                raise RuntimeError(f"DSA skip layer {self.topk_layer} needs the top-k of layer {self.source_layer}, "
                                   f"which did not run before it in this micro-batch (layers run: {sorted(holder)})")
            topk = holder[self.source_layer]
        else:
            index = self._index(step)
            topk = select_topk(*index, self.topk, q_ids=q_ids, cu_seqlens=cu_seqlens, relu=self.relu)
            holder[self.topk_layer] = topk
        scale = self.core_attention.softmax_scale
        out = sparse_attention(query, key, value, topk, scale=scale, block_size=self.block_size)
        if index is not None and self.training and self.loss_coeff > 0 and torch.is_grad_enabled():
            loss = indexer_loss(query, key, *index, topk, scale=scale, sparse=self.sparse_loss, q_ids=q_ids,
                                cu_seqlens=cu_seqlens, relu=self.relu,
                                tp_group=self.tp_group if self.tp_size > 1 else None) * self.loss_coeff
            out = attach_indexer_loss(out, loss, self.layer_number, self.config.num_layers)
        return out

    def _index(self, step):
        """The indexer on this rank's tokens (batch-first); under CP its keys all-gathered into global order."""
        x = step.hidden_states
        if self.config.sequence_parallel and self.tp_size > 1:
            x = gather_from_sequence_parallel_region(x, group=self.tp_group)
        cos_sin = self.rotary.cos_sin(step.positions)
        index_q, index_w, index_k = self.indexer(x.transpose(0, 1), step.q_latent.transpose(0, 1), cos_sin)
        if step.plan is not None:
            index_k = gather_sequence(index_k, step.plan, step.cp_group, self.comm_stats, seq_dim=1)
        return index_q, index_w, index_k


def dsa_comm_bytes(*, world_size: int, tokens_per_rank: int, qk_pos_emb_head_dim: int, kv_lora_rank: int,
                   index_head_dim: int, element_size: int = 4, indexer_loss: bool = True) -> dict:
    """Bytes one CP rank sends (= receives) per DSA layer, ``{"forward": n, "backward": n}``: the latent all-gather
    of our MLA (``r + p`` values per token; its reduce-scatter in backward) plus the indexer keys' all-gather (``d``
    values per token; reduce-scattered in backward only when the indexer loss sends gradients to them). Neither term
    depends on the head counts or on ``dsa_indexer_topk``."""
    P, n, es = world_size, tokens_per_rank, element_size
    latent = (P - 1) * n * (kv_lora_rank + qk_pos_emb_head_dim) * es
    keys = (P - 1) * n * index_head_dim * es
    return {"forward": latent + keys, "backward": latent + (keys if indexer_loss else 0)}


def attach_indexer_loss(out: torch.Tensor, loss: torch.Tensor, layer_number, num_layers) -> torch.Tensor:
    """Attach ``loss`` to ``out``'s backward (megatron-core's ``DSAIndexerLossAutoScaler``) and record it for
    Megatron-LM's "indexer loss" log (``DSAIndexerLossLoggingHelper``; its tracker made on ``loss``'s device)."""
    from megatron.core.transformer.experimental_attention_variant.dsa import (DSAIndexerLossAutoScaler,
                                                                              DSAIndexerLossLoggingHelper)

    if layer_number is not None and 1 <= layer_number <= num_layers:   # MTP layers are not in the log
        tracker = DSAIndexerLossLoggingHelper.tracker
        if "values" not in tracker or tracker["values"].numel() != num_layers:
            tracker["values"] = torch.zeros(num_layers, device=loss.device)
        DSAIndexerLossLoggingHelper.save_loss_to_tracker(loss, layer_number, num_layers)
    return DSAIndexerLossAutoScaler.apply(out, loss)


__all__ = ["DSAIndexer", "DSAttention", "apply_half_rope", "attach_indexer_loss", "dsa_comm_bytes",
           "is_skip_topk_layer", "source_topk_layer"]
