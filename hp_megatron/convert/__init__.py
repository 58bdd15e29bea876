"""Checkpoint conversion between Hugging Face directories and megatron-core checkpoints (the engine).

``rules.py`` declares how one megatron-core tensor is built from Hugging Face tensors (and back); ``engine.py``
converts whole checkpoints both ways, streaming, tensor by tensor, for the architecture it is given (an object
with ``model_type``, ``conversion_rules``, ``build_model`` and ``unmodeled_tensors``: the table of them is
``hp_megatron.models``, which imports this package, never the other way). ``python -m hp_megatron.convert`` is the
command line (``__main__.py``, the one module here that imports ``hp_megatron.models``; docs/models.md).
``export.py`` streams the HF tensors of a running, sharded model (for rollout engines). The megatron-core
checkpoint files themselves (directory layout, DCP reading and writing, common state, ``CheckpointError``) are
``hp_megatron.checkpoint``, which this package imports.
"""
from hp_megatron.checkpoint.errors import CheckpointError
from hp_megatron.convert.engine import ConversionReport, build_layout, hf_to_mcore, mcore_to_hf, stored_hf_config
from hp_megatron.convert.export import HFWeightExporter, export_hf_weights
from hp_megatron.convert.rules import TensorRule, concat_rule, grouped_qkv_rule, identity_rule
from hp_megatron.convert.safetensors_io import load_hf_config

__all__ = ["CheckpointError", "ConversionReport", "HFWeightExporter", "TensorRule", "build_layout", "concat_rule",
           "export_hf_weights", "grouped_qkv_rule", "hf_to_mcore", "identity_rule", "load_hf_config", "mcore_to_hf",
           "stored_hf_config"]
