"""The transformer layer of GPTModel's multi-token-prediction layers: a pattern layer of one fixed symbol."""
from __future__ import annotations

from typing import Tuple

from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from hp_megatron.gpt.layer import PatternLayer, PatternLayerSubmodules


class MTPPatternLayer(PatternLayer):
    """The transformer layer of a multi-token-prediction layer: a ``PatternLayer`` of the one symbol ``symbol``, built
    with ``mtp=True``.

    Spec: ``ModuleSpec(module=MTPPatternLayer, submodules=<that symbol's TransformerLayerSubmodules>,
    params={"symbol": "A", "moe_mlp": ..., "own_positions": (...)})``: megatron-core's MTP layer reads the mask type of
    the attention in a ``TransformerLayerSubmodules`` (0.19 refuses any other submodules type there)."""

    def __init__(self, config, submodules: TransformerLayerSubmodules, layer_number: int = 1, *args, symbol: str,
                 moe_mlp=None, own_positions: Tuple[str, ...] = (), **kwargs):
        if not isinstance(submodules, TransformerLayerSubmodules):
            raise TypeError(f"MTPPatternLayer needs the TransformerLayerSubmodules of its symbol, got "
                            f"{type(submodules).__name__}")
        hybrid = PatternLayerSubmodules(layer_types={symbol: submodules}, own_positions=tuple(own_positions),
                                       moe_mlp=moe_mlp, mtp_symbol=symbol)
        super().__init__(config, hybrid, layer_number, *args, pattern=symbol, mtp=True, **kwargs)
