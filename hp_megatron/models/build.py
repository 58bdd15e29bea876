"""What a :class:`~hp_megatron.models.common.ModelPreset` builds: its declared config, its layer spec and its
megatron-core ``GPTModel`` (``hp_megatron.model_builders.hybrid_gpt_model``) or ``HybridModel``
(``hp_megatron.model_builders.hybrid_model``, megatron-core 0.19+).

The preset itself is a declaration; these functions are the only place that turns one into megatron-core objects
(``Architecture.build_model``, the example's ``--hp-hf-config`` path, tests and benchmarks call them).
"""
from __future__ import annotations


def preset_transformer_config(preset, **overrides):
    """A ``hp_megatron.config.HybridTransformerConfig`` of ``preset`` (``transformer_fields``, ``mixer_fields``
    and ``pattern``); ``overrides`` (parallel sizes, dtypes...) win over it."""
    from hp_megatron.config import HybridTransformerConfig, hybrid_config

    # GPTModel records config.rotary_base (a declared MLA field) as its own: the preset's RoPE base where it has one
    gpt = preset.gpt_model_kwargs
    rotary = {"rotary_base": gpt["rotary_base"]} if "rotary_base" in gpt else {}
    values = {**preset.transformer_fields, **rotary, **preset.mixer_fields, "hp_layer_pattern": preset.pattern,
              **overrides}
    declared = HybridTransformerConfig.__dataclass_fields__
    config = HybridTransformerConfig(**{k: v for k, v in values.items() if k in declared})
    # a registered mixer's own fields (DSA's dsa_indexer_* where megatron-core has none, 0.16) are attributes
    extra = {k: v for k, v in values.items() if k not in declared}
    return hybrid_config(config, **extra) if extra else config


def preset_layer_spec(preset, backend="eager", **kwargs):
    """The ``PatternLayer`` spec of ``preset`` (``kwargs``: ``linear``, ``cp_layout``)."""
    from hp_megatron.specs import get_hybrid_layer_spec

    return get_hybrid_layer_spec(preset.pattern, backend, qk_layernorm=preset.qk_layernorm,
                                 mtp_symbol=preset.mtp_symbol, **kwargs)


def preset_gpt_model(preset, config, backend="eager", *, max_sequence_length: int, pre_process: bool = True,
                     post_process: bool = True, vp_stage=None, pg_collection=None, **spec_kwargs):
    """megatron-core ``GPTModel`` of ``preset`` for this pipeline stage
    (``hp_megatron.model_builders.hybrid_gpt_model``: our RMSNorm as the final norm); ``config`` is typically
    :func:`preset_transformer_config`'s; ``pg_collection``: megatron-core's process groups (Megatron-LM 0.19's
    builders pass theirs; None: ``parallel_state``'s)."""
    from hp_megatron.model_builders import hybrid_gpt_model

    model = hybrid_gpt_model(config, preset_layer_spec(preset, backend, **spec_kwargs),
                             max_sequence_length=max_sequence_length, pre_process=pre_process,
                             post_process=post_process, vp_stage=vp_stage, backend=backend,
                             **({} if pg_collection is None else {"pg_collection": pg_collection}),
                             **preset.gpt_model_kwargs)
    if preset.position_ids_map is not None:
        model.register_forward_pre_hook(_mapping_position_ids(preset.position_ids_map), with_kwargs=True)
    return model


def _mapping_position_ids(position_ids_map):
    """A ``GPTModel`` forward pre-hook passing ``forward(input_ids, position_ids, ...)``'s position ids through
    ``position_ids_map``."""

    def hook(module, args, kwargs):
        if len(args) > 1:
            return (args[0], position_ids_map(args[1]), *args[2:]), kwargs
        if kwargs.get("position_ids") is not None:
            return args, {**kwargs, "position_ids": position_ids_map(kwargs["position_ids"])}
        return None

    return hook


def preset_hybrid_model(preset, config, backend="eager", *, max_sequence_length: int, pre_process: bool = True,
                        post_process: bool = True, vp_stage=None, **spec_kwargs):
    """megatron-core ``HybridModel`` of ``preset`` for this pipeline stage (``hp_megatron.model_builders.hybrid_model``:
    the pattern derived from the preset's, the same model as :func:`preset_gpt_model` in HybridModel's numbering);
    ``config`` is typically :func:`preset_transformer_config`'s (GPT numbering)."""
    from hp_megatron.model_builders import hybrid_model

    model = hybrid_model(config, max_sequence_length=max_sequence_length, pre_process=pre_process,
                         post_process=post_process, vp_stage=vp_stage, backend=backend,
                         qk_layernorm=preset.qk_layernorm, mtp_symbol=preset.mtp_symbol, **spec_kwargs,
                         **preset.gpt_model_kwargs)
    if preset.position_ids_map is not None:
        model.register_forward_pre_hook(_mapping_position_ids(preset.position_ids_map), with_kwargs=True)
    return model


def preset_hybrid_pattern(preset, **overrides) -> str:
    """The ``HybridModel`` pattern of ``preset``'s model (``overrides``: config fields such as ``mtp_num_layers``;
    one pipeline stage: ``|`` does not change checkpoint keys)."""
    from hp_megatron.model_builders import derived_hybrid_pattern
    from hp_megatron.platform import CPU_SAFE_CONFIG

    config = preset_transformer_config(preset, **{**CPU_SAFE_CONFIG, **overrides, "pipeline_model_parallel_size": 1})
    return derived_hybrid_pattern(config, preset.mtp_symbol)
