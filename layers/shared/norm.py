"""RMS norms with megatron-core's norm constructor signature ``(config, hidden_size, eps)``.

megatron-core builds norms as ``build_module(spec, config=..., hidden_size=..., eps=...)``; its
``WrappedTorchNorm`` refuses sequence parallelism, and Transformer Engine's norms need TE. These run anywhere.

* :class:`RMSNorm` normalizes hidden states; it marks its weight ``sequence_parallel`` so megatron's grad
  finalization all-reduces the weight gradient over the TP group when the norm runs on sequence-parallel shards.
* :class:`GatedRMSNorm` is the output norm of GDN (SiLU gate, Qwen3-Next) and KDA (sigmoid gate, Kimi Linear):
  ``rmsnorm(x) * weight * act(gate)``, all in fp32, result in x's dtype. With ``backend="triton"`` it is FLA's
  fused kernel (``fla.modules.norm.fused_norm_gate.rms_norm_gated``: norm, weight and gate in one kernel forward
  and one backward, saving x, gate and the per-row rstd); otherwise PyTorch ops run under
  :func:`layers.ops.eager.recompute.recompute`, which saves x, gate and the weight and recomputes the
  element-wise chain in backward (the same bytes as the fused kernel, more kernels).

With ``config.layernorm_zero_centered_gamma`` the weight is stored as ``gamma - 1`` (initialized to zeros).
:class:`GatedRMSNorm` reads ``config.gated_norm_zero_centered_gamma`` first when it is set (Qwen3-Next centres its
layer and q/k norms but not the gated output norm of its GDN layers); ``zero_centered_gamma=`` overrides both.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from layers.base.choices import BACKENDS
from layers.ops.backends import get_backend
from layers.ops.eager.recompute import recompute

GATE_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "sigmoid": torch.sigmoid}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2, -1) + eps)``, statistics in fp32, result in x's dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   activation: str = "silu", backend: str = "eager") -> torch.Tensor:
    """``rmsnorm(x) * weight * act(gate)`` over the last dim, computed in fp32, returned in x's dtype.

    ``backend="triton"``: FLA's fused gated RMSNorm kernel; ``"eager"`` / ``"ascendc"``: PyTorch ops with only
    x, gate and weight saved for backward (recomputed there)."""
    if backend == "triton":
        return _fla_rms_norm_gated()(x, gate, weight, None, activation=activation, eps=eps)
    return recompute(partial(_gated_rms_norm_ops, eps=eps, activation=activation), x, gate, weight)


def _fla_rms_norm_gated():
    """FLA's functional fused gated RMSNorm (the triton backend's availability was checked by the norm)."""
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    return rms_norm_gated


def _gated_rms_norm_ops(x, gate, weight, eps, activation):
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float() * GATE_ACTIVATIONS[activation](gate.float())).to(x.dtype)


def _zero_centered(config, override) -> bool:
    """``override`` when given, else ``config.layernorm_zero_centered_gamma`` (megatron's field)."""
    if override is not None:
        return bool(override)
    return bool(getattr(config, "layernorm_zero_centered_gamma", False))


def _norm_weight(config, hidden_size, zero_centered: bool) -> nn.Parameter:
    if hidden_size is None or isinstance(hidden_size, bool) or int(hidden_size) <= 0:
        raise ValueError(f"a norm needs a positive hidden_size, got {hidden_size!r}")
    dtype = getattr(config, "params_dtype", torch.float32) if config is not None else torch.float32
    device = "cpu"
    if config is not None and not getattr(config, "use_cpu_initialization", True) and torch.cuda.is_available():
        device = torch.cuda.current_device()
    init = torch.zeros if zero_centered else torch.ones
    return nn.Parameter(init(int(hidden_size), dtype=dtype, device=device))


class RMSNorm(nn.Module):
    """RMS normalization over the last dimension (``[..., hidden_size]``)."""

    def __init__(self, config=None, hidden_size: int | None = None, eps: float = 1e-5,
                 zero_centered_gamma: bool | None = None, **kwargs):
        super().__init__()
        self.eps = float(eps)
        self.zero_centered_gamma = _zero_centered(config, zero_centered_gamma)
        self.weight = _norm_weight(config, hidden_size, self.zero_centered_gamma)
        sequence_parallel = bool(getattr(config, "sequence_parallel", False)) if config is not None else False
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        return rms_norm(x, weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GatedRMSNorm(nn.Module):
    """``forward(x, gate)``: ``rmsnorm(x) * weight * act(gate)`` per head, fp32 math (x, gate ``[..., hidden_size]``).

    ``activation`` is ``"silu"`` (GDN / Qwen3-Next ``RMSNormGated``) or ``"sigmoid"`` (KDA / Kimi Linear
    ``o_norm``); ``backend`` (the mixer passes its own) picks FLA's fused kernel (``"triton"``) or PyTorch ops.
    The weight is shared by all heads, so with heads split over tensor parallelism its gradient is
    partial on every rank; the mixer that owns this norm completes it (see ``layers.mixers.delta.mixer``).
    """

    def __init__(self, config=None, hidden_size: int | None = None, eps: float = 1e-5, activation: str = "silu",
                 zero_centered_gamma: bool | None = None, backend: str = "eager", **kwargs):
        super().__init__()
        if activation not in GATE_ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(GATE_ACTIVATIONS)}, got {activation!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "triton":
            get_backend(backend)  # RuntimeError naming FLA / triton / the device when they are missing
        self.eps = float(eps)
        self.activation = activation
        self.backend = backend
        if zero_centered_gamma is None:
            zero_centered_gamma = getattr(config, "gated_norm_zero_centered_gamma", None)
        self.zero_centered_gamma = _zero_centered(config, zero_centered_gamma)
        self.weight = _norm_weight(config, hidden_size, self.zero_centered_gamma)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if x.shape != gate.shape:
            raise ValueError(f"gate must have the shape of x {tuple(x.shape)}, got {tuple(gate.shape)}")
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        return gated_rms_norm(x, gate, weight, self.eps, self.activation, self.backend)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, activation={self.activation}, backend={self.backend}"
