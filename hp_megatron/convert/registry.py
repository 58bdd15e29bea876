"""Architectures the converter knows, by Hugging Face ``model_type``.

An architecture is a pair of functions of the HF config dict: ``conversion_rules(hf_config) ->
list[TensorRule]`` and ``build_model(hf_config, **TransformerConfig overrides) -> GPTModel`` (on the current
megatron parallel state). Built in: ``llama`` (``hp_megatron.convert.llama``); others register with
:func:`register_architecture`. A ``model_type`` not registered is looked up in ``hp_megatron.models`` (Qwen3-Next,
DeepSeek-V3, Kimi Linear): its module's ``conversion_rules`` and a model built from its ``megatron_config``
preset.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

_REGISTRY: dict[str, "Architecture"] = {}


@dataclass(frozen=True)
class Architecture:
    model_type: str
    conversion_rules: Callable
    build_model: Callable


def register_architecture(model_type: str, conversion_rules: Callable, build_model: Callable) -> None:
    _REGISTRY[model_type] = Architecture(model_type, conversion_rules, build_model)


def preset_model_builder(megatron_config: Callable) -> Callable:
    """``build_model`` of an ``hp_megatron.models`` module: its ``ModelPreset``'s GPTModel for this pipeline
    stage, with ``overrides`` as TransformerConfig fields."""

    def build_model(hf_config: dict, **overrides):
        from megatron.core import parallel_state

        preset = megatron_config(hf_config)
        fields = dict(use_cpu_initialization=True, gradient_accumulation_fusion=False, bias_dropout_fusion=False)
        config = preset.transformer_config(**{**fields, **overrides})
        return preset.gpt_model(config, max_sequence_length=hf_config.get("max_position_embeddings", 4096),
                                pre_process=parallel_state.is_pipeline_first_stage(),
                                post_process=parallel_state.is_pipeline_last_stage())

    return build_model


def get_architecture(model_type: str) -> Architecture:
    """The architecture of ``model_type``: registered here, else from ``hp_megatron.models``; ValueError
    naming it and the known ones otherwise."""
    if model_type in _REGISTRY:
        return _REGISTRY[model_type]
    from hp_megatron import models

    if model_type not in models.ARCHITECTURES:
        raise ValueError(f"no conversion architecture for model_type={model_type!r}; known: "
                         f"{sorted(set(_REGISTRY) | set(models.ARCHITECTURES))}")
    module = models.get_architecture(model_type)
    return Architecture(model_type, module.conversion_rules, preset_model_builder(module.megatron_config))


def load_callable(spec: str) -> Callable:
    """``"package.module:function"`` -> the function (the CLI's ``--rules`` / ``--model-builder``)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"expected 'package.module:function', got {spec!r}")
    return getattr(importlib.import_module(module), name)


def _register_builtin() -> None:
    from hp_megatron.convert import llama

    register_architecture(llama.MODEL_TYPE, llama.conversion_rules, llama.build_model)


_register_builtin()
