"""The one table of architectures, by Hugging Face ``model_type``: for each, its preset, its checkpoint conversion
rules, its model builder and the checkpoint parts the model does not build.

The conversion engine (``hp_megatron.convert``) takes an :class:`Architecture` from here (or any object of the same
shape); it never imports this package. Adding an architecture: a module with ``MODEL_TYPE``,
``megatron_config(hf_config) -> ModelPreset`` and ``conversion_rules(hf_config) -> list[TensorRule]`` (and
``unmodeled_tensors`` if its checkpoints hold parts the model does not build), and one row in ``ARCHITECTURES``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable

import torch

import hp_megatron.models.bailing_hybrid as bailing_hybrid
import hp_megatron.models.deepseek_v3 as deepseek_v3
import hp_megatron.models.dsa_models as dsa_models
import hp_megatron.models.kimi_linear as kimi_linear
import hp_megatron.models.llama as llama
import hp_megatron.models.olmo_hybrid as olmo_hybrid
import hp_megatron.models.qwen3_5 as qwen3_5
import hp_megatron.models.qwen3_next as qwen3_next
from hp_megatron.convert.safetensors_io import load_hf_config
from hp_megatron.models.build import (preset_gpt_model, preset_hybrid_model, preset_hybrid_pattern,
                                      preset_transformer_config)
from hp_megatron.models.common import ModelPreset


def no_unmodeled_tensors(hf_config: dict) -> dict:
    return {}


@dataclass(frozen=True)
class Architecture:
    """One HF ``model_type``: ``preset(hf_config) -> ModelPreset`` (None for a model known only by its builder);
    ``conversion_rules(hf_config) -> list[TensorRule]``; ``unmodeled_tensors(hf_config) -> {HF key prefix: what it
    holds}``, checkpoint tensors of parts the model does not build (DeepSeek-V3's and Qwen3-Next's
    multi-token-prediction modules), which ``hf_to_mcore`` drops only when asked; ``model_builder``, when set,
    builds the model in place of the preset's GPTModel (the converter's ``--model-builder``); ``mtp_num_layers``:
    the multi-token-prediction layers the model is built with and converted (:meth:`with_mtp`; 0: none);
    ``unmodeled_with_mtp``: the ``unmodeled_tensors`` that stay unmodeled with MTP (a VL checkpoint's vision tower);
    ``model_class``: ``gpt`` (megatron-core's ``GPTModel``) or ``hybrid`` (``HybridModel``; :meth:`for_model_class`:
    the same rules, their keys renumbered by ``hp_megatron.hybrid_model.numbering.LayerNumbering``)."""

    model_type: str
    preset: Callable[[dict], ModelPreset] | None
    conversion_rules: Callable[[dict], list]
    unmodeled_tensors: Callable[[dict], dict] = no_unmodeled_tensors
    model_builder: Callable | None = None
    mtp_num_layers: int = 0
    unmodeled_with_mtp: Callable[[dict], dict] = no_unmodeled_tensors
    model_class: str = "gpt"

    def __post_init__(self):
        if self.preset is None and self.model_builder is None:
            raise ValueError(f"architecture {self.model_type!r} needs a preset or a model_builder")

    def build_model(self, hf_config: dict, **config_overrides):
        """The ``GPTModel`` of ``hf_config`` for this pipeline stage of the current megatron parallel state (fp32,
        CPU initialization unless ``config_overrides``, ``TransformerConfig`` fields, say otherwise)."""
        from megatron.core import parallel_state

        from hp_megatron.platform import CPU_SAFE_CONFIG

        if self.mtp_num_layers:
            config_overrides = {"mtp_num_layers": self.mtp_num_layers, **config_overrides}
        if self.model_builder is not None:
            return self.model_builder(hf_config, **config_overrides)
        preset = self.preset(hf_config)
        fields = dict(CPU_SAFE_CONFIG, params_dtype=torch.float32)
        config = preset_transformer_config(preset, **{**fields, **config_overrides})
        text = hf_config.get("text_config", hf_config)   # a VL checkpoint's language model (Qwen3.5)
        build = preset_hybrid_model if self.model_class == "hybrid" else preset_gpt_model
        return build(preset, config, max_sequence_length=text.get("max_position_embeddings") or 4096,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())

    def hybrid_pattern(self, hf_config: dict) -> str:
        """The ``HybridModel`` pattern of ``hf_config``'s model (with this architecture's MTP layers)."""
        return preset_hybrid_pattern(self.preset(hf_config), mtp_num_layers=self.mtp_num_layers or None)

    def for_model_class(self, model_class: str) -> "Architecture":
        """This architecture built and converted as megatron-core's ``model_class`` (``gpt | hybrid``): for
        ``hybrid`` a ``HybridModel`` and the rules written for GPT with their keys in HybridModel's numbering (one
        set of rules per architecture; the numbering is a mapping). Call :meth:`with_mtp` first."""
        if model_class not in MODEL_CLASSES:
            raise ValueError(f"model_class must be one of {MODEL_CLASSES}, got {model_class!r}")
        if model_class == self.model_class:
            return self
        if self.model_class != "gpt" or self.preset is None:
            raise ValueError(f"{self.model_type}: only a preset's GPT architecture converts to model_class "
                             f"{model_class!r} (this one: model_class={self.model_class!r}, "
                             f"model_builder={self.model_builder!r})")
        rules = functools.partial(_renumbered_rules, self.conversion_rules, self.hybrid_pattern)
        return replace(self, model_class=model_class, conversion_rules=rules)

    def with_mtp(self, mtp_num_layers: int) -> "Architecture":
        """This architecture with its model built, and its checkpoints converted, with ``mtp_num_layers``
        multi-token-prediction layers (the checkpoint's: config.json's count; 0: this architecture unchanged);
        their tensors are then modeled, no longer ``unmodeled_tensors``. ValueError for a negative count or an
        architecture whose rules take no MTP layers."""
        if isinstance(mtp_num_layers, bool) or not isinstance(mtp_num_layers, int) or mtp_num_layers < 0:
            raise ValueError(f"mtp_num_layers must be an int >= 0, got {mtp_num_layers!r}")
        if not mtp_num_layers:
            return self
        if self.model_type not in MTP_ARCHITECTURES:
            raise ValueError(f"{self.model_type}: multi-token-prediction layers are converted for "
                             f"{sorted(MTP_ARCHITECTURES)}, got mtp_num_layers={mtp_num_layers}")
        if self.mtp_num_layers:
            raise ValueError(f"{self.model_type}: the architecture has {self.mtp_num_layers} MTP layers already")
        if self.model_class != "gpt":
            raise ValueError(f"{self.model_type}: with_mtp before for_model_class({self.model_class!r})")
        return replace(self, mtp_num_layers=mtp_num_layers, unmodeled_tensors=self.unmodeled_with_mtp,
                       conversion_rules=functools.partial(self.conversion_rules, mtp_num_layers=mtp_num_layers))


MODEL_CLASSES = ("gpt", "hybrid")


def _renumbered_rules(gpt_rules, hybrid_pattern, hf_config: dict) -> list:
    """``gpt_rules(hf_config)`` with each ``mcore_key`` in HybridModel's numbering (``LayerNumbering``)."""
    from hp_megatron.hybrid_model.numbering import LayerNumbering

    numbering = LayerNumbering(hybrid_pattern(hf_config))
    return [replace(rule, mcore_key=numbering.gpt_to_hybrid(rule.mcore_key)) for rule in gpt_rules(hf_config)]


ARCHITECTURES = {arch.model_type: arch for arch in (
    Architecture(llama.MODEL_TYPE, llama.megatron_config, llama.conversion_rules),
    Architecture(qwen3_next.MODEL_TYPE, qwen3_next.megatron_config, qwen3_next.conversion_rules,
                 qwen3_next.unmodeled_tensors),
    Architecture(deepseek_v3.MODEL_TYPE, deepseek_v3.megatron_config, deepseek_v3.conversion_rules,
                 deepseek_v3.unmodeled_tensors),
    Architecture(kimi_linear.MODEL_TYPE, kimi_linear.megatron_config, kimi_linear.conversion_rules),
    *(Architecture(model_type, qwen3_5.megatron_config, qwen3_5.conversion_rules, qwen3_5.unmodeled_tensors,
                   unmodeled_with_mtp=qwen3_5.unmodeled_with_mtp) for model_type in qwen3_5.MODEL_TYPES),
    Architecture(dsa_models.DEEPSEEK_V32, dsa_models.deepseek_v32_config, dsa_models.deepseek_v32_rules,
                 deepseek_v3.unmodeled_tensors),
    Architecture(dsa_models.GLM_MOE_DSA, dsa_models.glm_moe_dsa_config, dsa_models.glm_moe_dsa_rules),
    Architecture(olmo_hybrid.MODEL_TYPE, olmo_hybrid.megatron_config, olmo_hybrid.conversion_rules),
    Architecture(bailing_hybrid.MODEL_TYPE, bailing_hybrid.megatron_config, bailing_hybrid.conversion_rules,
                 bailing_hybrid.unmodeled_tensors),
)}


# conversion_rules(hf, mtp_num_layers)
MTP_ARCHITECTURES = (deepseek_v3.MODEL_TYPE, qwen3_next.MODEL_TYPE, *qwen3_5.MODEL_TYPES, dsa_models.DEEPSEEK_V32,
                     bailing_hybrid.MODEL_TYPE)


def get_architecture(model_type: str) -> Architecture:
    """The :class:`Architecture` of an HF ``model_type``; ValueError naming it and the supported ones."""
    if model_type not in ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[model_type]


def architecture_of(path_or_dict) -> Architecture:
    """The :class:`Architecture` of an HF config (dict, ``config.json`` or checkpoint directory)."""
    hf = load_hf_config(path_or_dict)
    if "model_type" not in hf:
        raise ValueError(f"HF config has no 'model_type'; supported: {sorted(ARCHITECTURES)}")
    return get_architecture(hf["model_type"])


def preset_from_hf(path_or_dict) -> ModelPreset:
    """:class:`ModelPreset` of an HF config (dict, ``config.json`` or checkpoint directory)."""
    hf = load_hf_config(path_or_dict)
    return architecture_of(hf).preset(hf)


def conversion_rules_from_hf(path_or_dict) -> list:
    """The ``TensorRule`` list of an HF config (dict, ``config.json`` or checkpoint directory)."""
    hf = load_hf_config(path_or_dict)
    return architecture_of(hf).conversion_rules(hf)
