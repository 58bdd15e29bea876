"""Checkpoint conversion between Hugging Face directories and megatron-core checkpoints.

``rules.py`` declares how one megatron-core tensor is built from Hugging Face tensors (and back); each
architecture module in ``hp_megatron.models`` provides ``conversion_rules(hf_config) -> list[TensorRule]``.
"""
