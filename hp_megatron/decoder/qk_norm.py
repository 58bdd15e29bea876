"""q/k norms that follow ``config.qk_layernorm`` (``--qk-layernorm``) and ``config.hp_qk_norm_scope``
(``--hp-qk-norm-scope``: per head, megatron-core's, or over the whole projection, OLMo's) when a layer is built."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

import torch
from torch import nn

from layers.shared.parallel import AllReduceSum


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
    scope = getattr(config, "hp_qk_norm_scope", None) or "head"
    if scope not in QK_NORM_SCOPES:
        raise ValueError(f"hp_qk_norm_scope must be one of {QK_NORM_SCOPES}, got {scope!r}")
    if isinstance(q_norm, QKNormFromConfig):
        norm = q_norm.norm if wants_norm else IdentityOp
        attention = replace(attention, q_layernorm=norm, k_layernorm=norm)
        layer = replace(layer, self_attention=replace(layer.self_attention, submodules=attention))
        q_norm = norm
    if scope == "projection" and hasattr(attention, "linear_qkv") and q_norm not in (None, IdentityOp):
        attention = replace(attention, q_layernorm=QueryProjectionRMSNorm, k_layernorm=KeyProjectionRMSNorm)
        return replace(layer, self_attention=replace(layer.self_attention, submodules=attention))
    if wants_norm and q_norm is IdentityOp and hasattr(attention, "linear_qkv"):
        raise ValueError("config.qk_layernorm=True (--qk-layernorm) but the attention spec has no q/k norms; "
                         "build it with get_hybrid_layer_spec(..., qk_layernorm=True or 'config')")
    return layer



QK_NORM_SCOPES = ("head", "projection")


class ProjectionRMSNorm(nn.Module):
    """One RMSNorm over a whole q or k projection (OLMo 2 / OLMo 3, OLMo-Hybrid: ``num_attention_heads *
    kv_channels`` query channels, ``num_query_groups * kv_channels`` key channels), where megatron-core's
    ``qk_layernorm`` normalises each head: ``q_layernorm`` / ``k_layernorm`` of ``config.hp_qk_norm_scope =
    "projection"`` (:class:`QueryProjectionRMSNorm`, :class:`KeyProjectionRMSNorm`), built as megatron's
    ``SelfAttention`` builds its q/k norms (``hidden_size`` = the head dim) and applied to ``[s, b, heads_local, d]``.

    Under tensor parallelism the weight (``[heads * d]``) is replicated, as megatron-core's q/k norm weights are,
    and each rank scales its heads' channels with its slice of it: each rank's gradient is nonzero on its slice only,
    and megatron-core's ``finalize_model_grads`` sums ``q_layernorm`` / ``k_layernorm`` gradients over TP (what it
    does for per-head q/k norms), which completes it. The sum of squares is all-reduced over the TP group
    (differentiably: every rank's output depends on every rank's channels). Key heads replicated over TP
    (``num_query_groups`` < TP) are refused."""

    part = None   # "query" | "key"

    def __init__(self, config=None, hidden_size=None, eps=1e-5, **kwargs):
        super().__init__()
        from megatron.core import parallel_state

        heads = config.num_attention_heads if self.part == "query" else (config.num_query_groups
                                                                         or config.num_attention_heads)
        tp = config.tensor_model_parallel_size
        if heads % tp:
            raise ValueError(f"hp_qk_norm_scope='projection': the {self.part} heads ({heads}) must be divisible by "
                             f"the tensor-parallel size {tp} (heads replicated over TP are not supported)")
        self.eps, self.total, self.local = float(eps), heads * hidden_size, heads // tp * hidden_size
        self.tp_group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
        self.start = (self.tp_group.rank() if self.tp_group is not None else 0) * self.local
        self.weight = nn.Parameter(torch.ones(self.total, dtype=config.params_dtype))
        self.weight.sequence_parallel = False

    def forward(self, x):
        flat = x.reshape(*x.shape[:-2], -1).float()
        squares = flat.pow(2).sum(-1, keepdim=True)
        if self.tp_group is not None:
            squares = AllReduceSum.apply(squares, self.tp_group)
        normed = flat * torch.rsqrt(squares / self.total + self.eps)
        weight = self.weight.narrow(0, self.start, self.local)
        return (weight.float() * normed).to(x.dtype).reshape(x.shape)

    def extra_repr(self):
        return f"{self.part}: channels {self.start}..{self.start + self.local} of {self.total}, eps={self.eps}"


class QueryProjectionRMSNorm(ProjectionRMSNorm):
    part = "query"


class KeyProjectionRMSNorm(ProjectionRMSNorm):
    part = "key"
