"""``MultiLatentAttention``: DeepSeek-style MLA as megatron-core's ``self_attention`` submodule, no TE.

Data flow per rank (megatron layout ``[s, b, ...]``; ``s`` = tokens of this CP rank, ``/TP`` under
sequence parallelism; THD packs documents with ``b = 1``)::

    kv = linear_kv_down_proj(x) -> [c (kv_lora_rank) | k_pe (qk_pos_emb_head_dim)]
    c  = kv_layernorm(c);  k_pe = rope(k_pe, global positions)
    q  = linear_q_up_proj(q_layernorm(linear_q_down_proj(x)))   (or linear_q_proj(x) without q_lora_rank)
    q  = [q_nope | rope(q_pe)]                                    per TP-local head
    K/V = linear_kv_up_proj(c) per head, keys [k_nope | k_pe]
    o  = causal softmax(q K^T * mscale^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim)) V
    o  = o * sigmoid(linear_gate_proj(x))    per head, with ``output_gate`` (Ling 3.0)
    out, bias = linear_proj(o)

Heads are split over TP (column-parallel up projections, row-parallel output). Under CP the attention
runs through ``layers.cp.mla`` (strategies ``expanded_ulysses``, ``latent_ulysses``, ``latent``).
Parameter names equal megatron-core's ``MLASelfAttention``; ``sharded_state_dict`` writes the latent
norms under Transformer Engine's fused names by default (``linear_q_up_proj.layer_norm_weight``,
``linear_kv_up_proj.layer_norm_weight``) so checkpoints interchange with megatron's TE spec.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from layers.mixers.attention.masking import document_starts
from layers.cp.auto import AutoLayer, auto_tuner
from layers.cp.choice_log import log_cp_choice
from layers.cp.cost_model import MLALayerShape
from layers.cp.mla import MLADims, check_strategy, expand_keys_values, mla_context_parallel
from layers.cp.plan import check_layout
from layers.cp.sequence import check_packed_tokens, packed_cu_seqlens, plan_for_batch
from layers.shared.inference import static_context
from layers.base.keywords import check_keywords, declared_keywords
from layers.shared.masks import check_causal_mask
from layers.mixers.mla.decode import mla_inference_forward
from layers.mixers.mla.options import MLA_CP_RULE
from layers.shared.parallel import (ContextParallelMixer, SumGradOverTP, group_rank, group_size, spec_module,
                                    tp_cp_groups)
from layers.shared.recompute import PartRecompute, recomputes
from layers.shared.rotary import MLARotary, apply_mla_rope, mla_softmax_scale

# our parameter name -> the name megatron's TE spec (fused layer-norm linears) stores it under
TE_NORM_NAMES = {"q_layernorm.weight": "linear_q_up_proj.layer_norm_weight",
                 "kv_layernorm.weight": "linear_kv_up_proj.layer_norm_weight"}


@dataclass
class MLASelfAttentionSubmodules:
    """Spec-swappable parts, the same fields as megatron-core's ``MLASelfAttentionSubmodules``."""

    linear_q_proj: Union[ModuleSpec, type] = None
    linear_q_down_proj: Union[ModuleSpec, type] = None
    linear_q_up_proj: Union[ModuleSpec, type] = None
    linear_kv_down_proj: Union[ModuleSpec, type] = None
    linear_kv_up_proj: Union[ModuleSpec, type] = None
    core_attention: Union[ModuleSpec, type] = None
    linear_proj: Union[ModuleSpec, type] = None
    q_layernorm: Union[ModuleSpec, type] = None
    kv_layernorm: Union[ModuleSpec, type] = None


def _mask_type_name(attn_mask_type):
    return getattr(attn_mask_type, "name", attn_mask_type)


class MultiLatentAttention(ContextParallelMixer, MegatronModule):
    """Multi-head latent attention (self-attention, causal) with TP, SP, packed THD and CP.

    Args beyond megatron's: ``cp_strategy`` (``"latent"`` default, or ``"latent_ulysses"``,
    ``"expanded_ulysses"``; also read from ``config.mla_cp_strategy``), ``cp_layout`` (``"zigzag"``,
    Megatron's, or ``"contiguous"``; also read from ``config.hp_cp_layout``), ``rope_type`` (overrides
    ``config.rope_type``; ``"none"`` = NoPE as in Kimi Linear), ``checkpoint_norm_names`` (``"te"`` or
    ``"local"`` names of the latent norms in ``sharded_state_dict``), ``output_gate`` (a head-wise sigmoid gate of
    the attention output, ``linear_gate_proj [heads, hidden]`` column parallel; also ``config.mla_output_gate``).
    ``comm_stats`` (a
    ``layers.cp.accounting.CommStats`` or None) records CP bytes.
    """

    def __init__(self, config, submodules: MLASelfAttentionSubmodules, layer_number: Optional[int] = None,
                 attn_mask_type=None, cp_comm_type: Optional[str] = None, pg_collection=None,
                 *, cp_strategy: Optional[str] = None, cp_layout: Optional[str] = None,
                 rope_type: Optional[str] = None, checkpoint_norm_names: str = "te", comm_stats=None,
                 output_gate: Optional[bool] = None, **kwargs):
        super().__init__(config=config)
        check_keywords("MultiLatentAttention", kwargs, declared_keywords(MultiLatentAttention))
        if _mask_type_name(attn_mask_type) not in (None, "causal"):
            raise ValueError(f"MultiLatentAttention supports only causal self-attention, got attn_mask_type="
                             f"{attn_mask_type!r}")
        if checkpoint_norm_names not in ("te", "local"):
            raise ValueError(f"checkpoint_norm_names must be 'te' or 'local', got {checkpoint_norm_names!r}")
        self.layer_number = layer_number
        self.tp_group, self.cp_group = tp_cp_groups(pg_collection)
        self.tp_size = group_size(self.tp_group)
        self.cp_layout = check_layout(cp_layout or getattr(config, "hp_cp_layout", None) or "zigzag")
        # --recompute-modules hp_mla_up_proj (layers/shared/recompute.py): per-head K/V recomputed from the latent
        self.recompute_up_proj = recomputes(config, "hp_mla_up_proj")
        self.cp_strategy, self.cp_strategy_source = self._select_strategy(cp_strategy, cp_comm_type)
        self.checkpoint_norm_names = checkpoint_norm_names
        self.comm_stats = comm_stats
        self.cp_auto_choices = {}     # cp_strategy="auto": CP group -> the strategy chosen there

        c = config
        heads = c.num_attention_heads
        if heads % self.tp_size:
            raise ValueError(f"num_attention_heads={heads} must be divisible by the TP size {self.tp_size}")
        self.dims = MLADims(heads=heads // self.tp_size, qk=c.qk_head_dim, pe=c.qk_pos_emb_head_dim,
                            v=c.v_head_dim, kv_lora_rank=c.kv_lora_rank)
        self.q_head_dim = c.qk_head_dim + c.qk_pos_emb_head_dim
        self.rotary = MLARotary.from_config(c, rope_type)
        self.softmax_scale = mla_softmax_scale(c.qk_head_dim, c.qk_pos_emb_head_dim, c.rotary_scaling_factor,
                                               c.mscale_all_dim)
        self.q_lora_rank = c.q_lora_rank
        if group_size(self.cp_group) > 1:
            log_cp_choice("MLA", f"heads={heads} r={c.kv_lora_rank} d={c.qk_head_dim} p={c.qk_pos_emb_head_dim} "
                          f"v={c.v_head_dim}", group_size(self.cp_group), self.cp_strategy, self.cp_strategy_source)

        linear = dict(config=c, init_method=c.init_method, bias=False, skip_bias_add=False, is_expert=False)
        if c.q_lora_rank is None:
            self.linear_q_proj = build_module(submodules.linear_q_proj, c.hidden_size, heads * self.q_head_dim,
                                              gather_output=False, tp_comm_buffer_name="q_proj",
                                              tp_group=self.tp_group, **linear)
        else:
            self.linear_q_down_proj = build_module(submodules.linear_q_down_proj, c.hidden_size, c.q_lora_rank,
                                                   tp_comm_buffer_name="q_down_proj",
                                                   **self._down_kwargs(submodules.linear_q_down_proj), **linear)
            self.linear_q_up_proj = build_module(submodules.linear_q_up_proj, c.q_lora_rank,
                                                 heads * self.q_head_dim, gather_output=False,
                                                 tp_comm_buffer_name="q_up_proj", tp_group=self.tp_group, **linear)
            self.q_layernorm = build_module(submodules.q_layernorm, hidden_size=c.q_lora_rank, config=c,
                                            eps=c.layernorm_epsilon)
            if self.tp_size > 1 and not c.sequence_parallel:
                # its gradient is already complete on every TP rank; with config.qk_layernorm megatron's
                # finalize_model_grads would sum it over TP by name, unless asked to average
                for param in self.q_layernorm.parameters():
                    param.average_gradients_across_tp_domain = True
        self.linear_kv_down_proj = build_module(submodules.linear_kv_down_proj, c.hidden_size,
                                                c.kv_lora_rank + c.qk_pos_emb_head_dim,
                                                tp_comm_buffer_name="kv_down_proj",
                                                **self._down_kwargs(submodules.linear_kv_down_proj), **linear)
        self.linear_kv_up_proj = build_module(submodules.linear_kv_up_proj, c.kv_lora_rank,
                                              heads * (c.qk_head_dim + c.v_head_dim), gather_output=False,
                                              tp_comm_buffer_name="kv_up_proj", tp_group=self.tp_group, **linear)
        self.kv_layernorm = build_module(submodules.kv_layernorm, hidden_size=c.kv_lora_rank, config=c,
                                         eps=c.layernorm_epsilon)
        self.core_attention = build_module(submodules.core_attention, config=c, layer_number=layer_number,
                                           attn_mask_type=attn_mask_type, attention_type="self",
                                           softmax_scale=self.softmax_scale, k_channels=self.q_head_dim,
                                           v_channels=c.v_head_dim, cp_comm_type=cp_comm_type,
                                           pg_collection=pg_collection)
        self.linear_proj = build_module(submodules.linear_proj, heads * c.v_head_dim, c.hidden_size, config=c,
                                        init_method=c.output_layer_init_method, bias=c.add_bias_linear,
                                        input_is_parallel=True, skip_bias_add=True, is_expert=False,
                                        tp_comm_buffer_name="proj", tp_group=self.tp_group)
        self.output_gate = bool(getattr(c, "mla_output_gate", False)) if output_gate is None else output_gate
        if not isinstance(self.output_gate, bool):
            raise TypeError(f"MultiLatentAttention: output_gate must be a bool, got {output_gate!r}")
        self.linear_gate_proj = None
        if self.output_gate:   # column parallel like the up projections: each rank gates its own heads
            self.linear_gate_proj = build_module(submodules.linear_kv_up_proj, c.hidden_size, heads,
                                                 gather_output=False, tp_comm_buffer_name="gate_proj",
                                                 tp_group=self.tp_group, **linear)
        for name in ("linear_q_up_proj", "linear_kv_up_proj"):
            if hasattr(getattr(self, name, None), "layer_norm_weight"):
                raise ValueError(f"{name} must be a plain column-parallel linear; fused layer-norm linears are not "
                                 "supported (put the norm in q_layernorm/kv_layernorm)")
        self.register_load_state_dict_pre_hook(self._accept_te_norm_names)

    # -- construction helpers ---------------------------------------------------------------------------
    def _select_strategy(self, cp_strategy, cp_comm_type) -> tuple:
        """``(strategy, source)`` by ``MLA_CP_RULE`` (docs/cp.md, "Which CP method"): the ``cp_strategy`` keyword,
        else ``config.mla_cp_strategy``, else megatron's ``cp_comm_type`` of this layer mapped, else ``latent``."""
        source = "ModuleSpec.params cp_strategy" if cp_strategy is not None else "config.mla_cp_strategy"
        given = cp_strategy if cp_strategy is not None else getattr(self.config, "mla_cp_strategy", None)
        strategy, how = MLA_CP_RULE.resolve(given, cp_comm_type, "MultiLatentAttention")
        strategy = strategy if strategy == "auto" else check_strategy(strategy)   # auto: layers.cp.auto
        return strategy, source if how == "set" else how

    def _down_kwargs(self, spec) -> dict:
        module = spec_module(spec)
        if isinstance(module, type) and issubclass(module, ColumnParallelLinear):
            return {"gather_output": False, "tp_group": self.tp_group}
        if self.tp_size > 1:
            raise ValueError(f"with TP={self.tp_size} the latent down projections must be ColumnParallelLinear "
                             f"(got {module!r}); replicated projections would need TP gradient reduction")
        return {}

    # -- forward ----------------------------------------------------------------------------------------
    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, position_ids=None, sequence_len_offset=None, *,
                inference_params=None, **kwargs):
        """hidden_states ``[s, b, hidden]`` -> ``(output [s, b, hidden], bias or None)``.

        ``attention_mask`` must be None or megatron's plain causal mask (the layer is causal; other masks raise
        ValueError); positions come from the CP layout and ``packed_seq_params`` (THD: global
        ``cu_seqlens_q_padded`` or ``cu_seqlens_q``). With megatron-core's ``StaticInferenceContext`` (eval mode)
        the layer keeps its latent cache there and decodes in the absorbed form (``layers/mixers/mla/decode.py``).
        """
        self._check_forward_args(hidden_states, key_value_states, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin,
                                 rotary_pos_cos_sin, attention_bias, position_ids, packed_seq_params)
        cu_seqlens = packed_cu_seqlens(packed_seq_params)
        cp_group = self.cp_group_for(packed_seq_params)
        cp_size = group_size(cp_group)
        context = static_context("MultiLatentAttention", self, inference_context, inference_params, cp_size=cp_size,
                                 sequence_parallel=self.config.sequence_parallel and self.tp_size > 1,
                                 packed_seq_params=packed_seq_params)
        if context is not None:   # generation: the latent cache in megatron's static context (mla/decode.py)
            return mla_inference_forward(self, hidden_states, context, attention_mask)
        cp_rank = group_rank(cp_group) if cp_size > 1 else 0
        check_causal_mask(attention_mask, self.cp_layout, cp_size, cp_rank, cu_seqlens, owner="MultiLatentAttention")
        dims = self.dims

        latent, rope_key = self._kv_latent(hidden_states)                # [s, b, r], [s, b, p]
        latent, rope_key = latent.transpose(0, 1), rope_key.transpose(0, 1)
        batch, seq = latent.shape[:2]
        plan, positions = self._token_positions(batch, seq, cp_size, cp_rank, packed_seq_params, cu_seqlens,
                                                latent.device)
        cos_sin = self.rotary.cos_sin(positions)
        rope_key = apply_mla_rope(rope_key, cos_sin, token_dim=1)

        def make_query():
            return self._query(hidden_states, cos_sin)

        kv_weight = self.linear_kv_up_proj.weight
        if cp_size == 1:
            query = make_query()
            if self.recompute_up_proj:   # per-head K/V freed after attention, re-expanded from the latent
                up_proj = PartRecompute()
                key, value = up_proj.run(lambda c, k, w: expand_keys_values(c, k, w, dims, dims.heads),
                                         latent, rope_key, kv_weight)
            else:
                key, value = expand_keys_values(latent, rope_key, kv_weight, dims, dims.heads)
            out = self._attention()(query, key, value, q_ids=None, cu_seqlens=cu_seqlens)
            if self.recompute_up_proj:
                up_proj.discard(out)
        else:
            if self.recompute_up_proj:
                raise ValueError(f"--recompute-modules hp_mla_up_proj works at context-parallel size 1 only (the "
                                 f"CP strategies expand K/V inside their exchange); got CP size {cp_size}")
            payload = torch.cat((latent, rope_key), dim=-1)
            strategy = self.cp_strategy
            if strategy == "auto":   # decided at the first CP forward on this group, then kept
                strategy = self._auto_strategy(cp_group, seq * cp_size if cu_seqlens is None else
                                               int(cu_seqlens[-1]), batch)
            out = mla_context_parallel(strategy, kv_payload=payload, make_query=make_query,
                                       kv_weight=kv_weight, dims=dims, attention=self._attention(),
                                       group=cp_group, layout=self.cp_layout, cu_seqlens=cu_seqlens,
                                       stats=self.comm_stats, plan=plan)
        return self.project_output(out, hidden_states)

    def project_output(self, out, hidden_states):
        """Attention output ``[b, s, heads_local(, v)]`` -> ``linear_proj``'s ``(output [s, b, hidden], bias)``, gated
        per head by ``sigmoid(linear_gate_proj(hidden_states))`` (fp32 sigmoid, as transformers) with
        ``output_gate``."""
        batch, seq, dims = out.shape[0], out.shape[1], self.dims
        out = out.reshape(batch, seq, dims.heads, dims.v)
        if self.linear_gate_proj is not None:
            gate, _ = self.linear_gate_proj(hidden_states)                # [s, b, heads_local]
            gate = torch.sigmoid(gate.float()).to(out.dtype).transpose(0, 1)
            out = out * gate.unsqueeze(-1)
        return self.linear_proj(out.reshape(batch, seq, dims.heads * dims.v).transpose(0, 1).contiguous())

    def _attention(self):
        """The core attention ``(q, k, v, q_ids=, cu_seqlens=) -> o`` this forward uses (a subclass may bind more)."""
        return self.core_attention

    def _auto_strategy(self, cp_group, seq_len: int, batch: int) -> str:
        """``cp_strategy="auto"``: the strategy chosen for ``cp_group`` (``layers.cp.auto`` on this layer's
        ``MLALayerShape``; the calibration file is the config's ``hp_cp_calibration``), decided now if this is the
        layer's first CP forward on that group (collective), else the kept one."""
        if cp_group not in self.cp_auto_choices:
            d, dtype = self.dims, self.linear_kv_up_proj.weight.dtype
            shape = MLALayerShape(batch=batch, seq_len=seq_len, heads=d.heads, qk_head_dim=d.qk,
                                  qk_pos_emb_head_dim=d.pe, v_head_dim=d.v, kv_lora_rank=d.kv_lora_rank,
                                  layout=self.cp_layout, act_bytes=dtype.itemsize,
                                  dtype=str(dtype).replace("torch.", ""))
            layer = AutoLayer(shape=shape, calibration_path=getattr(self.config, "hp_cp_calibration", None))
            self.cp_auto_choices[cp_group] = auto_tuner().choose(cp_group, layer).method
        return self.cp_auto_choices[cp_group]

    def _check_forward_args(self, hidden_states, key_value_states, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin,
                            rotary_pos_cos_sin, attention_bias, position_ids, packed_seq_params):
        if hidden_states.dim() != 3:
            raise ValueError(f"hidden_states must be [s, b, hidden], got shape {tuple(hidden_states.shape)}")
        if key_value_states is not None:
            raise ValueError("MultiLatentAttention is self-attention only; key_value_states must be None")
        if rotary_pos_emb is not None or rotary_pos_cos is not None or rotary_pos_sin is not None or \
                rotary_pos_cos_sin is not None:
            raise ValueError("MultiLatentAttention applies its own rotary embedding; rotary_pos_emb/cos/sin must "
                             "be None (megatron's GPTModel skips RoPE when config.multi_latent_attention)")
        if attention_bias is not None:
            raise ValueError("MultiLatentAttention does not support attention_bias")
        if position_ids is not None:
            raise ValueError("MultiLatentAttention derives positions from the CP layout and packed_seq_params; "
                             "explicit position_ids are not supported")

    def _token_positions(self, batch, seq, cp_size, cp_rank, packed_seq_params, cu_seqlens, device):
        """The micro-batch's sequence plan (None without CP) and rotary positions ([seq] on device) of the
        local tokens."""
        total = seq * cp_size
        check_packed_tokens("MultiLatentAttention", cu_seqlens, batch, seq, cp_size)
        plan = None if cp_size == 1 else plan_for_batch(packed_seq_params, cp_size, cp_rank, self.cp_layout, total)
        ids = torch.arange(seq) if plan is None else plan.local_index
        positions = ids - document_starts(ids, cu_seqlens) if cu_seqlens is not None else ids
        return plan, positions.to(device)

    def _kv_latent(self, hidden_states):
        """-> normalized latent [s, b, r] and un-rotated shared key [s, b, p], full local sequence, with
        gradients that are complete over TP (every TP rank's heads contribute)."""
        r, p = self.dims.kv_lora_rank, self.dims.pe
        kv, _ = self.linear_kv_down_proj(hidden_states)
        kv = self._gather_columns(kv, r + p)
        latent, rope_key = torch.split(kv, [r, p], dim=-1)
        sp = self.config.sequence_parallel and self.tp_size > 1
        if sp:
            latent = scatter_to_sequence_parallel_region(latent, group=self.tp_group)
        latent = self.kv_layernorm(latent)
        if sp:
            latent = gather_from_sequence_parallel_region(latent, group=self.tp_group)
        elif self.tp_size > 1:
            latent = SumGradOverTP.apply(latent, self.tp_group)
        if self.tp_size > 1:
            rope_key = SumGradOverTP.apply(rope_key, self.tp_group)
        return latent, rope_key

    def _gather_columns(self, x, width):
        if x.shape[-1] == width:
            return x
        if x.shape[-1] * self.tp_size != width:
            raise ValueError(f"down projection output width {x.shape[-1]} is neither {width} nor {width} / TP")
        return gather_from_tensor_model_parallel_region(x, group=self.tp_group)

    def _query(self, hidden_states, cos_sin):
        """-> rotated queries [b, s, heads, qk + pe] of the local tokens for the TP-local heads."""
        if self.q_lora_rank is None:
            q, _ = self.linear_q_proj(hidden_states)
        else:
            q, _ = self.linear_q_up_proj(self._q_latent(hidden_states))
        q = q.view(q.shape[0], q.shape[1], self.dims.heads, self.q_head_dim).transpose(0, 1)
        q_nope, q_pe = q.split((self.dims.qk, self.dims.pe), dim=-1)
        return torch.cat((q_nope, apply_mla_rope(q_pe, cos_sin, token_dim=1)), dim=-1)

    def _q_latent(self, hidden_states):
        """-> the normalized query latent [s, b, q_lora_rank] (under SP: this rank's sequence shard)."""
        qc, _ = self.linear_q_down_proj(hidden_states)
        qc = self._gather_columns(qc, self.q_lora_rank)
        if self.config.sequence_parallel and self.tp_size > 1:
            qc = scatter_to_sequence_parallel_region(qc, group=self.tp_group)
        return self.q_layernorm(qc)

    # -- checkpoints ------------------------------------------------------------------------------------
    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """megatron dist_checkpointing state: TP-sharded projections (replicated over CP); the latent norms'
        checkpoint keys are TE's fused names when ``checkpoint_norm_names == "te"`` (the dict keys stay this
        module's state-dict keys, as megatron's convention has it)."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.checkpoint_norm_names != "te":
            return sharded
        for key, value in sharded.items():
            local = key[len(prefix):] if key.startswith(prefix) else key
            if local in TE_NORM_NAMES and hasattr(value, "key"):
                value.key = value.key[: len(value.key) - len(local)] + TE_NORM_NAMES[local]
        return sharded

    @staticmethod
    def _accept_te_norm_names(module, state_dict, prefix, *args):
        """Load-state-dict pre-hook (``nn.Module.register_load_state_dict_pre_hook``: called with the module
        first): TE's fused norm names are read as ours."""
        for ours, te in TE_NORM_NAMES.items():
            if prefix + te in state_dict and prefix + ours not in state_dict:
                state_dict[prefix + ours] = state_dict.pop(prefix + te)


# -- transformers (DeepSeek-V3 / Kimi-Linear / Ling 3.0) state dicts ---------------------------------------------
# transformers name -> ours; q_b_proj/q_proj/kv_b_proj/o_proj are split over TP by heads.
HF_TO_MLA = {
    "q_proj.weight": "linear_q_proj.weight",
    "q_a_proj.weight": "linear_q_down_proj.weight",
    "q_a_layernorm.weight": "q_layernorm.weight",
    "q_b_proj.weight": "linear_q_up_proj.weight",
    "kv_a_proj_with_mqa.weight": "linear_kv_down_proj.weight",
    "kv_a_layernorm.weight": "kv_layernorm.weight",
    "kv_b_proj.weight": "linear_kv_up_proj.weight",
    "o_proj.weight": "linear_proj.weight",
    "o_proj.bias": "linear_proj.bias",
    "g_proj.weight": "linear_gate_proj.weight",   # Ling 3.0's head-wise output gate (output_gate)
}


def _rope_to_interleaved(dim: int) -> torch.Tensor:
    """Row order turning transformers' half-split rotary channels into interleaved pairs (ours)."""
    half = torch.arange(dim // 2)
    return torch.stack((half, half + dim // 2), dim=1).reshape(-1)


def _permute_rope_rows(weight, groups, group_width, pe, order):
    """Reorder the last ``pe`` rows of each of ``groups`` row groups of width ``group_width``."""
    rows = weight.reshape(groups, group_width, -1).clone()
    rows[:, group_width - pe:] = rows[:, group_width - pe:][:, order]
    return rows.reshape(weight.shape)


def _tp_slice(name, tensor, tp_rank, tp_size):
    if tp_size == 1:
        return tensor
    if name in ("linear_q_proj.weight", "linear_q_up_proj.weight", "linear_kv_up_proj.weight",
                "linear_q_down_proj.weight", "linear_kv_down_proj.weight", "linear_gate_proj.weight"):
        return tensor.chunk(tp_size, dim=0)[tp_rank].clone()
    if name == "linear_proj.weight":
        return tensor.chunk(tp_size, dim=1)[tp_rank].clone()
    return tensor


def mla_state_dict_from_hf(hf_state: dict, config, *, rope_interleave: bool = True, tp_rank: int = 0,
                           tp_size: int = 1) -> dict:
    """Our (TP-rank ``tp_rank``) state dict from a transformers ``DeepseekV3Attention`` /
    ``KimiLinearAttention`` state dict (keys relative to the attention module).

    ``rope_interleave=False`` (transformers' half-split rotary layout) reorders the rotary rows of the
    query and shared-key projections into megatron's interleaved pairs. Biases other than ``o_proj``'s
    are rejected (megatron's MLA has none).
    """
    unknown = sorted(k for k in hf_state if k not in HF_TO_MLA)
    if unknown:
        raise ValueError(f"unsupported transformers MLA parameters {unknown} (attention_bias on the latent "
                         "projections has no megatron counterpart)")
    pe, q_dim = config.qk_pos_emb_head_dim, config.qk_head_dim + config.qk_pos_emb_head_dim
    out = {}
    for hf_name, tensor in hf_state.items():
        name = HF_TO_MLA[hf_name]
        tensor = tensor.detach()
        if not rope_interleave and config.qk_pos_emb_head_dim:
            order = _rope_to_interleaved(pe)
            if name in ("linear_q_proj.weight", "linear_q_up_proj.weight"):
                tensor = _permute_rope_rows(tensor, config.num_attention_heads, q_dim, pe, order)
            elif name == "linear_kv_down_proj.weight":
                tensor = _permute_rope_rows(tensor, 1, tensor.shape[0], pe, order)
        out[name] = _tp_slice(name, tensor, tp_rank, tp_size)
    return out


def mla_state_dict_to_hf(state: dict, config, *, rope_interleave: bool = True) -> dict:
    """Inverse of :func:`mla_state_dict_from_hf` for a TP=1 state dict (TE norm names accepted)."""
    back = {v: k for k, v in HF_TO_MLA.items()}
    for ours, te in TE_NORM_NAMES.items():
        back[te] = back[ours]
    pe, q_dim = config.qk_pos_emb_head_dim, config.qk_head_dim + config.qk_pos_emb_head_dim
    inverse = torch.argsort(_rope_to_interleaved(pe)) if pe else None
    out = {}
    for name, tensor in state.items():
        if name not in back:
            if name.endswith("_extra_state"):
                continue
            raise ValueError(f"parameter {name!r} has no transformers counterpart")
        tensor = tensor.detach()
        if not rope_interleave and pe:
            if name in ("linear_q_proj.weight", "linear_q_up_proj.weight"):
                tensor = _permute_rope_rows(tensor, config.num_attention_heads, q_dim, pe, inverse)
            elif name == "linear_kv_down_proj.weight":
                tensor = _permute_rope_rows(tensor, 1, tensor.shape[0], pe, inverse)
        out[back[name]] = tensor
    return out


__all__ = ["MultiLatentAttention", "MLASelfAttentionSubmodules",
           "mla_state_dict_from_hf", "mla_state_dict_to_hf", "HF_TO_MLA", "TE_NORM_NAMES"]
