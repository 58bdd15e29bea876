"""Checkpoint conversion between Hugging Face directories and megatron-core checkpoints.

``rules.py`` declares how one megatron-core tensor is built from Hugging Face tensors (and back); each
architecture provides ``conversion_rules(hf_config) -> list[TensorRule]`` and ``build_model(hf_config, **overrides)``
and registers them (``registry.register_architecture``). ``engine.py`` converts whole checkpoints both ways,
streaming, tensor by tensor; ``python -m hp_megatron.convert`` is its command line (docs/models.md).
"""
from hp_megatron.convert.engine import ConversionReport, build_layout, checkpoint_directory, hf_to_mcore, mcore_to_hf
from hp_megatron.convert.registry import Architecture, get_architecture, register_architecture
from hp_megatron.convert.rules import TensorRule, concat_rule, grouped_qkv_rule, identity_rule
from hp_megatron.convert.safetensors_io import CheckpointError

__all__ = ["Architecture", "CheckpointError", "ConversionReport", "TensorRule", "build_layout",
           "checkpoint_directory", "concat_rule", "get_architecture", "grouped_qkv_rule", "hf_to_mcore",
           "identity_rule", "mcore_to_hf", "register_architecture"]
