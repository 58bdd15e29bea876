"""Per-layer SwiGLU clipping (Ling 3.0's ``expert_swiglu_limit_list`` / ``share_expert_swiglu_limit_list``):
``min(silu(gate), L) * clamp(up, -L, L)``, the clip after the activation, a limit per layer (0: none), one list for
routed experts (and dense MLPs) and one for shared experts.

megatron-core's ``activation_func_clamp_value`` clips ``gate`` before the activation, with one value for the whole
model, so it cannot express this. Here the layer's ``linear_fc1`` is :class:`ClippedSwiGLUInput`, which clips its
own output ``[gate | up]`` (each TP rank holds its slice of both halves): ``up`` to ``[-L, L]`` and ``gate`` to at
most ``c = silu^-1(L)``, so that megatron's unchanged SwiGLU computes ``silu(min(gate, c)) = min(silu(gate), L)``
(silu increases on ``[-1.28, inf)`` and ``c > 0``; equal up to the rounding of ``c``; the gradient is zero above the
clip in both). Fields: ``config.hp_swiglu_limits`` (routed experts; a dense MLP takes its layer's entry) and
``config.hp_shared_swiglu_limits`` (shared experts), one number per layer, set by the presets.
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch

from megatron.core.tensor_parallel.layers import ColumnParallelLinear


@functools.lru_cache(maxsize=None)
def silu_inverse(limit: float) -> float:
    """The ``c > 0`` with ``silu(c) = c * sigmoid(c) = limit`` (Newton's method in float64)."""
    if not limit > 0:
        raise ValueError(f"a SwiGLU limit must be positive, got {limit!r}")
    c = float(limit)
    for _ in range(60):
        s = 1.0 / (1.0 + math.exp(-c))
        step = (c * s - limit) / (s * (1.0 + c * (1.0 - s)))
        c -= step
        if abs(step) < 1e-15 * max(1.0, c):
            break
    return c


class ClippedSwiGLUInput(ColumnParallelLinear):
    """megatron's ``linear_fc1`` of a SwiGLU MLP whose output ``[gate | up]`` is clipped for ``limit`` (see the
    module docstring): ``gate <= silu^-1(limit)``, ``-limit <= up <= limit``. Bias-free (as every SwiGLU here)."""

    def __init__(self, *args, limit: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.limit, self.gate_limit = float(limit), silu_inverse(float(limit))

    def forward(self, *args, **kwargs):
        out, bias = super().forward(*args, **kwargs)
        if bias is not None:
            raise ValueError("ClippedSwiGLUInput clips fc1's output; a separate fc1 bias (skip_bias_add) is not "
                             "supported")
        gate, up = out.chunk(2, dim=-1)
        return torch.cat((gate.clamp(max=self.gate_limit), up.clamp(-self.limit, self.limit)), dim=-1), None

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, swiglu_limit={self.limit}"


def _with_fc1(spec, limit):
    """``spec`` (a ModuleSpec, a ``functools.partial`` or a submodules dataclass) with every ``MLPSubmodules``'s
    ``linear_fc1`` a :class:`ClippedSwiGLUInput` for ``limit``."""
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, MLPSubmodules):
        return replace(spec, linear_fc1=ModuleSpec(module=ClippedSwiGLUInput, params={"limit": limit}))
    if isinstance(spec, ModuleSpec):
        return replace(spec, submodules=_with_fc1(spec.submodules, limit))
    if isinstance(spec, functools.partial) and "submodules" in spec.keywords:
        return functools.partial(spec.func, *spec.args, **{**spec.keywords,
                                                            "submodules": _with_fc1(spec.keywords["submodules"],
                                                                                    limit)})
    return spec


def _limit(config, name: str, index: int, num_layers: int):
    limits = getattr(config, name, None)
    if not limits:
        return None
    if len(limits) != num_layers or any(not isinstance(v, (int, float)) or v < 0 for v in limits):
        raise ValueError(f"config.{name} must hold one number >= 0 per layer (num_layers={num_layers}), got "
                         f"{list(limits)}")
    return float(limits[index]) or None


def with_swiglu_limits(config, layer, global_layer_number: int, num_layers: int | None = None):
    """``layer`` (``TransformerLayerSubmodules``) with its layer's SwiGLU limits: the dense MLP or the routed experts
    ``config.hp_swiglu_limits[i]``, the shared experts ``config.hp_shared_swiglu_limits[i]`` (0 or no list: none).
    ``global_layer_number`` counts GPT layers (mixer + MLP), of which the lists hold ``num_layers`` (default
    ``config.num_layers``; a HybridModel's config counts its mixer and MLP layers apart)."""
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    index, count = global_layer_number - 1, config.num_layers if num_layers is None else num_layers
    routed = _limit(config, "hp_swiglu_limits", index, count)
    shared = _limit(config, "hp_shared_swiglu_limits", index, count)
    mlp = layer.mlp
    submodules = getattr(mlp, "submodules", None) or getattr(mlp, "keywords", {}).get("submodules")
    if isinstance(submodules, MoESubmodules):
        new = replace(submodules, experts=_with_fc1(submodules.experts, routed) if routed else submodules.experts,
                      shared_experts=(_with_fc1(submodules.shared_experts, shared) if shared
                                      else submodules.shared_experts))
        if new == submodules:
            return layer
        mlp = replace(mlp, submodules=new) if hasattr(mlp, "submodules") else functools.partial(
            mlp.func, *mlp.args, **{**mlp.keywords, "submodules": new})
        return replace(layer, mlp=mlp)
    return replace(layer, mlp=_with_fc1(mlp, routed)) if routed else layer
