"""Architectures the converter knows, by Hugging Face ``model_type``.

An architecture is a pair of functions of the HF config dict: ``conversion_rules(hf_config) ->
list[TensorRule]`` and ``build_model(hf_config, **TransformerConfig overrides) -> GPTModel`` (on the current
megatron parallel state). Built in: ``llama`` (``hp_megatron.convert.llama``); others register with
:func:`register_architecture`. A ``model_type`` not registered yet imports ``hp_megatron.models``, which registers Qwen3-Next,
DeepSeek-V3 and Kimi Linear (their ``conversion_rules`` and ``hp_megatron.models.build_model``).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

_REGISTRY: dict[str, "Architecture"] = {}


@dataclass(frozen=True)
class Architecture:
    """``unmodeled_tensors(hf_config) -> {HF key prefix: what it holds}``: checkpoint tensors of parts the
    megatron model does not build (DeepSeek-V3's multi-token-prediction layers); ``hf_to_mcore`` drops them only
    when asked (``drop_unmodeled``)."""

    model_type: str
    conversion_rules: Callable
    build_model: Callable
    unmodeled_tensors: Callable | None = None


def register_architecture(model_type: str, conversion_rules: Callable, build_model: Callable,
                          unmodeled_tensors: Callable | None = None) -> None:
    _REGISTRY[model_type] = Architecture(model_type, conversion_rules, build_model, unmodeled_tensors)


def get_architecture(model_type: str) -> Architecture:
    """The architecture of ``model_type``: registered here, else from ``hp_megatron.models``; ValueError
    naming it and the known ones otherwise."""
    if model_type not in _REGISTRY:
        from hp_megatron import models  # registers its architectures (rules and build_model) on import

        if model_type not in _REGISTRY:
            raise ValueError(f"no conversion architecture for model_type={model_type!r}; known: "
                             f"{sorted(set(_REGISTRY) | set(models.ARCHITECTURES))}")
    return _REGISTRY[model_type]


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
