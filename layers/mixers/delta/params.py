"""Parameter layout and initialisation of the GDN/KDA mixers, and their small parameter modules.

Fused parameters (``in_proj.weight``, ``conv1d.weight``) hold, on each TP rank, the concatenation of that rank's
slice of every logical part (a :class:`ParamLayout` of :class:`Part` entries); checkpoints store the parts separately
(``in_proj.weight.query`` ...) so ``dist_checkpointing`` reshards across TP sizes, as megatron-core's own
GatedDeltaNet does. Initialisation draws every *global* logical tensor from a generator seeded by
``(init_seed, layer_number, tensor name)`` and keeps this rank's slice (:func:`initialize`), so the weights do not
depend on the TP/CP layout.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

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


def skip_init(tensor):
    """init_method handed to the linears: our ``reset_parameters`` writes the real values afterwards."""
    return tensor


# --------------------------------------------------------------------------------------------------------------
# Small parameter modules: the short conv's weights, KDA's TP-replicated gate down-projection


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
        self.weight.sequence_parallel = bool(getattr(config, "sequence_parallel", False))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight)


@torch.no_grad()
def initialize(params: dict, layouts: dict, base_seed: int, layer_number, tp_rank: int, tp_size: int) -> None:
    """Draw every part of ``layouts`` (``{path: ParamLayout}``) as an fp32 CPU master from its own generator
    (seeded by ``base_seed``, ``layer_number``, path and part name) and copy this rank's slice into
    ``params[path]``."""
    for path, lay in layouts.items():
        masters = {}
        for part in lay.parts:
            master = torch.empty(part.shape, dtype=torch.float32)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_seed_for(base_seed, layer_number, path, part.name))
                part.init(master)
            masters[part.name] = master
        params[path].copy_(lay.shard(masters, tp_rank, tp_size))
