"""A preset as Megatron command-line arguments (``--hp-hf-config PATH``): the values Megatron-LM and the example
build their ``TransformerConfig`` and ``GPTModel`` from, under Megatron-LM's argument names.

``apply_hf_config_to_args(args)`` sets them on parsed args (before the config is built; they replace the flags'
values); ``hp_megatron.arguments.apply_hp_config`` then returns the config as a declared
``hp_megatron.config`` class holding the preset's layer fields (``linear_*``, MLA's fields,
``gated_norm_zero_centered_gamma``).
"""
from __future__ import annotations

import torch

from hp_megatron.models.common import ModelPreset

# TransformerConfig field -> Megatron-LM argument: Megatron-LM (core_v0.16) generates its arguments from the
# TransformerConfig fields under their own names, except these
ARG_NAMES = {"num_moe_experts": "num_experts"}
_NOT_ARGS = ("activation_func", "gated_linear_unit")  # --swiglu sets both


def megatron_args(preset: ModelPreset) -> dict:
    """``{Megatron-LM argument dest: value}`` of a preset (model shape, norms, MoE, rotary, vocabulary)."""
    c = preset.transformer_fields
    args = {ARG_NAMES.get(k, k): v for k, v in c.items() if k not in _NOT_ARGS}
    if c.get("gated_linear_unit"):
        if c.get("activation_func") is not torch.nn.functional.silu:
            raise ValueError(f"{preset.model_type}: only SwiGLU MLPs map to Megatron flags (--swiglu)")
        args["swiglu"] = True
    args["group_query_attention"] = c.get("num_query_groups", c["num_attention_heads"]) != c["num_attention_heads"]
    gpt = preset.gpt_model_kwargs
    args.update(vocab_size=gpt["vocab_size"], make_vocab_size_divisible_by=1,
                position_embedding_type=gpt["position_embedding_type"],
                untie_embeddings_and_output_weights=not gpt["share_embeddings_and_output_weights"],
                hp_layer_pattern=preset.pattern, qk_layernorm=preset.qk_layernorm)
    for name in ("rotary_percent", "rotary_base"):
        if name in gpt:
            args[name] = gpt[name]
    return args


def apply_hf_config_to_args(args, preset=None):
    """With ``args.hp_hf_config`` set: put :func:`megatron_args` of that config on ``args``, keep the preset as
    ``args.hp_preset`` (``hp_megatron.arguments.apply_hp_config`` reads it instead of parsing the config again) and
    return it; otherwise return None. ``preset``: that config's preset when the caller has it already."""
    path = getattr(args, "hp_hf_config", None)
    if path is None:
        return None
    if preset is None:
        from hp_megatron.models import preset_from_hf

        preset = preset_from_hf(path)
    for name, value in megatron_args(preset).items():
        setattr(args, name, value)
    args.hp_preset = preset
    return preset
