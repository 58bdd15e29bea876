"""The model's rotary tables withheld from a mixer that computes its own positions (our MLA)."""
from __future__ import annotations

_ROTARY_KWARGS = ("rotary_pos_emb", "rotary_pos_cos", "rotary_pos_sin", "rotary_pos_cos_sin")


def without_rotary(kwargs: dict) -> dict:
    """``TransformerLayer.forward`` keywords with the model's rotary tables set to None (for a mixer that computes
    its own positions, as our MLA, which refuses them)."""
    return {name: None if name in _ROTARY_KWARGS else value for name, value in kwargs.items()}
