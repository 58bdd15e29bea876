"""A ``TransformerLayer`` whose mixer (and, optionally, every other submodule) follows a layer pattern.

Megatron-LM's ``--spec`` imports one module-level object and ``TransformerBlock`` replicates a layer
spec for the layers of its pipeline stage, so a spec cannot know at import time which pipeline or
virtual-pipeline stage it will serve. :class:`PatternLayer` therefore resolves its type when it is built,
from the *global* 1-based layer number (local number + the stage's layer offset):
``pattern[(global_layer_number - 1) % len(pattern)]`` picks a symbol, and the symbol picks a complete
``TransformerLayerSubmodules`` from :class:`PatternLayerSubmodules`. A pattern as long as ``num_layers``
describes every layer explicitly; a shorter one repeats ("KKKM" = three KDA layers, then one MLA layer).

MLP: with ``config.num_moe_experts`` set (Megatron's ``--num-experts``), the layers that
``config.moe_layer_freq`` marks (an int k: every k-th layer from the first; a list: one 0/1 per layer, as
DeepSeek-V3's first dense layers) get :attr:`PatternLayerSubmodules.moe_mlp` (megatron-core's ``MoELayer``)
instead of the dense MLP; a spec without ``moe_mlp`` refuses a MoE config rather than build dense layers.

Multi-token prediction: the transformer layer of megatron-core's MTP layers is an :class:`MTPPatternLayer`, a
``PatternLayer`` built with ``mtp=True`` (``hp_megatron.specs.get_mtp_block_spec``). It has a fixed kind, not the one
the pattern gives its layer number (past ``num_layers``): :func:`mtp_layer_symbol` (the spec's ``mtp_symbol``, else
``config.hp_mtp_layer_symbol``, else the pattern's only symbol); its MLP is the MoE MLP whenever the model has
experts (DeepSeek-V3's and Qwen3-Next's MTP layers are MoE layers, as transformers' ``get_mtp_config`` has them).

Checkpoints: mixers of different types (and dense and MoE MLPs) have different parameter names, so they cannot
be stacked along megatron's layer axis. :meth:`PatternLayer.sharded_state_dict` then writes per-layer keys
``decoder.layers.<global index>.…`` (megatron's "non-homogeneous" naming), which stay valid under any
pipeline / virtual-pipeline split; a model of one mixer with uniform MLPs keeps megatron's stacked keys.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from hp_megatron.decoder.moe_layers import moe_layer_flags, with_layer_mlp, with_moe_mlp
from hp_megatron.decoder.pattern import stage_layer_offset, symbol_for_layer, validate_pattern
from hp_megatron.decoder.post_norm import with_post_norm
from hp_megatron.decoder.qk_norm import resolve_qk_norm
from hp_megatron.decoder.swiglu_limits import with_swiglu_limits
from hp_megatron.decoder.rotary import without_rotary
from hp_megatron.registry import mixers, refuse_unsupported


@dataclass
class PatternLayerSubmodules:
    """One ``TransformerLayerSubmodules`` per pattern symbol, e.g. ``{"K": kda_layer, "M": mla_layer}``."""

    layer_types: Dict[str, TransformerLayerSubmodules] = field(default_factory=dict)
    # symbols whose mixer computes its own positions (MLA): the model's rotary tables are not passed to them,
    # so patterns may mix MLA with RoPE attention layers
    own_positions: Tuple[str, ...] = ()
    # the mlp of MoE layers (megatron-core MoELayer spec); None: the spec has no MoE
    moe_mlp: Optional[object] = None
    # the symbol of multi-token-prediction layers; None: config.hp_mtp_layer_symbol, else the pattern's only symbol
    mtp_symbol: Optional[str] = None
    # the linears of the layers ("local" or "te", hp_megatron.specs.providers): the MTP block's eh_proj uses the same
    linear: str = "local"


def mtp_layer_symbol(submodules: PatternLayerSubmodules, pattern: str, config) -> str:
    """The fixed layer symbol of the multi-token-prediction layers of a spec with ``pattern``: the spec's
    ``mtp_symbol`` or ``config.hp_mtp_layer_symbol`` (``--hp-mtp-layer-symbol``), else the pattern's only symbol; a
    one-line ValueError when the two are set and differ (neither silently wins: the spec declares its model's MTP
    kind, the flag another) or when a pattern of several symbols declares none."""
    declared, flag = submodules.mtp_symbol, getattr(config, "hp_mtp_layer_symbol", None)
    if declared is not None and flag is not None and declared != flag:
        raise ValueError(f"config.hp_mtp_layer_symbol {flag!r} (--hp-mtp-layer-symbol) conflicts with the layer spec's "
                         f"mtp_symbol {declared!r}; drop one or make them agree")
    kind = declared or flag
    if kind is None and len(set(pattern)) == 1:
        kind = pattern[0]
    if kind is None:
        raise ValueError(f"multi-token prediction (mtp_num_layers={getattr(config, 'mtp_num_layers', None)}) with "
                         f"the hybrid pattern {pattern!r} needs the kind of its MTP layers, which the spec does not "
                         f"declare: set config.hp_mtp_layer_symbol (one of {sorted(set(pattern))}) or "
                         "get_hybrid_layer_spec(..., mtp_symbol=...)")
    if kind not in submodules.layer_types:
        raise ValueError(f"MTP layer kind {kind!r} has no layer spec; known symbols: {sorted(submodules.layer_types)}")
    return kind


class PatternLayer(TransformerLayer):
    """``TransformerLayer`` built from the pattern symbol of its global layer number.

    Spec: ``ModuleSpec(module=PatternLayer, params={"pattern": "KKKM"},
    submodules=PatternLayerSubmodules(layer_types={"K": ..., "M": ...}))``. ``self.layer_symbol`` records
    the chosen symbol. All other constructor arguments pass through to ``TransformerLayer`` unchanged.
    """

    def __init__(self, config, submodules: PatternLayerSubmodules, layer_number: int = 1, *args,
                 pattern: Optional[str] = None, mtp: bool = False, **kwargs):
        if not isinstance(submodules, PatternLayerSubmodules):
            raise TypeError(f"PatternLayer needs PatternLayerSubmodules, got {type(submodules).__name__}")
        if pattern is None:
            pattern = getattr(config, "hp_layer_pattern", None)
            if pattern is None:
                raise ValueError("PatternLayer without a pattern reads config.hp_layer_pattern (--hp-layer-pattern), "
                                 "which is not set")
        pattern = validate_pattern(pattern, submodules.layer_types)
        offset = stage_layer_offset(config, kwargs.get("vp_stage"), kwargs.get("pg_collection"),
                                    kwargs.get("pp_layer_offset"))
        self.layer_pattern = pattern
        if mtp:  # a multi-token-prediction layer: fixed kind, MoE whenever the model has experts
            self.layer_symbol = mtp_layer_symbol(submodules, pattern, config)
            layer = submodules.layer_types[self.layer_symbol]
            if getattr(config, "num_moe_experts", None):
                layer = with_moe_mlp(config, layer, submodules.moe_mlp)
            self.homogeneous = True  # megatron's MTP block asks for its layers' keys without a layer-axis offset
        else:
            self.layer_symbol = symbol_for_layer(pattern, layer_number + offset)
            self.homogeneous = len(set(pattern)) == 1 and len(set(moe_layer_flags(config))) == 1
            layer = with_layer_mlp(config, submodules.layer_types[self.layer_symbol], submodules.moe_mlp,
                                   layer_number + offset)
            layer = with_swiglu_limits(config, layer, layer_number + offset)
        if self.layer_symbol in mixers():   # what its mixer declares it cannot run (MixerEntry.supports)
            refuse_unsupported([mixers()[self.layer_symbol]], mixers().values(),
                               source=f"the pattern {pattern} of layer {layer_number + offset}",
                               cp_size=getattr(config, "context_parallel_size", 1) or 1)
        self.drops_rotary = self.layer_symbol in submodules.own_positions
        layer = with_post_norm(config, self.layer_symbol, resolve_qk_norm(config, layer))
        super().__init__(config, layer, layer_number, *args, **kwargs)

    def forward(self, *args, **kwargs):
        if self.drops_rotary:
            kwargs = without_rotary(kwargs)
        return super().forward(*args, **kwargs)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Per-layer checkpoint keys (``<prefix><global index>.``) instead of the stacked layer axis, unless every
        layer of the model has the same structure (one symbol, all MLPs dense or all MoE): then megatron's stacked
        keys, as a plain ``TransformerLayer`` stack writes them."""
        if not sharded_offsets or self.homogeneous:  # the block already asked for per-layer keys / stacked
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if len(sharded_offsets) != 1 or sharded_offsets[0][0] != 0:
            raise ValueError(f"PatternLayer expects only megatron's layer-axis offset, got {sharded_offsets}")
        global_index = sharded_offsets[0][1]
        state = super().sharded_state_dict(prefix, (), metadata)
        replace_prefix_for_sharding(state, prefix, f"{prefix}{global_index}.")
        return state
