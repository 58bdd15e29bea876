"""Layer patterns: a string of registered mixer symbols (``"KKKM"``) that repeats over the layers, and the global
layer number of a pipeline (and virtual-pipeline) stage's layers."""
from __future__ import annotations


def validate_pattern(pattern: str, symbols) -> str:
    """Check a layer pattern against the known symbols; return it unchanged."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"layer pattern must be a non-empty string, got {pattern!r}")
    unknown = sorted(set(pattern) - set(symbols))
    if unknown:
        raise ValueError(f"layer pattern {pattern!r} uses symbols {unknown} that have no layer spec; "
                         f"known symbols: {sorted(symbols)}")
    return pattern


def symbol_for_layer(pattern: str, global_layer_number: int) -> str:
    """The pattern symbol of a 1-based global layer number (the pattern repeats)."""
    if global_layer_number < 1:
        raise ValueError(f"global layer numbers start at 1, got {global_layer_number}")
    return pattern[(global_layer_number - 1) % len(pattern)]


def stage_layer_offset(config, vp_stage=None, pg_collection=None, pp_layer_offset=None) -> int:
    """Global index of this pipeline (and virtual-pipeline) stage's first layer: the ``pp_layer_offset`` megatron-core
    0.19 may hand the layer, else ``get_transformer_layer_offset(config, vp_stage, pp_rank)`` with the pipeline
    rank of ``pg_collection`` (megatron-core's parallel state without one)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if pp_layer_offset is not None:
        return int(pp_layer_offset)
    pp_group = getattr(pg_collection, "pp", None) if pg_collection is not None else None
    pp_rank = pp_group.rank() if pp_group is not None else None
    return get_transformer_layer_offset(config, vp_stage, pp_rank)
