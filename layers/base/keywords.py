"""Strict construction: an unknown keyword to a layer raises TypeError naming it and the accepted ones.

megatron-core's builders pass keywords that not every submodule reads (``build_module`` of TransformerLayer,
MambaLayer, attention cores); those are accepted and ignored, everything else must be a declared parameter.
"""
from __future__ import annotations

import inspect

# keywords megatron-core 0.16-0.19 builders pass to self_attention / mixer / core_attention submodules
MEGATRON_PASSTHROUGH = frozenset({
    "attention_type", "attn_mask_type", "cp_comm_type", "d_model", "k_channels", "layer_number", "name",
    "pg_collection", "pp_layer_offset", "softmax_scale", "tp_group", "v_channels", "vp_stage",
})


def check_keywords(owner: str, extra: dict, accepted) -> None:
    """TypeError if ``extra`` (the ``**kwargs`` a constructor did not bind) holds anything but megatron-core's
    pass-through keywords; the message names the unknown keywords and the ``accepted`` ones."""
    unknown = sorted(k for k in extra if k not in MEGATRON_PASSTHROUGH)
    if unknown:
        raise TypeError(f"{owner} got unknown keyword(s) {unknown}; accepted: {sorted(set(accepted))} "
                        f"(megatron-core's pass-through keywords {sorted(MEGATRON_PASSTHROUGH)} are ignored)")


def declared_keywords(cls) -> list:
    """Named parameters of ``cls.__init__`` (without self and ``*args`` / ``**kwargs``)."""
    params = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
