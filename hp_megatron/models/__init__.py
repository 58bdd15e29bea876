"""Real architectures from Hugging Face ``config.json`` files: presets (megatron-core config, layer pattern, GPTModel
keywords) and checkpoint conversion rules, one module per HF ``model_type``.

``get_architecture(model_type)`` returns the module; each has ``megatron_config(hf_config: dict) -> ModelPreset``
and ``conversion_rules(hf_config: dict) -> list[TensorRule]``. ``preset_from_hf(path_or_dict)`` reads a
``config.json`` (or a directory holding one) and dispatches on its ``model_type``. Importing this package registers
every architecture with the checkpoint converter (``hp_megatron.convert.registry``: rules and :func:`build_model`).
"""
from __future__ import annotations

import importlib
import json
import os

import torch

from hp_megatron.models.common import ModelPreset

ARCHITECTURES = {"qwen3_next": "qwen3_next", "deepseek_v3": "deepseek_v3", "kimi_linear": "kimi_linear"}


def get_architecture(model_type: str):
    """The module of an HF ``model_type``; ValueError naming it and the supported ones."""
    if model_type not in ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(ARCHITECTURES)}")
    return importlib.import_module(f"hp_megatron.models.{ARCHITECTURES[model_type]}")


def load_hf_config(path_or_dict) -> dict:
    """An HF config as a dict: a dict as is, a ``config.json`` path, or a directory holding ``config.json``."""
    if isinstance(path_or_dict, dict):
        return path_or_dict
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"no HF config.json at {path}")
    with open(path) as f:
        return json.load(f)


def _model_type(hf: dict) -> str:
    if "model_type" not in hf:
        raise ValueError(f"HF config has no 'model_type'; supported: {sorted(ARCHITECTURES)}")
    return hf["model_type"]


def preset_from_hf(path_or_dict) -> ModelPreset:
    """:class:`ModelPreset` of an HF config (dict, ``config.json`` or checkpoint directory)."""
    hf = load_hf_config(path_or_dict)
    return get_architecture(_model_type(hf)).megatron_config(hf)


def conversion_rules_from_hf(path_or_dict) -> list:
    """The ``TensorRule`` list of an HF config (dict, ``config.json`` or checkpoint directory)."""
    hf = load_hf_config(path_or_dict)
    return get_architecture(_model_type(hf)).conversion_rules(hf)


def build_model(hf_config, **config_overrides):
    """The ``GPTModel`` of an HF config for this pipeline stage of the current megatron parallel state (fp32, CPU
    initialization unless ``config_overrides``, ``TransformerConfig`` fields, say otherwise)."""
    from megatron.core import parallel_state

    hf = load_hf_config(hf_config)
    preset = preset_from_hf(hf)
    fields = dict(use_cpu_initialization=True, params_dtype=torch.float32, gradient_accumulation_fusion=False,
                  bias_dropout_fusion=False)
    config = preset.transformer_config(**{**fields, **config_overrides})
    return preset.gpt_model(config, max_sequence_length=hf.get("max_position_embeddings") or 4096,
                            pre_process=parallel_state.is_pipeline_first_stage(),
                            post_process=parallel_state.is_pipeline_last_stage())


def _register_with_converter() -> None:
    from hp_megatron.convert.registry import register_architecture

    for model_type in ARCHITECTURES:
        module = get_architecture(model_type)
        register_architecture(model_type, module.conversion_rules, build_model,
                              getattr(module, "unmodeled_tensors", None))


_register_with_converter()

__all__ = ["ARCHITECTURES", "ModelPreset", "build_model", "conversion_rules_from_hf", "get_architecture",
           "load_hf_config", "preset_from_hf"]
