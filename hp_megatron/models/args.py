"""A preset as Megatron command-line arguments (``--hp-hf-config PATH``): the values Megatron-LM and the example
build their ``TransformerConfig`` and ``GPTModel`` from, under Megatron-LM's argument names.

``apply_hf_config_to_args(args)`` sets them on parsed args (before the config is built; they replace the flags'
values); :func:`apply_hf_preset` does so for a launcher's command line (the example's, the Megatron-LM
launchers'), refusing a model flag given there with another value. ``hp_megatron.arguments.apply_hp_config`` then
returns the config as a declared ``hp_megatron.config`` class holding the preset's layer fields (``linear_*``,
MLA's fields, ``gated_norm_zero_centered_gamma``).
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


def preset_vocab_size(preset, tokenizer_vocab: int, tensor_parallel_size: int, source: str) -> int:
    """The embedding rows of ``preset``'s model: its HF config's ``vocab_size`` (the converted checkpoint's rows,
    unpadded), which must hold the tokenizer's ``tokenizer_vocab`` ids and split over TP; ``source`` names the
    config in the error (``--hp-hf-config PATH``)."""
    vocab = preset.gpt_model_kwargs["vocab_size"]
    if vocab < tokenizer_vocab:
        raise ValueError(f"{source} has vocab_size {vocab}, fewer than the tokenizer's {tokenizer_vocab} ids: the "
                         "data must use the model's tokenizer")
    if vocab % tensor_parallel_size:
        raise ValueError(f"{source}: vocab_size {vocab} is not divisible by --tensor-model-parallel-size "
                         f"{tensor_parallel_size}")
    return vocab


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


# the model flags --hp-hf-config decides (the example's and Megatron-LM's names): given on the command line, each must
# agree with the preset (its Megatron argument, :func:`megatron_args`, or the field of our layers it sets)
PRESET_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
               "rotary_base", "hp_layer_pattern", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
               "moe_router_score_function", "moe_router_enable_expert_bias")
# how the router is balanced is a training choice: given on the command line, these flags (all three, with
# Megatron-LM's defaults for those not given) replace the preset's balancing (none: transformers' loss has no aux loss)
TRAINING_MOE_ARGS = ("moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_router_bias_update_rate")


def apply_hf_preset(args, argv):
    """With ``--hp-hf-config PATH``: the model flags from that HF config (``apply_hf_config_to_args``); returns
    the ``ModelPreset`` (None without the flag). A model flag given on the command line with another value than
    the preset's is refused (ValueError naming both)."""
    if args.hp_hf_config is None:
        return None
    from hp_megatron.flags import given_on_command_line, preset_flag_fields
    from hp_megatron.models import preset_from_hf

    preset = preset_from_hf(args.hp_hf_config)
    wanted = megatron_args(preset)
    source = f"--hp-hf-config {args.hp_hf_config}"
    for dest in PRESET_ARGS:
        value = wanted.get(dest, None)
        if dest == "num_query_groups" and value is None:
            value = wanted["num_attention_heads"]
        if given_on_command_line(argv, dest) and getattr(args, dest) != value:
            raise ValueError(f"--{dest.replace('_', '-')} {getattr(args, dest)} conflicts with {source} "
                             f"({preset.model_type}: {dest} {value})")
    for dest, attr in preset_flag_fields().items():   # the flag table's rows the preset decides
        if given_on_command_line(argv, dest) and getattr(args, dest) != preset.mixer_fields.get(attr):
            raise ValueError(f"--{dest.replace('_', '-')} {getattr(args, dest)} conflicts with {source} "
                             f"({preset.model_type}: {attr} {preset.mixer_fields.get(attr)})")
    training_choices = {dest: getattr(args, dest) for dest in TRAINING_MOE_ARGS}
    preset = apply_hf_config_to_args(args, preset)
    if any(given_on_command_line(argv, dest) for dest in TRAINING_MOE_ARGS):
        for dest, value in training_choices.items():
            setattr(args, dest, value)
    return preset
