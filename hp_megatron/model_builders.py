"""The builders of our models on both of megatron-core's model classes: :func:`hybrid_gpt_model` (``GPTModel``: the
example's ``--model-class gpt``, the Megatron-LM launcher's, ``hp_megatron.models.preset_gpt_model``) and
:func:`hybrid_model` (``HybridModel``, megatron-core 0.19+: the example's ``--model-class hybrid``,
``hp_megatron.models.preset_hybrid_model``), the same model in the two layer numberings
(``hp_megatron.hybrid_model.numbering``).

Given a layer spec, megatron-core's ``TransformerBlock`` repeats it and takes the block's final norm from its
module-level ``LayerNormImpl`` (Transformer Engine's, Apex's, or ``WrappedTorchNorm``, which refuses sequence
parallelism). The builder passes a block spec instead: the layer spec once per layer of this pipeline stage and
``layers.shared.norm.RMSNorm`` as the final norm, the norm every layer of the hybrid specs uses (zero-centred when
``config.layernorm_zero_centered_gamma``), so nothing of megatron-core is patched and the final norm is the same
on every install.

With ``config.mtp_num_layers`` (``--mtp-num-layers``) the model gets the multi-token-prediction block of
``hp_megatron.specs.get_mtp_block_spec`` (on the last pipeline stage) and is ``hp_megatron.decoder.mtp.MTPGPTModel``,
whose MTP token shift and loss work under any CP layout and with packed documents; on ``HybridModel`` the same MTP
layers and losses come from a ``/`` part of the pattern (``hp_megatron.hybrid_model.model.MTPHybridModel``).
"""
from __future__ import annotations


def hybrid_block_spec(layer_spec, config, vp_stage=None):
    """``TransformerBlockSubmodules``: ``layer_spec`` (a layer ``ModuleSpec``, e.g. ``get_hybrid_layer_spec``'s)
    for each layer this pipeline stage (and virtual stage ``vp_stage``) builds, ``RMSNorm`` as the final norm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from layers.shared.norm import RMSNorm

    return TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config, vp_stage),
                                      layer_norm=RMSNorm)


def hybrid_gpt_model(config, layer_spec, *, vocab_size: int, max_sequence_length: int, pre_process: bool = True,
                     post_process: bool = True, vp_stage=None, backend="eager", **gpt_kwargs):
    """megatron-core ``GPTModel`` of this pipeline stage over :func:`hybrid_block_spec`; ``gpt_kwargs`` are
    ``GPTModel``'s other keywords (``position_embedding_type``, ``rotary_base``, tied embeddings...). With
    ``config.mtp_num_layers`` it is a ``MTPGPTModel`` with the MTP block of ``layer_spec``'s MTP kind;
    ``backend`` (the layer spec's backend name or spec provider) builds the MTP layers' norms and projection, whose
    linears are the layer spec's (``get_hybrid_layer_spec(..., linear=)``, ``--hp-linear``)."""
    from megatron.core.models.gpt import GPTModel

    from hp_megatron.gpt.mtp_model import MTPGPTModel
    from hp_megatron.specs.mtp_specs import get_mtp_block_spec

    mtp_block_spec = get_mtp_block_spec(config, layer_spec, backend, vp_stage=vp_stage)
    cls = MTPGPTModel if getattr(config, "mtp_num_layers", None) else GPTModel
    return cls(config=config, transformer_layer_spec=hybrid_block_spec(layer_spec, config, vp_stage),
               vocab_size=vocab_size, max_sequence_length=max_sequence_length, pre_process=pre_process,
               post_process=post_process, vp_stage=vp_stage, mtp_block_spec=mtp_block_spec, **gpt_kwargs)


def hybrid_model_config(config, hybrid_layer_pattern: str):
    """``config`` (a GPT model's, layers numbered as ``GPTModel`` numbers them) in ``HybridModel``'s numbering: a
    copy with ``num_layers`` = the main pattern's layer count, ``moe_layer_freq`` one 0/1 per hybrid layer (``E``)
    and ``mtp_num_layers`` = the pattern's MTP depths, plus ``hp_gpt_layer_numbers`` (``{hybrid layer: GPT layer}``,
    ``numbering.gpt_layer_numbers``) and ``hp_gpt_num_layers``, which the layers read per-GPT-layer settings through;
    a config already so numbered comes back equal."""
    import copy

    from hp_megatron.hybrid_model.numbering import MLP_SYMBOLS, gpt_layer_numbers, split_pattern

    main, mtp = split_pattern(hybrid_layer_pattern)
    declared = getattr(config, "mtp_num_layers", None) or 0
    if declared and declared != len(mtp):
        raise ValueError(f"mtp_num_layers={declared} (--mtp-num-layers) but the hybrid layer pattern "
                         f"{hybrid_layer_pattern!r} has {len(mtp)} MTP depths ('/' parts)")
    hybrid = copy.copy(config)
    hybrid.num_layers = len(main)
    # per-GPT-layer settings (SwiGLU limits, post-norm, DSA's top-k sharing) index GPT layers: the layers read them
    # through these (hp_megatron.hybrid_model.stack), not config fields of their own
    hybrid.hp_gpt_layer_numbers = gpt_layer_numbers(hybrid_layer_pattern)
    hybrid.hp_gpt_num_layers = len([s for s in main if s not in MLP_SYMBOLS])
    hybrid.mtp_num_layers = len(mtp) or None
    if getattr(config, "num_moe_experts", None):
        hybrid.moe_layer_freq = [int(s == "E") for s in main]
    return hybrid


def derived_hybrid_pattern(config, mtp_symbol: str | None = None) -> str:
    """The ``HybridModel`` pattern of the GPT model ``config`` describes (``config.hp_layer_pattern`` over
    ``num_layers``, MoE per ``moe_layer_freq``, ``|`` per pipeline stage, one ``/`` part per MTP layer of kind
    ``mtp_symbol``, else ``config.hp_mtp_layer_symbol``, else the pattern's only symbol)."""
    from hp_megatron.decoder.moe_layers import moe_layer_flags
    from hp_megatron.hybrid_model.numbering import hybrid_pattern_of

    pattern = getattr(config, "hp_layer_pattern", None)
    if not pattern:
        raise ValueError("a HybridModel without hybrid_layer_pattern (--hybrid-layer-pattern) derives it from "
                         "config.hp_layer_pattern (--hp-layer-pattern), which is not set")
    depth = getattr(config, "mtp_num_layers", None) or 0
    if depth and mtp_symbol is None:
        mtp_symbol = getattr(config, "hp_mtp_layer_symbol", None) or (pattern[0] if len(set(pattern)) == 1 else None)
    stages = 1 if getattr(config, "pipeline_model_parallel_layout", None) else config.pipeline_model_parallel_size
    return hybrid_pattern_of(pattern, config.num_layers, moe_layer_flags(config), pipeline_stages=stages,
                             mtp_symbol=mtp_symbol, mtp_depth=depth)


def hybrid_model(config, *, vocab_size: int, max_sequence_length: int, hybrid_layer_pattern: str | None = None,
                 pre_process: bool = True, post_process: bool = True, vp_stage=None, backend="eager",
                 linear: str = "local", cp_layout: str | None = None, qk_layernorm="config", g_mixer: str = "gdn",
                 mtp_symbol: str | None = None, **model_kwargs):
    """megatron-core ``HybridModel`` (``hp_megatron.hybrid_model.model.MTPHybridModel``) of this pipeline stage over
    our stack spec (``hp_megatron.specs.get_hybrid_stack_spec``: slots from the registry, the MTP block).

    ``config``: a GPT model's config (:func:`hybrid_gpt_model`'s), renumbered by :func:`hybrid_model_config`;
    ``hybrid_layer_pattern``: megatron-core's pattern (``G*-E|...`` with ``/`` MTP parts), default
    :func:`derived_hybrid_pattern`, the same model as :func:`hybrid_gpt_model` builds. ``G`` layers take GDN or KDA
    per layer from ``config.hp_layer_pattern`` (``numbering.delta_slot_mixers``; ``g_mixer`` without one); MTP
    parts hold attention / MLA layers only (megatron-core's MTP layers are attention layers).
    ``model_kwargs``: ``HybridModel``'s other keywords (``position_embedding_type``, ``rotary_base``, tied
    embeddings...). ``backend`` / ``linear`` / ``cp_layout`` / ``qk_layernorm``: as for the stack spec. Options with
    which megatron-core swaps our layers out are a ValueError (``hybrid_model.stack.check_options``)."""
    from hp_megatron.hybrid_model.model import MTPHybridModel
    from hp_megatron.hybrid_model.numbering import delta_slot_mixers, split_pattern
    from hp_megatron.hybrid_model.stack import check_options
    from hp_megatron.registry import mixer, mtp_symbols
    from hp_megatron.hybrid_model.numbering import hybrid_symbol_of
    from hp_megatron.specs.hybrid_stack_specs import get_hybrid_stack_spec, slot_symbols

    check_options(config)
    pattern = hybrid_layer_pattern or derived_hybrid_pattern(config, mtp_symbol)

    allowed = {hybrid_symbol_of(s) for s in mtp_symbols()} | {"-", "E"}
    for part in split_pattern(pattern)[1]:
        if set(part) - allowed:
            names = [mixer(s).name for s in mtp_symbols()]
            raise ValueError(f"hybrid layer pattern {pattern!r}: MTP part {part!r} may hold {sorted(allowed)} only "
                             f"(megatron-core's MTP layers are attention layers: {names})")
    hybrid_config = hybrid_model_config(config, pattern)
    slot_mixers = {}
    for _slot, ours in slot_symbols().items():   # slots several of our mixers share (G: GDN and KDA)
        if len(ours) > 1:
            slot_mixers.update(delta_slot_mixers(pattern, getattr(config, "hp_layer_pattern", None),
                                                 hybrid_symbol_of(ours[0])))
    spec = get_hybrid_stack_spec(backend, g_mixer=g_mixer, qk_layernorm=qk_layernorm, linear=linear,
                                 cp_layout=cp_layout, slot_mixers=slot_mixers, mtp="/" in pattern)
    return MTPHybridModel(config=hybrid_config, hybrid_stack_spec=spec, vocab_size=vocab_size,
                          max_sequence_length=max_sequence_length, hybrid_layer_pattern=pattern,
                          pre_process=pre_process, post_process=post_process, vp_stage=vp_stage, **model_kwargs)
