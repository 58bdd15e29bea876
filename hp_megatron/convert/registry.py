"""Architectures the converter knows, by Hugging Face ``model_type``.

An architecture is a pair of functions of the HF config dict: ``conversion_rules(hf_config) ->
list[TensorRule]`` and ``build_model(hf_config, **TransformerConfig overrides) -> GPTModel`` (on the current
megatron parallel state). Architecture modules register themselves with :func:`register_architecture`;
``hp_megatron.models`` (when installed) is imported on the first lookup so that its modules can do so.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

_REGISTRY: dict[str, "Architecture"] = {}
_PLUGIN_PACKAGES = ("hp_megatron.models",)


@dataclass(frozen=True)
class Architecture:
    model_type: str
    conversion_rules: Callable
    build_model: Callable


def register_architecture(model_type: str, conversion_rules: Callable, build_model: Callable) -> None:
    _REGISTRY[model_type] = Architecture(model_type, conversion_rules, build_model)


def _load_plugins() -> None:
    for package in _PLUGIN_PACKAGES:
        try:
            importlib.import_module(package)
        except ModuleNotFoundError as err:
            if err.name != package:
                raise


def get_architecture(model_type: str) -> Architecture:
    """The registered architecture of ``model_type``; ValueError listing the known ones otherwise."""
    _load_plugins()
    if model_type not in _REGISTRY:
        raise ValueError(f"no conversion architecture for model_type={model_type!r}; known: {sorted(_REGISTRY)}")
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
