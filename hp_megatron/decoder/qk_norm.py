"""q/k norms that follow ``config.qk_layernorm`` (``--qk-layernorm``) when a layer is built."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules


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
