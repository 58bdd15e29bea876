"""A ``TransformerLayer`` whose mixer (and, optionally, every other submodule) follows a layer pattern.

Megatron-LM's ``--spec`` imports one module-level object and ``TransformerBlock`` replicates a layer
spec for the layers of its pipeline stage, so a spec cannot know at import time which pipeline or
virtual-pipeline stage it will serve. :class:`HybridLayer` therefore resolves its type when it is built,
from the *global* 1-based layer number (local number + the stage's layer offset):
``pattern[(global_layer_number - 1) % len(pattern)]`` picks a symbol, and the symbol picks a complete
``TransformerLayerSubmodules`` from :class:`HybridLayerSubmodules`. A pattern as long as ``num_layers``
describes every layer explicitly; a shorter one repeats ("KKKM" = three KDA layers, then one MLA layer).

MLP: with ``config.num_moe_experts`` set (Megatron's ``--num-experts``), the layers that
``config.moe_layer_freq`` marks (an int k: every k-th layer from the first; a list: one 0/1 per layer, as
DeepSeek-V3's first dense layers) get :attr:`HybridLayerSubmodules.moe_mlp` (megatron-core's ``MoELayer``)
instead of the dense MLP; a spec without ``moe_mlp`` refuses a MoE config rather than build dense layers.

Multi-token prediction: the transformer layer of megatron-core's MTP layers is an :class:`MTPHybridLayer`, a
``HybridLayer`` built with ``mtp=True`` (``hp_megatron.specs.get_mtp_block_spec``). It has a fixed kind, not the one
the pattern gives its layer number (past ``num_layers``): :func:`mtp_layer_symbol` (the spec's ``mtp_symbol``, else
``config.hp_mtp_layer_kind``, else the pattern's only symbol); its MLP is the MoE MLP whenever the model has
experts (DeepSeek-V3's and Qwen3-Next's MTP layers are MoE layers, as transformers' ``get_mtp_config`` has them).

Checkpoints: mixers of different types (and dense and MoE MLPs) have different parameter names, so they cannot
be stacked along megatron's layer axis. :meth:`HybridLayer.sharded_state_dict` then writes per-layer keys
``decoder.layers.<global index>.…`` (megatron's "non-homogeneous" naming), which stay valid under any
pipeline / virtual-pipeline split; a model of one mixer with uniform MLPs keeps megatron's stacked keys.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, Optional, Tuple

from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.transformer.transformer_layer import (TransformerLayer, TransformerLayerSubmodules,
                                                         get_transformer_layer_offset)


@dataclass
class HybridLayerSubmodules:
    """One ``TransformerLayerSubmodules`` per pattern symbol, e.g. ``{"K": kda_layer, "M": mla_layer}``."""

    layer_types: Dict[str, TransformerLayerSubmodules] = field(default_factory=dict)
    # symbols whose mixer computes its own positions (MLA): the model's rotary tables are not passed to them,
    # so patterns may mix MLA with RoPE attention layers
    own_positions: Tuple[str, ...] = ()
    # the mlp of MoE layers (megatron-core MoELayer spec); None: the spec has no MoE
    moe_mlp: Optional[object] = None
    # the symbol of multi-token-prediction layers; None: config.hp_mtp_layer_kind, else the pattern's only symbol
    mtp_symbol: Optional[str] = None


def mtp_layer_symbol(submodules: HybridLayerSubmodules, pattern: str, config) -> str:
    """The fixed layer symbol of the multi-token-prediction layers of a spec with ``pattern``; a one-line
    ValueError when a pattern of several symbols declares none."""
    kind = submodules.mtp_symbol or getattr(config, "hp_mtp_layer_kind", None)
    if kind is None and len(set(pattern)) == 1:
        kind = pattern[0]
    if kind is None:
        raise ValueError(f"multi-token prediction (mtp_num_layers={getattr(config, 'mtp_num_layers', None)}) with "
                         f"the hybrid pattern {pattern!r} needs the kind of its MTP layers, which the spec does not "
                         f"declare: set config.hp_mtp_layer_kind (one of {sorted(set(pattern))}) or "
                         "get_hybrid_layer_spec(..., mtp_symbol=...)")
    if kind not in submodules.layer_types:
        raise ValueError(f"MTP layer kind {kind!r} has no layer spec; known symbols: {sorted(submodules.layer_types)}")
    return kind


def moe_layer_flags(config) -> list:
    """One bool per global layer: does it get the MoE MLP (megatron's ``moe_layer_freq`` convention)?"""
    num_layers = config.num_layers
    if not getattr(config, "num_moe_experts", None):
        return [False] * num_layers
    freq = getattr(config, "moe_layer_freq", 1)
    if isinstance(freq, int):
        if freq <= 0:
            raise ValueError(f"moe_layer_freq must be a positive int or a 0/1 list, got {freq}")
        return [i % freq == 0 for i in range(num_layers)]
    flags = list(freq)
    if len(flags) != num_layers or any(f not in (0, 1) for f in flags):
        raise ValueError(f"moe_layer_freq as a list needs one 0/1 per layer (num_layers={num_layers}), got {flags}")
    return [bool(f) for f in flags]


def with_layer_mlp(config, layer: TransformerLayerSubmodules, moe_mlp, global_layer_number: int):
    """``layer`` with the MoE MLP when ``moe_layer_flags`` marks this 1-based global layer, else unchanged."""
    if not moe_layer_flags(config)[global_layer_number - 1]:
        return layer
    return with_moe_mlp(config, layer, moe_mlp)


def with_moe_mlp(config, layer: TransformerLayerSubmodules, moe_mlp):
    """``layer`` with the MoE MLP ``moe_mlp`` (ValueError when the spec has none or asks for grouped GEMM)."""
    if moe_mlp is None:
        raise ValueError(f"config.num_moe_experts={config.num_moe_experts} asks for MoE layers but this layer "
                         "spec has no MoE MLP (HybridLayerSubmodules.moe_mlp is None)")
    if getattr(config, "moe_grouped_gemm", False):
        raise ValueError("moe_grouped_gemm=True needs Transformer Engine's grouped GEMM, which these specs do not "
                         "use; set moe_grouped_gemm=False (megatron-core SequentialMLP experts)")
    return replace(layer, mlp=moe_mlp)


def validate_pattern(pattern: str, symbols) -> str:
    """Check a layer pattern against the known symbols; return it unchanged."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"layer pattern must be a non-empty string, got {pattern!r}")
    unknown = sorted(set(pattern) - set(symbols))
    if unknown:
        raise ValueError(f"layer pattern {pattern!r} uses symbols {unknown} that have no layer spec; "
                         f"known symbols: {sorted(symbols)}")
    return pattern


@dataclass(frozen=True)
class QKNormFromConfig:
    """An attention spec's ``q_layernorm`` / ``k_layernorm`` chosen when the layer is built: ``norm`` when
    ``config.qk_layernorm`` (``--qk-layernorm``) is set, else none (the ready specs of ``hp_megatron.specs``,
    which Megatron-LM imports as objects, so the flag cannot reach their construction)."""

    norm: object


def resolve_qk_norm(config, layer: TransformerLayerSubmodules) -> TransformerLayerSubmodules:
    """``layer`` with a ``QKNormFromConfig`` in its attention spec replaced by the norm or ``IdentityOp``.
    megatron's ``qk_layernorm`` lives in the spec: a config asking for it from a spec without q/k norms is refused."""
    from megatron.core.transformer.identity_op import IdentityOp

    attention = getattr(layer.self_attention, "submodules", None)
    q_norm = getattr(attention, "q_layernorm", None)
    wants_norm = getattr(config, "qk_layernorm", False)
    if isinstance(q_norm, QKNormFromConfig):
        norm = q_norm.norm if wants_norm else IdentityOp
        attention = replace(attention, q_layernorm=norm, k_layernorm=norm)
        return replace(layer, self_attention=replace(layer.self_attention, submodules=attention))
    if wants_norm and q_norm is IdentityOp and hasattr(attention, "linear_qkv"):
        raise ValueError("config.qk_layernorm=True (--qk-layernorm) but the attention spec has no q/k norms; "
                         "build it with get_hybrid_layer_spec(..., qk_layernorm=True or 'config')")
    return layer


def symbol_for_layer(pattern: str, global_layer_number: int) -> str:
    """The pattern symbol of a 1-based global layer number (the pattern repeats)."""
    if global_layer_number < 1:
        raise ValueError(f"global layer numbers start at 1, got {global_layer_number}")
    return pattern[(global_layer_number - 1) % len(pattern)]


def stage_layer_offset(config, vp_stage=None, pg_collection=None, pp_layer_offset=None) -> int:
    """Global index of this pipeline (and virtual-pipeline) stage's first layer: the ``pp_layer_offset`` megatron-core
    0.19 may hand the layer, else ``get_transformer_layer_offset(config, vp_stage, pp_rank)`` with the pipeline
    rank of ``pg_collection`` (megatron-core's parallel state without one)."""
    if pp_layer_offset is not None:
        return int(pp_layer_offset)
    pp_group = getattr(pg_collection, "pp", None) if pg_collection is not None else None
    pp_rank = pp_group.rank() if pp_group is not None else None
    return get_transformer_layer_offset(config, vp_stage, pp_rank)


_ROTARY_KWARGS = ("rotary_pos_emb", "rotary_pos_cos", "rotary_pos_sin", "rotary_pos_cos_sin")


def without_rotary(kwargs: dict) -> dict:
    """``TransformerLayer.forward`` keywords with the model's rotary tables set to None (for a mixer that computes
    its own positions, as our MLA, which refuses them)."""
    return {name: None if name in _ROTARY_KWARGS else value for name, value in kwargs.items()}


class HybridLayer(TransformerLayer):
    """``TransformerLayer`` built from the pattern symbol of its global layer number.

    Spec: ``ModuleSpec(module=HybridLayer, params={"pattern": "KKKM"},
    submodules=HybridLayerSubmodules(layer_types={"K": ..., "M": ...}))``. ``self.layer_symbol`` records
    the chosen symbol. All other constructor arguments pass through to ``TransformerLayer`` unchanged.
    """

    def __init__(self, config, submodules: HybridLayerSubmodules, layer_number: int = 1, *args,
                 pattern: Optional[str] = None, mtp: bool = False, **kwargs):
        if not isinstance(submodules, HybridLayerSubmodules):
            raise TypeError(f"HybridLayer needs HybridLayerSubmodules, got {type(submodules).__name__}")
        if pattern is None:
            pattern = getattr(config, "hp_layer_pattern", None)
            if pattern is None:
                raise ValueError("HybridLayer without a pattern reads config.hp_layer_pattern (--hp-layer-pattern), "
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
        self.drops_rotary = self.layer_symbol in submodules.own_positions
        layer = resolve_qk_norm(config, layer)
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
            raise ValueError(f"HybridLayer expects only megatron's layer-axis offset, got {sharded_offsets}")
        global_index = sharded_offsets[0][1]
        state = super().sharded_state_dict(prefix, (), metadata)
        replace_prefix_for_sharding(state, prefix, f"{prefix}{global_index}.")
        return state


class MTPHybridLayer(HybridLayer):
    """The transformer layer of a multi-token-prediction layer: a ``HybridLayer`` of the one kind ``kind``, built
    with ``mtp=True``.

    Spec: ``ModuleSpec(module=MTPHybridLayer, submodules=<that kind's TransformerLayerSubmodules>,
    params={"kind": "A", "moe_mlp": ..., "own_positions": (...)})``: megatron-core's MTP layer reads the mask type of
    the attention in a ``TransformerLayerSubmodules`` (0.19 refuses any other submodules type there)."""

    def __init__(self, config, submodules: TransformerLayerSubmodules, layer_number: int = 1, *args, kind: str,
                 moe_mlp=None, own_positions: Tuple[str, ...] = (), **kwargs):
        if not isinstance(submodules, TransformerLayerSubmodules):
            raise TypeError(f"MTPHybridLayer needs the TransformerLayerSubmodules of its kind, got "
                            f"{type(submodules).__name__}")
        hybrid = HybridLayerSubmodules(layer_types={kind: submodules}, own_positions=tuple(own_positions),
                                       moe_mlp=moe_mlp, mtp_symbol=kind)
        super().__init__(config, hybrid, layer_number, *args, pattern=kind, mtp=True, **kwargs)
