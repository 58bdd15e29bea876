"""Real architectures from Hugging Face ``config.json`` files, one module per HF ``model_type`` (``llama``,
``qwen3_next``, ``deepseek_v3``, ``kimi_linear``), and the one table of them (``architectures.py``).

Each module has ``megatron_config(hf_config: dict) -> ModelPreset`` (megatron-core config fields, layer pattern,
GPTModel keywords) and ``conversion_rules(hf_config: dict) -> list[TensorRule]``. ``ARCHITECTURES`` maps a
``model_type`` to its :class:`Architecture` (preset, conversion rules, model builder, unmodeled checkpoint parts),
which is what the conversion engine ``hp_megatron.convert`` takes. ``preset_from_hf`` / ``conversion_rules_from_hf``
/ ``architecture_of`` take a dict, a ``config.json`` or a checkpoint directory. ``export_hf_weights`` /
``hf_weight_exporter`` (``weights.py``) stream a running sharded model's weights in HF names and layouts.
``gpt_key_map`` / ``hybrid_key_map`` (``megatron_gdn.py``) map megatron-core's own GatedDeltaNet models to ours.
A ``ModelPreset`` is a declaration; ``preset_transformer_config`` / ``preset_layer_spec`` / ``preset_gpt_model``
(``build.py``) build from it. Imports go one way: ``hp_megatron.models`` -> ``hp_megatron.convert`` and the model
builders (``hp_megatron.config``, ``specs``, ``gpt_model``); never ``hp_megatron.training`` or ``arguments``.
"""
from hp_megatron.models.architectures import (ARCHITECTURES, Architecture, architecture_of, conversion_rules_from_hf,
                                              get_architecture, preset_from_hf)
from hp_megatron.models.build import (preset_gpt_model, preset_hybrid_model, preset_layer_spec,
                                      preset_transformer_config)
from hp_megatron.models.common import ModelPreset
from hp_megatron.models.megatron_gdn import KeyMap, gpt_key_map, hybrid_key_map
from hp_megatron.models.weights import export_hf_weights, hf_weight_exporter

__all__ = ["ARCHITECTURES", "Architecture", "KeyMap", "ModelPreset", "architecture_of", "conversion_rules_from_hf",
           "export_hf_weights", "get_architecture", "gpt_key_map", "hf_weight_exporter", "hybrid_key_map",
           "preset_from_hf", "preset_gpt_model", "preset_hybrid_model", "preset_layer_spec",
           "preset_transformer_config"]
