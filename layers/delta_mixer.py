"""Shared base of the GDN and KDA mixers: a megatron-core ``self_attention`` submodule around a delta-rule op.

Data flow (``s = seq / cp`` local tokens in the CP layout, ``b`` batch, ``h`` hidden; under sequence
parallelism the input and output hold ``s / tp`` of them)::

    hidden [s(/tp), b, h] -> in_proj (column parallel, fused) -> [s, b, D_local]
        -> q, k, v: short causal conv + SiLU (CP halo when CP > 1)
        -> delta-rule op (l2-normalized q/k, sigmoid beta, gate computed in the kernel; CP engine when CP > 1)
        -> gated RMSNorm per head -> out_proj (row parallel) -> ([s(/tp), b, h], bias or None)

Tensor parallelism splits heads: every TP rank holds ``H/tp`` query/key heads and ``HV/tp`` value heads
(value head i reads query/key head ``i // (HV/H)``, so contiguous head slices stay consistent). Fused
parameters (``in_proj.weight``, ``conv1d.weight``) hold, on each rank, the concatenation of that rank's slice
of every logical part; checkpoints store the parts separately (``in_proj.weight.query`` ...) so
``dist_checkpointing`` reshards across TP sizes, as megatron-core's own GatedDeltaNet does.

Initialization draws every *global* logical tensor from a generator seeded by ``(init_seed, layer_number,
tensor name)`` and keeps this rank's slice, so the weights do not depend on the TP/CP layout.

Options come, in this order of precedence, from constructor keywords (``ModuleSpec.params``), from fields
of the config (megatron-core 0.16's ``linear_*`` fields, or our own ``hp_cp_layout`` / ``delta_*`` / ``kda_*``
fields, declared by ``hp_megatron.config.HybridTransformerConfig``; read with ``getattr``, so a plain
``TransformerConfig`` works too) and from defaults; see :data:`COMMON_OPTIONS` and ``docs/layers.md``.
"""
from __future__ import annotations

import inspect
import math
import zlib
from dataclasses import dataclass, replace
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                  set_tensor_model_parallel_attributes)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from layers.choices import CP_LAYOUTS
from layers.choices import CP_METHOD_CHOICES as CP_METHODS
from layers.cp import CommStats, build_cp_context
from layers.cp.auto import MEASURE_TOP
from layers.cp.sequence import micro_batch_cache, packed_cu_seqlens
from layers.keywords import check_keywords, declared_keywords
from layers.masks import check_causal_mask
from layers.norm import GATE_ACTIVATIONS, GatedRMSNorm
from layers.ops import causal_conv1d
from layers.ops.backends import get_backend

DEFAULT_CP_METHOD = "allgather"
# megatron's --cp-comm-type values -> our CP methods (used when no method is configured explicitly)
CP_COMM_TYPE_METHODS = {"p2p": "p2p", "all_gather": "allgather", "a2a": "ulysses", "a2a+p2p": "p2p"}

_REQUIRED = object()


@dataclass(frozen=True)
class Option:
    """One mixer option: the config attributes it may be read from and its default."""

    config_attrs: tuple = ()
    default: object = None


COMMON_OPTIONS = {
    "num_key_heads": Option(("linear_num_key_heads",), _REQUIRED),
    "num_value_heads": Option(("linear_num_value_heads",), None),  # None -> num_key_heads
    "key_head_dim": Option(("linear_key_head_dim",), _REQUIRED),
    "value_head_dim": Option(("linear_value_head_dim",), None),  # None -> key_head_dim
    "conv_kernel_dim": Option(("linear_conv_kernel_dim",), 4),
    "conv_bias": Option(("linear_conv_bias",), False),
    "conv_init": Option((), None),  # None -> U(-1/sqrt(W), 1/sqrt(W)), nn.Conv1d's default
    "A_init_range": Option((), (1.0, 16.0)),
    "norm_eps": Option((), None),  # None -> config.layernorm_epsilon
    "backend": Option(("delta_backend",), "eager"),
    "cp_method": Option(("delta_cp_method",), None),  # None -> cp_comm_type mapping, else DEFAULT_CP_METHOD
    "cp_layout": Option(("hp_cp_layout",), "zigzag"),
    "cp_group_size": Option(("delta_cp_group_size",), None),
    "cp_ulysses_degree": Option(("delta_cp_ulysses_degree",), None),
    "cp_calibration": Option(("delta_cp_calibration",), None),  # cp_method="auto": calibration JSON cache path
    "cp_auto_measure": Option(("delta_cp_auto_measure",), MEASURE_TOP),  # auto: best candidates timed on the layer
    "init_seed": Option(("delta_init_seed",), None),  # None -> torch.initial_seed()
}


def resolve_options(table: dict, config, overrides: dict, owner: str) -> dict:
    """Resolve every option of ``table``: keyword override, then config attributes, then the default."""
    values = {}
    for name, opt in table.items():
        if name in overrides and overrides[name] is not None:
            values[name] = overrides[name]
            continue
        value = None
        for attr in opt.config_attrs:
            value = getattr(config, attr, None)
            if value is not None:
                break
        if value is None:
            if opt.default is _REQUIRED:
                where = f" or config.{opt.config_attrs[0]}" if opt.config_attrs else ""
                raise ValueError(f"{owner} needs {name}: pass it in ModuleSpec.params{where}")
            value = opt.default
        values[name] = value
    return values


def _positive_int(owner, name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")
    return value


# --------------------------------------------------------------------------------------------------------------
# Parameter layout: which global logical tensors make up each local parameter


@dataclass(frozen=True)
class Part:
    """A global logical tensor that (a TP slice of) a local parameter holds."""

    name: Optional[str]  # checkpoint suffix (None: the parameter is this one tensor)
    shape: tuple  # global shape
    init: Optional[Callable[[torch.Tensor], None]] = None  # in-place init of the fp32 CPU master


@dataclass(frozen=True)
class ParamLayout:
    """A local parameter = concatenation along ``tp_dim`` of this rank's slice of every part.

    ``tp_dim`` None means replicated over TP (the parts are concatenated along dim 0 and not sliced).
    """

    path: str  # e.g. "in_proj.weight"
    tp_dim: Optional[int]
    parts: tuple

    @property
    def cat_dim(self) -> int:
        return 0 if self.tp_dim is None else self.tp_dim

    def local_sizes(self, tp_size: int) -> list:
        div = 1 if self.tp_dim is None else tp_size
        return [p.shape[self.cat_dim] // div for p in self.parts]

    def key(self, part) -> str:
        return self.path if part.name is None else f"{self.path}.{part.name}"

    def shard(self, tensors: dict, tp_rank: int, tp_size: int) -> torch.Tensor:
        """This rank's local parameter from the global parts (``tensors[part.name]``)."""
        pieces = []
        for part in self.parts:
            t = tensors[part.name]
            if tuple(t.shape) != tuple(part.shape):
                raise ValueError(f"{self.path}{'.' + part.name if part.name else ''} must have global shape "
                                 f"{tuple(part.shape)}, got {tuple(t.shape)}")
            if self.tp_dim is not None:
                t = t.chunk(tp_size, dim=self.tp_dim)[tp_rank]
            pieces.append(t)
        return torch.cat(pieces, dim=self.cat_dim)

    def gather(self, local: torch.Tensor, tp_group, tp_size: int) -> dict:
        """Inverse of :meth:`shard`: all-gather the local tensor over TP -> ``{part.name: global tensor}``."""
        pieces = torch.split(local.detach(), self.local_sizes(tp_size), dim=self.cat_dim)
        out = {}
        for part, piece in zip(self.parts, pieces):
            if self.tp_dim is not None and tp_size > 1:
                bufs = [torch.empty_like(piece) for _ in range(tp_size)]
                dist.all_gather(bufs, piece.contiguous(), group=tp_group)
                piece = torch.cat(bufs, dim=self.tp_dim)
            out[part.name] = piece.clone()
        return out


def _seed_for(base: int, layer_number, path: str, part: Optional[str]) -> int:
    return zlib.crc32(f"{base}/{layer_number}/{path}/{part}".encode())


def uniform_init(low: float, high: float):
    return lambda t: t.uniform_(low, high)


def log_uniform_init(low: float, high: float):
    """A_log-style init: log of U(low, high)."""
    return lambda t: t.uniform_(low, high).log_()


def constant_init(value: float):
    return lambda t: t.fill_(value)


def inverse_softplus_dt_init(dt_min: float = 1e-3, dt_max: float = 0.1, dt_floor: float = 1e-4):
    """dt_bias init of Mamba/FLA/Kimi: softplus^-1(dt) with dt log-uniform in [dt_min, dt_max]."""
    def init(t):
        dt = t.uniform_(math.log(dt_min), math.log(dt_max)).exp_().clamp_min_(dt_floor)
        t.copy_(dt + torch.log(-torch.expm1(-dt)))
    return init


def megatron_init(init_method) -> Callable[[torch.Tensor], None]:
    """Wrap a megatron ``init_method`` (in-place on a tensor, global RNG) as a Part init."""
    return lambda t: init_method(t)


def _skip_init(tensor):
    """init_method handed to the linears: our ``reset_parameters`` writes the real values afterwards."""
    return tensor


# --------------------------------------------------------------------------------------------------------------
# Small modules and autograd helpers


class ShortConvWeights(nn.Module):
    """Parameters of the depthwise causal conv: ``weight [D, 1, W]`` (``nn.Conv1d``'s layout), ``bias [D]``."""

    def __init__(self, channels: int, kernel_size: int, bias: bool, device, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(channels, device=device, dtype=dtype)) if bias else None
        if bias:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return f"channels={self.weight.shape[0]}, kernel_size={self.weight.shape[2]}, bias={self.bias is not None}"


class ReplicatedLinear(nn.Module):
    """``y = x W^T`` with W replicated over TP (KDA's low-rank gate down-projections).

    Under sequence parallelism it runs on sequence shards, so its weight is marked ``sequence_parallel`` and
    megatron's grad finalization sums the weight gradient over the TP group.
    """

    def __init__(self, in_features: int, out_features: int, config, device, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        setattr(self.weight, "sequence_parallel", bool(getattr(config, "sequence_parallel", False)))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight)


def _all_reduce_grad_hook(group):
    def hook(grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=group)
        return grad
    return hook


def _param_device(config):
    if getattr(config, "use_cpu_initialization", False) or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _call_with_supported(fn, *args, **kwargs):
    """Call ``fn`` dropping keywords it does not take (megatron-core 0.14/0.15 vs 0.16 signatures)."""
    params = inspect.signature(fn).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(*args, **kwargs)


def _module_class(spec):
    if isinstance(spec, ModuleSpec):
        module = spec.module
        if isinstance(module, tuple):
            import importlib

            module = getattr(importlib.import_module(module[0]), module[1])
        return module
    return spec


# --------------------------------------------------------------------------------------------------------------


@dataclass
class DeltaMixerSubmodules:
    """Spec-swappable parts of a delta-rule mixer (column/row-parallel linear classes and the output norm).

    ``out_norm`` may be :class:`layers.norm.GatedRMSNorm` (it then applies the gate itself) or any plain
    norm built as ``(config=, hidden_size=, eps=)`` (the mixer multiplies by the activated gate in fp32).
    """

    in_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    out_norm: Union[ModuleSpec, type] = GatedRMSNorm
    out_proj: Union[ModuleSpec, type] = RowParallelLinear


class DeltaMixer(MegatronModule):
    """Base class of :class:`layers.GatedDeltaNet` and :class:`layers.KimiDeltaAttention`.

    Subclasses set ``kind`` (``"gdn" | "kda"``, read by ``layers.cp.auto``), ``gate_activation`` and ``OPTIONS``,
    and implement
    :meth:`_in_proj_parts`, :meth:`_extra_layouts`, :meth:`_build_extra` and :meth:`_delta_rule`.
    """

    kind = "gdn"
    gate_activation = "silu"
    OPTIONS = COMMON_OPTIONS

    def __init__(self, config, submodules: DeltaMixerSubmodules = None, layer_number: Optional[int] = None,
                 pg_collection=None, model_comm_pgs=None, cp_comm_type=None, attn_mask_type=None, **kwargs):
        super().__init__(config=config)
        name = type(self).__name__
        submodules = submodules if submodules is not None else DeltaMixerSubmodules()
        overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in self.OPTIONS}
        check_keywords(name, kwargs, list(self.OPTIONS) + declared_keywords(DeltaMixer))
        self._check_mask_type(attn_mask_type)
        opts = resolve_options(self.OPTIONS, config, overrides, name)
        self.layer_number = layer_number
        self.hidden_size = _positive_int(name, "config.hidden_size", config.hidden_size)
        self.num_key_heads = _positive_int(name, "num_key_heads", opts["num_key_heads"])
        self.num_value_heads = _positive_int(name, "num_value_heads", opts["num_value_heads"] or self.num_key_heads)
        self.key_head_dim = _positive_int(name, "key_head_dim", opts["key_head_dim"])
        self.value_head_dim = _positive_int(name, "value_head_dim", opts["value_head_dim"] or self.key_head_dim)
        self.conv_kernel_dim = _positive_int(name, "conv_kernel_dim", opts["conv_kernel_dim"])
        self.conv_bias = bool(opts["conv_bias"])
        self.conv_init = opts["conv_init"]
        self.A_init_range = tuple(opts["A_init_range"])
        if len(self.A_init_range) != 2 or not 0 < self.A_init_range[0] <= self.A_init_range[1]:
            raise ValueError(f"{name}: A_init_range must be (low, high) with 0 < low <= high, got {self.A_init_range}")
        self.norm_eps = float(opts["norm_eps"] if opts["norm_eps"] is not None else config.layernorm_epsilon)
        self.backend = opts["backend"]
        get_backend(self.backend)  # validates the name; a missing optional backend raises RuntimeError now
        self.cp_method, self.cp_ulysses_degree = self._resolve_cp_method(opts, cp_comm_type, config)
        self.cp_layout = opts["cp_layout"]
        if self.cp_layout not in CP_LAYOUTS:
            raise ValueError(f"{name}: cp_layout must be one of {CP_LAYOUTS}, got {self.cp_layout!r}")
        self.cp_group_size = opts["cp_group_size"]
        if self.cp_method == "grouped_allgather_p2p" and self.cp_group_size is None:
            raise ValueError(f"{name}: cp_method='grouped_allgather_p2p' needs cp_group_size (ranks per "
                             "all-gather group; must divide the CP size)")
        self.init_seed = opts["init_seed"]
        measure_top = opts["cp_auto_measure"]
        if isinstance(measure_top, bool) or not isinstance(measure_top, int) or measure_top < 0:
            raise ValueError(f"{name}: cp_auto_measure must be an int >= 0 (candidates timed on the layer; 0: the "
                             f"cost model alone), got {measure_top!r}")
        self.options = opts
        self.comm_stats = None   # a layers.cp.CommStats turns communication accounting on for this layer
        self._cp_contexts = {}   # BSHD CP contexts per (group, configuration); THD ones live on the micro-batch
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"{name}: num_value_heads={self.num_value_heads} must be a multiple of "
                             f"num_key_heads={self.num_key_heads}")

        pgs = pg_collection if pg_collection is not None else model_comm_pgs
        self.tp_group = getattr(pgs, "tp", None) if pgs is not None else None
        self.cp_group = getattr(pgs, "cp", None) if pgs is not None else None
        if parallel_state.model_parallel_is_initialized():
            if self.tp_group is None:
                self.tp_group = parallel_state.get_tensor_model_parallel_group()
            if self.cp_group is None:
                self.cp_group = parallel_state.get_context_parallel_group()
        self.tp_size, self.tp_rank = _group_size(self.tp_group), _group_rank(self.tp_group)
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
            init_method=_skip_init, gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
            tp_comm_buffer_name="fc1", tp_group=self.tp_group)
        self.conv1d = ShortConvWeights(self.conv_dim // self.tp_size, self.conv_kernel_dim, self.conv_bias,
                                       device, dtype)
        for p in self.conv1d.parameters():
            set_tensor_model_parallel_attributes(p, True, 0, 1)
        self._build_extra(submodules, device, dtype)
        self.out_norm = self._build_out_norm(submodules.out_norm)
        self.out_proj = build_module(
            submodules.out_proj, self.value_dim, self.hidden_size, config=config, init_method=_skip_init,
            bias=False, input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_comm_buffer_name="fc2",
            tp_group=self.tp_group)
        self._layouts = self._param_layouts()
        self.reset_parameters()

    # ---------------------------------------------------------------- construction helpers

    def _check_mask_type(self, attn_mask_type):
        if attn_mask_type is None:
            return
        label = getattr(attn_mask_type, "name", str(attn_mask_type))
        if label not in ("causal", "padding_causal"):
            raise ValueError(f"{type(self).__name__} is causal; attn_mask_type must be causal, got {label}")

    def _resolve_cp_method(self, opts, cp_comm_type, config):
        method, degree = opts["cp_method"], opts["cp_ulysses_degree"]
        if method is None and cp_comm_type is not None:
            if cp_comm_type not in CP_COMM_TYPE_METHODS:
                raise ValueError(f"{type(self).__name__}: cp_comm_type must be one of "
                                 f"{sorted(CP_COMM_TYPE_METHODS)}, got {cp_comm_type!r}")
            method = CP_COMM_TYPE_METHODS[cp_comm_type]
            if cp_comm_type == "a2a+p2p" and degree is None:
                sizes = getattr(config, "hierarchical_context_parallel_sizes", None)
                if not sizes:
                    raise ValueError("cp_comm_type 'a2a+p2p' needs config.hierarchical_context_parallel_sizes "
                                     "(its first entry is the Ulysses degree)")
                degree = int(sizes[0])
        method = method or DEFAULT_CP_METHOD
        if method not in CP_METHODS:
            raise ValueError(f"{type(self).__name__}: cp_method must be one of {CP_METHODS}, got {method!r}")
        return method, degree

    def _build_out_norm(self, spec):
        cls = _module_class(spec)
        kwargs = dict(config=self.config, hidden_size=self.value_head_dim, eps=self.norm_eps)
        if isinstance(cls, type) and issubclass(cls, GatedRMSNorm):
            kwargs.update(activation=self.gate_activation, backend=self.backend)  # triton: FLA's fused kernel
        norm = build_module(spec, **kwargs)
        self._norm_applies_gate = isinstance(norm, GatedRMSNorm)
        # The norm weight is shared by all heads while the heads are split over TP: every rank's gradient
        # is partial. Sum it over TP right here (and keep megatron from summing it again under SP).
        for p in norm.parameters():
            setattr(p, "sequence_parallel", False)
            if self.tp_size > 1 and p.requires_grad:
                p.register_hook(_all_reduce_grad_hook(self.tp_group))
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

    @torch.no_grad()
    def reset_parameters(self):
        """Draw every global logical tensor from its own seeded generator and keep this rank's slice."""
        if not getattr(self.config, "perform_initialization", True):
            return
        base = self.init_seed if self.init_seed is not None else torch.initial_seed()
        params = dict(self.named_parameters())
        for path, lay in self._layouts.items():
            masters = {}
            for part in lay.parts:
                master = torch.empty(part.shape, dtype=torch.float32)
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(_seed_for(base, self.layer_number, path, part.name))
                    part.init(master)
                masters[part.name] = master
            params[path].copy_(lay.shard(masters, self.tp_rank, self.tp_size))

    @torch.no_grad()
    def load_global_parts(self, tensors: dict) -> None:
        """Load global logical tensors (``{"in_proj.weight.query": ..., "A_log": ..., "out_norm.weight": ...}``,
        see :meth:`global_part_names`) into this rank's parameters, for any TP size."""
        params = dict(self.named_parameters())
        missing = set(self.global_part_names()) - set(tensors)
        unexpected = set(tensors) - set(self.global_part_names())
        if missing or unexpected:
            raise ValueError(f"load_global_parts: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        for path, lay in self._layouts.items():
            parts = {p.name: tensors[lay.key(p)] for p in lay.parts}
            params[path].copy_(lay.shard(parts, self.tp_rank, self.tp_size))
        for path, p in params.items():
            if path not in self._layouts:
                p.copy_(tensors[path])

    def global_part_names(self) -> list:
        """Names of the global logical tensors (fused parameters split into their parts); these are also the
        keys ``sharded_state_dict`` saves under."""
        names = []
        for path, _ in self.named_parameters():
            lay = self._layouts.get(path)
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
            lay = self._layouts.get(path)
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
        """``hidden_states [s, b, h]`` -> ``(output [s, b, h], bias or None)``; positional embeddings are unused."""
        name = type(self).__name__
        if inference_context is not None or inference_params is not None:
            raise ValueError(f"{name} does not support inference (KV/state caches); got an inference context")
        if key_value_states is not None:
            raise ValueError(f"{name} is a self-attention mixer; key_value_states must be None")
        if attention_bias is not None:
            raise ValueError(f"{name} cannot apply attention_bias; got a tensor of shape "
                             f"{tuple(attention_bias.shape)}")
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.ndim != 3:
            raise ValueError(f"{name}: hidden_states must be [s, b, h], got "
                             f"{getattr(hidden_states, 'shape', type(hidden_states).__name__)}")
        cp_group = self._cp_group_for(packed_seq_params)
        cp_size = _group_size(cp_group)
        cu_global = packed_cu_seqlens(packed_seq_params)
        check_causal_mask(attention_mask, self.cp_layout, cp_size, _group_rank(cp_group), cu_global,
                          owner=type(self).__name__)

        projected, _ = self.in_proj(hidden_states)  # [s, b, D_local]
        seq, batch = projected.shape[:2]
        cu_seqlens, cp_context = self._sequence_context(packed_seq_params, cu_global, cp_group, cp_size, seq, batch,
                                                        hidden_states)
        x = projected.transpose(0, 1)  # [b, s, D_local]
        sizes = [rows // self.tp_size for _, rows in self._in_parts]
        parts = dict(zip((n for n, _ in self._in_parts), torch.split(x, sizes, dim=-1)))
        qkv = x[..., :self.conv_dim // self.tp_size]  # in_proj starts with query, key, value
        qkv = causal_conv1d(qkv, self.conv1d.weight.squeeze(1), bias=self.conv1d.bias, activation="silu",
                            cu_seqlens=cu_seqlens, cp_context=cp_context, backend=self.backend)
        kd_local, vd_local = self.key_heads_local * self.key_head_dim, self.value_heads_local * self.value_head_dim
        q, k, v = torch.split(qkv, [kd_local, kd_local, vd_local], dim=-1)
        q = q.reshape(batch, seq, self.key_heads_local, self.key_head_dim)
        k = k.reshape(batch, seq, self.key_heads_local, self.key_head_dim)
        v = v.reshape(batch, seq, self.value_heads_local, self.value_head_dim)
        core, gate = self._delta_rule(q, k, v, parts, hidden_states, cu_seqlens, cp_context)
        normed = self._gated_norm(core, gate)  # [b, s, HV_local, V]
        normed = normed.reshape(batch, seq, -1).transpose(0, 1).contiguous()
        return self.out_proj(normed)

    def _gated_norm(self, core, gate):
        if self._norm_applies_gate:
            return self.out_norm(core, gate)
        act = GATE_ACTIVATIONS[self.gate_activation]
        return (self.out_norm(core).float() * act(gate.float())).to(core.dtype)

    def _cp_group_for(self, packed_seq_params):
        group = getattr(packed_seq_params, "cp_group", None) if packed_seq_params is not None else None
        return group if group is not None else self.cp_group

    def _sequence_context(self, packed_seq_params, cu, cp_group, cp_size, seq, batch, hidden_states):
        """(cu_seqlens for the local op, CP context): under CP the context holds the global boundaries.

        The context is built once per micro-batch (THD: cached on ``packed_seq_params``, shared by every layer
        with the same CP configuration) or once per layer and group (BSHD: it does not depend on the batch).
        Communication accounting is off unless ``self.comm_stats`` is a ``CommStats``."""
        name = type(self).__name__
        if cu is not None:
            if batch != 1:
                raise ValueError(f"{name}: packed THD input must have batch size 1, got b={batch}")
            if int(cu[-1]) != seq * cp_size:
                raise ValueError(f"{name}: cu_seqlens end at {int(cu[-1])} tokens but the input holds "
                                 f"{seq} local tokens x context-parallel size {cp_size} = {seq * cp_size}; "
                                 "cu_seqlens must be the global (pre-CP-split) boundaries")
        if cp_size == 1:
            return cu, None
        method, group_size, degree = self.cp_method, self.cp_group_size, self.cp_ulysses_degree
        if method == "auto":   # decided at the first CP forward, then kept (layers.cp.auto)
            from layers.cp.auto import resolve_for_mixer

            method, group_size, degree = resolve_for_mixer(self, cp_group, seq * cp_size, batch, cu, hidden_states,
                                                           packed_seq_params)
        key = ("cp_context", cp_group, method, self.cp_layout, group_size, degree, self.conv_kernel_dim,
               id(self.comm_stats))
        cache = micro_batch_cache(packed_seq_params) if cu is not None else self._cp_contexts
        ctx = cache.get(key)
        if ctx is None:
            stats = self.comm_stats if self.comm_stats is not None else CommStats(enabled=False)
            ctx = build_cp_context(cp_group, method=method, layout=self.cp_layout, cu_seqlens=cu,
                                   group_size=group_size, ulysses_degree=degree, conv_kernel_size=self.conv_kernel_dim,
                                   stats=stats)
            cache[key] = ctx
        return None, ctx

    # ---------------------------------------------------------------- checkpointing

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None, **kwargs):
        """ShardedTensors with TP axes; fused parameters split into their logical parts (TP-reshardable)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint, sharded_state_dict_default

        metadata = dict(metadata) if metadata is not None else {}
        if metadata.get("dp_cp_group") is None and parallel_state.model_parallel_is_initialized():
            metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
        groups = dict(tp_group=self.tp_group, dp_cp_group=metadata.get("dp_cp_group"))
        own = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        own_axes = {path: lay.tp_dim for path, lay in self._layouts.items() if "." not in path
                    and lay.tp_dim is not None}
        result = _call_with_supported(make_sharded_tensors_for_checkpoint, own, prefix, own_axes,
                                      sharded_offsets, **groups)
        for child_name, child in self.named_children():
            child_prefix = f"{prefix}{child_name}."
            if isinstance(child, ShortConvWeights):
                sd = child.state_dict(prefix="", keep_vars=True)
                result.update(_call_with_supported(make_sharded_tensors_for_checkpoint, sd, child_prefix,
                                                   {k: 0 for k in sd}, sharded_offsets, **groups))
            else:
                result.update(_call_with_supported(sharded_state_dict_default, child, child_prefix,
                                                   sharded_offsets, metadata, tp_group=self.tp_group))
        for path, lay in self._layouts.items():
            if len(lay.parts) > 1:
                key = prefix + path
                result[key] = split_sharded_tensor(result[key], lay.local_sizes(self.tp_size),
                                                   [p.name for p in lay.parts], lay.cat_dim)
        return result

    # ---------------------------------------------------------------- subclass hooks

    def _in_proj_parts(self) -> list:
        """``[(name, global rows)]`` of the fused in_proj; must start with query, key, value."""
        raise NotImplementedError

    def _build_extra(self, submodules, device, dtype) -> None:
        raise NotImplementedError

    def _extra_layouts(self) -> list:
        raise NotImplementedError

    def _delta_rule(self, q, k, v, parts, hidden_states, cu_seqlens, cp_context):
        """Return ``(core [b, s, HV_local, V], gate [b, s, HV_local, V])``."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (f"heads={self.num_key_heads}/{self.num_value_heads} (qk/v), head_dims={self.key_head_dim}/"
                f"{self.value_head_dim}, conv={self.conv_kernel_dim}, tp={self.tp_size}, backend={self.backend}, "
                f"cp={self.cp_method}/{self.cp_layout}")


def split_sharded_tensor(sharded, local_sizes, names, dim):
    """A ShardedTensorFactory saving a fused local tensor as independent ``<key>.<name>`` ShardedTensors."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if not isinstance(sharded, ShardedTensor):
        raise TypeError(f"expected a ShardedTensor for {getattr(sharded, 'key', sharded)!r}, got "
                        f"{type(sharded).__name__}")
    if sum(local_sizes) != sharded.local_shape[dim]:
        raise ValueError(f"split sizes {local_sizes} do not cover dim {dim} of {sharded.key} "
                         f"(local shape {sharded.local_shape})")
    template = sharded.without_data()

    @torch.no_grad()
    def build(key, data, replica_id, flattened_range):
        whole = replace(template, key=key, data=data, dtype=data.dtype, replica_id=replica_id,
                        flattened_range=flattened_range)
        pieces, start = [], 0
        for size, part in zip(local_sizes, names):
            for piece in whole.narrow(dim, start, size):
                piece.key = f"{piece.key}.{part}"
                pieces.append(piece)
            start += size
        return pieces

    @torch.no_grad()
    def merge(loaded):
        return torch.cat(loaded, dim=dim)

    return ShardedTensorFactory(sharded.key, sharded.data, build, merge, sharded.replica_id)

