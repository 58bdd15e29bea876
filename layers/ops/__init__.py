"""Functional kernels with one backend dispatch (``backend="eager" | "triton" | "ascendc"``)."""
from layers.ops.conv import causal_conv1d
from layers.ops.delta_rule import chunk_gated_delta_rule, chunk_kda

__all__ = ["chunk_gated_delta_rule", "chunk_kda", "causal_conv1d"]
