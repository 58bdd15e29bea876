"""Which layers of a model get the MoE MLP: megatron's ``moe_layer_freq`` (an int k: every k-th layer from the
first; a list: one 0/1 per layer, as DeepSeek-V3's first dense layers), for both model classes."""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules


def moe_layer_flags(config) -> list:
    """One bool per global layer: does it get the MoE MLP (megatron's ``moe_layer_freq`` convention)?"""
    num_layers = config.num_layers
    if not getattr(config, "num_moe_experts", None):
        return [False] * num_layers
    freq = getattr(config, "moe_layer_freq", 1)
    if isinstance(freq, int):
        if freq <= 0:
            raise ValueError(f"moe_layer_freq must be a positive int or a 0/1 list, got {freq}")
        return [i % freq == 0 for i in range(num_layers)]
    flags = list(freq)
    if len(flags) != num_layers or any(f not in (0, 1) for f in flags):
        raise ValueError(f"moe_layer_freq as a list needs one 0/1 per layer (num_layers={num_layers}), got {flags}")
    return [bool(f) for f in flags]


def with_layer_mlp(config, layer: TransformerLayerSubmodules, moe_mlp, global_layer_number: int):
    """``layer`` with the MoE MLP when ``moe_layer_flags`` marks this 1-based global layer, else unchanged."""
    if not moe_layer_flags(config)[global_layer_number - 1]:
        return layer
    return with_moe_mlp(config, layer, moe_mlp)


def with_moe_mlp(config, layer: TransformerLayerSubmodules, moe_mlp):
    """``layer`` with the MoE MLP ``moe_mlp`` (ValueError when the spec has none or asks for grouped GEMM)."""
    if moe_mlp is None:
        raise ValueError(f"config.num_moe_experts={config.num_moe_experts} asks for MoE layers but this layer "
                         "spec has no MoE MLP (HybridLayerSubmodules.moe_mlp is None)")
    if getattr(config, "moe_grouped_gemm", False):
        raise ValueError("moe_grouped_gemm=True needs Transformer Engine's grouped GEMM, which these specs do not "
                         "use; set moe_grouped_gemm=False (megatron-core SequentialMLP experts)")
    return replace(layer, mlp=moe_mlp)
