"""Shared base of the GDN and KDA mixers: a megatron-core ``self_attention`` submodule around a delta-rule op.

Data flow (``s = seq / cp`` local tokens in the CP layout, ``b`` batch, ``h`` hidden; under sequence
parallelism the input and output hold ``s / tp`` of them)::

    hidden [s(/tp), b, h] -> in_proj (column parallel, fused) -> [s, b, D_local]
        -> q, k, v: short causal conv + SiLU (CP halo when CP > 1)
        -> delta-rule op (l2-normalized q/k, sigmoid beta, gate computed in the kernel; CP engine when CP > 1)
        -> gated RMSNorm per head -> out_proj (row parallel) -> ([s(/tp), b, h], bias or None)

Tensor parallelism splits heads: every TP rank holds ``H/tp`` query/key heads and ``HV/tp`` value heads
(value head i reads query/key head ``i // (HV/H)``, so contiguous head slices stay consistent).

The concerns live apart (in ``layers.mixers.delta``): the option table in ``options``, the parameter layout and its
layout-independent initialisation in ``params``, checkpoint sharding in ``checkpoint``, the CP context of a forward
(and ``cp_method="auto"``) in ``cp``; this module builds the layer and
runs its forward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                  set_tensor_model_parallel_attributes)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from layers.base.choices import CP_LAYOUTS
from layers.base.keywords import check_keywords, declared_keywords
from layers.cp.choice_log import log_cp_choice
from layers.cp.sequence import packed_cu_seqlens
from layers.mixers.delta.checkpoint import delta_sharded_state_dict
from layers.mixers.delta.cp import cp_context
from layers.mixers.delta.decode import delta_inference_forward
from layers.mixers.delta.options import (COMMON_OPTIONS, check_cp_auto_options, positive_int, resolve_cp_method,
                                         resolve_options)
from layers.mixers.delta.params import (ParamLayout, Part, ShortConvWeights, constant_init, initialize, megatron_init,
                                        skip_init, uniform_init)
from layers.ops import causal_conv1d
from layers.ops.backends import get_backend
from layers.ops.delta_rule import chunk_op
from layers.ops.kinds import delta_kind
from layers.ops.step import causal_conv1d_step
from layers.shared.inference import static_context
from layers.shared.masks import check_causal_mask
from layers.shared.norm import GATE_ACTIVATIONS, GatedRMSNorm
from layers.shared.parallel import ContextParallelMixer, group_rank, group_size, spec_module, tp_cp_groups
from layers.shared.recompute import PartRecompute, recomputes
from layers.shared.tp_replicated_grads import sum_grad_over_tp


def _param_device(config):
    if getattr(config, "use_cpu_initialization", False) or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


# --------------------------------------------------------------------------------------------------------------


@dataclass
class DeltaMixerSubmodules:
    """Spec-swappable parts of a delta-rule mixer (column/row-parallel linear classes and the output norm).

    ``out_norm`` may be :class:`layers.shared.norm.GatedRMSNorm` (it then applies the gate itself) or any plain
    norm built as ``(config=, hidden_size=, eps=)`` (the mixer multiplies by the activated gate in fp32).
    """

    in_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    out_norm: Union[ModuleSpec, type] = GatedRMSNorm
    out_proj: Union[ModuleSpec, type] = RowParallelLinear


class DeltaMixer(ContextParallelMixer, MegatronModule):
    """Base class of :class:`layers.GatedDeltaNet` and :class:`layers.KimiDeltaAttention`.

    Subclasses set ``kind`` (the name of a ``layers.ops.kinds`` descriptor; part of the shape ``layers.mixers.delta.cp``
    describes, and what the decode path runs), ``gate_activation`` and ``OPTIONS``, and implement
    :meth:`_in_proj_parts`, :meth:`_extra_layouts`, :meth:`_build_extra` and :meth:`gates` (read by the
    forward and by the decode path, ``layers/mixers/delta/decode.py``).
    """

    kind = None
    gate_activation = "silu"
    OPTIONS = COMMON_OPTIONS
    beta_sigmoid_in_kernel = True   # :meth:`gates` returns beta raw (the op applies the sigmoid)

    def __init__(self, config, submodules: DeltaMixerSubmodules = None, layer_number: Optional[int] = None,
                 pg_collection=None, cp_comm_type=None, attn_mask_type=None, **kwargs):
        super().__init__(config=config)
        name = type(self).__name__
        delta_kind(self.kind)   # a subclass names a registered kind (ValueError naming the known ones otherwise)
        submodules = submodules if submodules is not None else DeltaMixerSubmodules()
        overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in self.OPTIONS}
        check_keywords(name, kwargs, list(self.OPTIONS) + declared_keywords(DeltaMixer))
        self._check_mask_type(attn_mask_type)
        opts = resolve_options(self.OPTIONS, config, overrides, name)
        self.layer_number = layer_number
        self.hidden_size = positive_int(name, "config.hidden_size", config.hidden_size)
        self.num_key_heads = positive_int(name, "num_key_heads", opts["num_key_heads"])
        self.num_value_heads = positive_int(name, "num_value_heads", opts["num_value_heads"] or self.num_key_heads)
        self.key_head_dim = positive_int(name, "key_head_dim", opts["key_head_dim"])
        self.value_head_dim = positive_int(name, "value_head_dim", opts["value_head_dim"] or self.key_head_dim)
        self.conv_kernel_dim = positive_int(name, "conv_kernel_dim", opts["conv_kernel_dim"])
        self.conv_bias = bool(opts["conv_bias"])
        self.conv_init = opts["conv_init"]
        self.A_init_range = tuple(opts["A_init_range"])
        if len(self.A_init_range) != 2 or not 0 < self.A_init_range[0] <= self.A_init_range[1]:
            raise ValueError(f"{name}: A_init_range must be (low, high) with 0 < low <= high, got {self.A_init_range}")
        self.norm_eps = float(opts["norm_eps"] if opts["norm_eps"] is not None else config.layernorm_epsilon)
        self.backend = opts["backend"]
        backend_module = get_backend(self.backend)  # validates the name; a missing optional backend raises now
        self.cp_method, self.cp_ulysses_degree, cp_source = resolve_cp_method(name, opts, cp_comm_type, config)
        if cp_source == "set":
            cp_source = "ModuleSpec.params cp_method" if overrides.get("cp_method") is not None else \
                "config.delta_cp_method"
        self.cp_layout = opts["cp_layout"]
        # --recompute-modules hp_conv / hp_gated_norm (shared/recompute.py): outputs freed, recomputed in backward
        self.recompute_conv = recomputes(config, "hp_conv")
        self.recompute_norm = recomputes(config, "hp_gated_norm")
        # with hp_conv, a backend whose standalone q/k L2 norm is its in-kernel one (triton: FLA's l2norm) normalises
        # q/k inside the recomputed part and runs the op without it: the op then keeps the part's freed outputs
        self._part_l2norm = getattr(backend_module, "qk_l2norm", None) if self.recompute_conv else None
        if self.cp_layout not in CP_LAYOUTS:
            raise ValueError(f"{name}: cp_layout must be one of {CP_LAYOUTS}, got {self.cp_layout!r}")
        self.cp_group_size = opts["cp_group_size"]
        if self.cp_method == "grouped_allgather_p2p" and self.cp_group_size is None:
            raise ValueError(f"{name}: cp_method='grouped_allgather_p2p' needs cp_group_size (ranks per "
                             "all-gather group; must divide the CP size)")
        self.init_seed = opts["init_seed"]
        check_cp_auto_options(name, self.cp_method, opts, overrides)
        self.options = opts
        self.comm_stats = None   # a layers.cp.CommStats turns communication accounting on for this layer
        self.cp_contexts = {}    # BSHD CP contexts per (group, configuration); THD ones live on the micro-batch
        self.cp_auto_choices = {}   # cp_method="auto": CP group -> (method, group_size, ulysses_degree) chosen
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"{name}: num_value_heads={self.num_value_heads} must be a multiple of "
                             f"num_key_heads={self.num_key_heads}")

        self.tp_group, self.cp_group = tp_cp_groups(pg_collection)
        self.tp_size, self.tp_rank = group_size(self.tp_group), group_rank(self.tp_group)
        self.cp_method_source = cp_source   # what chose cp_method (docs/cp.md, "Which CP method")
        if group_size(self.cp_group) > 1:
            log_cp_choice(self.kind.upper(), f"H={self.num_key_heads} HV={self.num_value_heads} K={self.key_head_dim} "
                          f"V={self.value_head_dim}", group_size(self.cp_group), self.cp_method, cp_source)
        for label, heads in (("num_key_heads", self.num_key_heads), ("num_value_heads", self.num_value_heads)):
            if heads % self.tp_size:
                raise ValueError(f"{name}: {label}={heads} must be divisible by the tensor-parallel size "
                                 f"{self.tp_size}")
        self.key_heads_local = self.num_key_heads // self.tp_size
        self.value_heads_local = self.num_value_heads // self.tp_size
        self.key_dim = self.num_key_heads * self.key_head_dim
        self.value_dim = self.num_value_heads * self.value_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim

        device, dtype = _param_device(config), config.params_dtype
        self._in_parts = self._in_proj_parts()
        self.in_proj = build_module(
            submodules.in_proj, self.hidden_size, sum(rows for _, rows in self._in_parts), config=config,
            init_method=skip_init, gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
            tp_comm_buffer_name="fc1", tp_group=self.tp_group)
        self.conv1d = ShortConvWeights(self.conv_dim // self.tp_size, self.conv_kernel_dim, self.conv_bias,
                                       device, dtype)
        for p in self.conv1d.parameters():
            set_tensor_model_parallel_attributes(p, True, 0, 1)
        self._build_extra(submodules, device, dtype)
        self.out_norm = self._build_out_norm(submodules.out_norm)
        self.out_proj = build_module(
            submodules.out_proj, self.value_dim, self.hidden_size, config=config, init_method=skip_init,
            bias=False, input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_comm_buffer_name="fc2",
            tp_group=self.tp_group)
        self.param_layouts = self._param_layouts()   # {parameter path: ParamLayout}: fused ones as their parts
        self.reset_parameters()

    # ---------------------------------------------------------------- construction helpers

    def _check_mask_type(self, attn_mask_type):
        if attn_mask_type is None:
            return
        label = getattr(attn_mask_type, "name", str(attn_mask_type))
        if label not in ("causal", "padding_causal"):
            raise ValueError(f"{type(self).__name__} is causal; attn_mask_type must be causal, got {label}")

    def _build_out_norm(self, spec):
        cls = spec_module(spec)
        kwargs = dict(config=self.config, hidden_size=self.value_head_dim, eps=self.norm_eps)
        if isinstance(cls, type) and issubclass(cls, GatedRMSNorm):
            kwargs.update(activation=self.gate_activation, backend=self.backend)  # triton: FLA's fused kernel
        norm = build_module(spec, **kwargs)
        self._norm_applies_gate = isinstance(norm, GatedRMSNorm)
        # The norm weight is shared by all heads while the heads are split over TP: every rank's gradient is
        # partial; summed over TP once per step under SP by megatron's finalize_model_grads, without SP by a hook
        # (per micro-batch, or once per step with layers.shared.tp_replicated_grads.finalize_model_grads)
        for p in norm.parameters():
            sum_grad_over_tp(p, self.config, self.tp_group)
        return norm

    def _common_layouts(self) -> list:
        """Layouts of in_proj, conv1d and out_proj (the subclass adds A_log, dt_bias, ...)."""
        cfg, hid, W = self.config, self.hidden_size, self.conv_kernel_dim
        init = megatron_init(cfg.init_method)
        conv_bound = self.conv_init if self.conv_init is not None else 1.0 / math.sqrt(W)
        conv_names = (("query", self.key_dim), ("key", self.key_dim), ("value", self.value_dim))
        layouts = [
            ParamLayout("in_proj.weight", 0, tuple(Part(n, (rows, hid), init) for n, rows in self._in_parts)),
            ParamLayout("conv1d.weight", 0, tuple(Part(n, (rows, 1, W), uniform_init(-conv_bound, conv_bound))
                                                  for n, rows in conv_names)),
            ParamLayout("out_proj.weight", 1, (Part(None, (hid, self.value_dim),
                                                    megatron_init(cfg.output_layer_init_method)),)),
        ]
        if self.conv_bias:
            layouts.append(ParamLayout("conv1d.bias", 0, tuple(Part(n, (rows,), constant_init(0.0))
                                                               for n, rows in conv_names)))
        return layouts

    def _param_layouts(self) -> dict:
        layouts = {lay.path: lay for lay in self._common_layouts() + self._extra_layouts()}
        params = dict(self.named_parameters())
        for path, lay in layouts.items():
            expected = tuple(self._local_shape(lay))
            if path not in params or tuple(params[path].shape) != expected:
                got = tuple(params[path].shape) if path in params else None
                raise ValueError(f"{type(self).__name__}: parameter {path} has shape {got}, expected {expected} "
                                 "(does the spec's linear class follow megatron's Column/RowParallelLinear?)")
        return layouts

    def _local_shape(self, lay: ParamLayout):
        shape = list(lay.parts[0].shape)
        dim = 0 if lay.tp_dim is None else lay.tp_dim
        shape[dim] = sum(lay.local_sizes(self.tp_size))
        return shape

    # ---------------------------------------------------------------- parameters

    def reset_parameters(self):
        """Draw every global logical tensor from its own seeded generator and keep this rank's slice."""
        if not getattr(self.config, "perform_initialization", True):
            return
        base = self.init_seed if self.init_seed is not None else torch.initial_seed()
        initialize(dict(self.named_parameters()), self.param_layouts, base, self.layer_number, self.tp_rank,
                   self.tp_size)

    @torch.no_grad()
    def load_global_parts(self, tensors: dict) -> None:
        """Load global logical tensors (``{"in_proj.weight.query": ..., "A_log": ..., "out_norm.weight": ...}``,
        see :meth:`global_part_names`) into this rank's parameters, for any TP size."""
        params = dict(self.named_parameters())
        missing = set(self.global_part_names()) - set(tensors)
        unexpected = set(tensors) - set(self.global_part_names())
        if missing or unexpected:
            raise ValueError(f"load_global_parts: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        for path, lay in self.param_layouts.items():
            parts = {p.name: tensors[lay.key(p)] for p in lay.parts}
            params[path].copy_(lay.shard(parts, self.tp_rank, self.tp_size))
        for path, p in params.items():
            if path not in self.param_layouts:
                p.copy_(tensors[path])

    def global_part_names(self) -> list:
        """Names of the global logical tensors (fused parameters split into their parts); these are also the
        keys ``sharded_state_dict`` saves under."""
        names = []
        for path, _ in self.named_parameters():
            lay = self.param_layouts.get(path)
            names.extend([path] if lay is None else [lay.key(p) for p in lay.parts])
        return names

    @torch.no_grad()
    def global_parts(self, local: Optional[dict] = None) -> dict:
        """Global logical tensors gathered over TP (collective on the TP group).

        ``local`` maps parameter paths to local tensors of the parameters' shapes (default: the parameters;
        pass e.g. ``{n: p.grad for n, p in layer.named_parameters()}`` for gradients).
        """
        local = dict(self.named_parameters()) if local is None else local
        out = {}
        for path, _ in self.named_parameters():
            lay = self.param_layouts.get(path)
            if lay is None:
                out[path] = local[path].detach().clone()
                continue
            for name, tensor in lay.gather(local[path], self.tp_group, self.tp_size).items():
                out[lay.key(Part(name, ()))] = tensor
        return out

    # ---------------------------------------------------------------- forward

    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *, inference_params=None,
                **kwargs):
        """``hidden_states [s, b, h]`` -> ``(output [s, b, h], bias or None)``; positional embeddings are unused.
        With megatron-core's ``StaticInferenceContext`` (eval mode) the layer keeps its state cache there
        (``layers/mixers/delta/decode.py``)."""
        name = type(self).__name__
        if key_value_states is not None:
            raise ValueError(f"{name} is a self-attention mixer; key_value_states must be None")
        if attention_bias is not None:
            raise ValueError(f"{name} cannot apply attention_bias; got a tensor of shape "
                             f"{tuple(attention_bias.shape)}")
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.ndim != 3:
            raise ValueError(f"{name}: hidden_states must be [s, b, h], got "
                             f"{getattr(hidden_states, 'shape', type(hidden_states).__name__)}")
        cp_group = self.cp_group_for(packed_seq_params)
        cp_size = group_size(cp_group)
        context = static_context(name, self, inference_context, inference_params, cp_size=cp_size,
                                 sequence_parallel=self.config.sequence_parallel and self.tp_size > 1,
                                 packed_seq_params=packed_seq_params)
        if context is not None:   # generation: state caches in megatron's static context (delta/decode.py)
            return delta_inference_forward(self, hidden_states, context, attention_mask)
        cu_global = packed_cu_seqlens(packed_seq_params)
        check_causal_mask(attention_mask, self.cp_layout, cp_size, group_rank(cp_group), cu_global,
                          owner=type(self).__name__)

        qkv, parts = self.split_projection(hidden_states)
        batch, seq = qkv.shape[:2]
        cu_seqlens, ctx = cp_context(self, packed_seq_params, cu_global, cp_group, cp_size, seq, batch, hidden_states)
        conv_part = PartRecompute() if self.recompute_conv else None
        q, k, v = self._conv_qkv(conv_part, qkv, cu_seqlens, ctx)
        g, beta, gate, gate_keywords = self.gates(parts, hidden_states)
        core, _ = chunk_op(self.kind)(
            q, k, v, g, beta, use_qk_l2norm_in_kernel=conv_part is None or self._part_l2norm is None,
            use_beta_sigmoid_in_kernel=self.beta_sigmoid_in_kernel, use_gate_in_kernel=True, cu_seqlens=cu_seqlens,
            cp_context=ctx,
            backend=self.backend, **gate_keywords)
        if conv_part is not None:
            conv_part.discard(core)   # q, k, v refilled before the op's backward
        if self.recompute_norm:
            norm_part = PartRecompute()
            normed = norm_part.run(self.normed_output, core, gate)   # the norm weight's gradient: in the recompute
        else:
            normed = self.normed_output(core, gate)
        out, bias = self.out_proj(normed)
        if self.recompute_norm:
            norm_part.discard(out)    # out_proj's saved input, refilled before its backward
        return out, bias

    def split_projection(self, hidden_states):
        """in_proj of ``hidden_states [s(/tp), b, h]`` -> ``(qkv [b, s, conv_dim_local], parts)``: the short conv's
        channels (query, key, value) and the other parts by name (``[b, s, rows_local]`` views)."""
        projected, _ = self.in_proj(hidden_states)  # [s, b, D_local]
        x = projected.transpose(0, 1)  # [b, s, D_local]
        # in_proj starts with query, key, value: one piece for the conv, so that every piece of the split gets a
        # gradient and its backward is one cat (q/k/v pieces left unused would each add a zero-filled gradient,
        # and a separate conv slice a slice_backward and an add)
        names = [n for n, _ in self._in_parts[3:]]
        sizes = [self.conv_dim // self.tp_size] + [rows // self.tp_size for _, rows in self._in_parts[3:]]
        qkv, *rest = torch.split(x, sizes, dim=-1)
        return qkv, dict(zip(names, rest))

    def conv_heads(self, qkv, weight, bias=None, *, step_cache=None, **conv_keywords):
        """Short causal conv + SiLU of ``qkv [b, s, conv_dim_local]`` with ``weight [C, 1, W]`` and ``bias`` (the
        conv1d parameters, passed in so that a recomputed part takes them as inputs) -> q, k ``[b, s, H_local, K]``,
        v ``[b, s, HV_local, V]`` (views of the conv output). ``conv_keywords``: ``cu_seqlens``, ``cp_context``,
        ``history`` of ``layers.ops.causal_conv1d``; ``step_cache`` (``[b, W-1, C]``): one decode step
        (``layers.ops.causal_conv1d_step``, which updates it in place)."""
        batch, seq = qkv.shape[:2]
        weight = weight.squeeze(1)
        if step_cache is not None:
            y = causal_conv1d_step(qkv, step_cache, weight, bias=bias, activation="silu", backend=self.backend)
        else:
            y = causal_conv1d(qkv, weight, bias=bias, activation="silu", backend=self.backend, **conv_keywords)
        kd, vd = self.key_heads_local * self.key_head_dim, self.value_heads_local * self.value_head_dim
        q, k, v = torch.split(y, [kd, kd, vd], dim=-1)
        return (q.reshape(batch, seq, self.key_heads_local, self.key_head_dim),
                k.reshape(batch, seq, self.key_heads_local, self.key_head_dim),
                v.reshape(batch, seq, self.value_heads_local, self.value_head_dim))

    def _conv_qkv(self, part, qkv, cu_seqlens, ctx):
        """:meth:`conv_heads` of a training forward. With ``part`` the graph is left out and q, k, v are
        contiguous copies, so that the op keeps them as given (FLA's kernels copy strided inputs) and they are
        freed with the part; the recompute re-runs the conv, with CP its halo exchange, on every rank in the
        same backward order. With ``part`` and the backend's ``qk_l2norm`` q and k leave the part L2-normalised
        (the op then runs with ``use_qk_l2norm_in_kernel=False``; normalising per token commutes with every CP
        method's exchange)."""
        def conv(x, weight, *bias):
            q, k, v = self.conv_heads(x, weight, bias[0] if bias else None, cu_seqlens=cu_seqlens, cp_context=ctx)
            if part is None:
                return q, k, v
            if self._part_l2norm is not None:   # contiguous outputs of FLA's l2norm
                q, k = self._part_l2norm(q), self._part_l2norm(k)
            return q.contiguous(), k.contiguous(), v.contiguous()

        tensors = (qkv, self.conv1d.weight) + ((self.conv1d.bias,) if self.conv1d.bias is not None else ())
        return conv(*tensors) if part is None else part.run(conv, *tensors)

    def normed_output(self, core, gate):
        """Gated output norm of ``core [b, s, HV_local, V]`` as out_proj's input ``[s, b, HV_local * V]``."""
        batch, seq = core.shape[:2]
        return self._gated_norm(core, gate).reshape(batch, seq, -1).transpose(0, 1).contiguous()

    def _gated_norm(self, core, gate):
        if self._norm_applies_gate:
            return self.out_norm(core, gate)
        act = GATE_ACTIVATIONS[self.gate_activation]
        return (self.out_norm(core).float() * act(gate.float())).to(core.dtype)

    # ---------------------------------------------------------------- checkpointing

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None, **kwargs):
        """ShardedTensors with TP axes; fused parameters split into their logical parts (TP-reshardable)."""
        return delta_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    # ---------------------------------------------------------------- subclass hooks

    def _in_proj_parts(self) -> list:
        """``[(name, global rows)]`` of the fused in_proj; must start with query, key, value."""
        raise NotImplementedError

    def _build_extra(self, submodules, device, dtype) -> None:
        raise NotImplementedError

    def _extra_layouts(self) -> list:
        raise NotImplementedError

    def gates(self, parts, hidden_states) -> tuple:
        """``(g, beta, output gate [b, s, HV_local, V], gate keywords of the op)`` from the in-projection's parts
        after query, key and value (``[b, s, rows_local]`` views, by name) and ``hidden_states [s(/tp), b, h]``;
        g raw (the op applies the in-kernel gate); beta raw when ``beta_sigmoid_in_kernel``, else activated."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (f"heads={self.num_key_heads}/{self.num_value_heads} (qk/v), head_dims={self.key_head_dim}/"
                f"{self.value_head_dim}, conv={self.conv_kernel_dim}, tp={self.tp_size}, backend={self.backend}, "
                f"cp={self.cp_method}/{self.cp_layout}")

