"""Functional kernels with one backend dispatch (``backend="eager" | "triton" | "ascendc"``)."""
from layers.ops.conv import causal_conv1d
from layers.ops.delta_rule import chunk_gated_delta_rule, chunk_kda
from layers.ops.step import causal_conv1d_step, delta_rule_step

__all__ = ["chunk_gated_delta_rule", "chunk_kda", "causal_conv1d", "delta_rule_step", "causal_conv1d_step"]
