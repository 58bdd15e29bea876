"""Stand-in ``fla_npu.ops`` package (only ``ascendc`` is provided)."""
