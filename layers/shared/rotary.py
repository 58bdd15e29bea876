"""Rotary position embeddings for MLA: plain RoPE, YaRN with mscale, or none (NoPE), at explicit positions.

Positions are passed in, never derived from a tensor's length, so tokens held in Megatron's zigzag CP
layout or packed THD documents (positions restart at 0 per document) rotate by their global position.
The math follows megatron-core's MLA (``RotaryEmbedding``/``YarnRotaryEmbedding`` and
``_apply_rotary_pos_emb_bshd(multi_latent_attention=True)``): the rotary channels are stored as
interleaved pairs ``(x0, x1), (x2, x3), ...``; the output lays them out as ``[evens | odds]`` rotated.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from layers.base.choices import ROPE_TYPES


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN attention-magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_concentration(scaling_factor: float, mscale: Optional[float], mscale_all_dim: Optional[float]) -> float:
    """Factor multiplied into cos/sin under YaRN: ``mscale(s, mscale) / mscale(s, mscale_all_dim)``."""
    if mscale is None or mscale_all_dim is None:
        return yarn_get_mscale(scaling_factor)
    return yarn_get_mscale(scaling_factor, mscale) / yarn_get_mscale(scaling_factor, mscale_all_dim)


def mla_softmax_scale(qk_head_dim: int, qk_pos_emb_head_dim: int, rotary_scaling_factor: float,
                      mscale_all_dim: float) -> float:
    """megatron-core's MLA softmax scale ``mscale^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim)``."""
    m = yarn_get_mscale(rotary_scaling_factor, mscale_all_dim)
    return m * m / math.sqrt(qk_head_dim + qk_pos_emb_head_dim)


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_inv_freq(dim: int, base: float, scaling_factor: float, original_max_position_embeddings: int,
                  beta_fast: float, beta_slow: float, round_to_int: bool = True) -> torch.Tensor:
    """YaRN inverse frequencies [dim/2] (fp32): extrapolated for fast dims, interpolated for slow."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    extra = 1.0 / (base ** exponents)
    inter = 1.0 / (scaling_factor * base ** exponents)
    low = _yarn_correction_dim(beta_fast, dim, base, original_max_position_embeddings)
    high = _yarn_correction_dim(beta_slow, dim, base, original_max_position_embeddings)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extra_mask = 1.0 - ramp
    return inter * (1 - extra_mask) + extra * extra_mask


class MLARotary:
    """cos/sin tables of an MLA layer; ``rope_type`` in ``"rope" | "yarn" | "none"``.

    ``dim`` is ``qk_pos_emb_head_dim``. ``rotary_percent < 1`` rotates only the first
    ``int(dim * rotary_percent)`` channels (megatron's ``RotaryEmbedding``); the rest pass through.
    """

    def __init__(self, dim: int, rope_type: str = "yarn", *, rotary_base: float = 10000.0,
                 rotary_percent: float = 1.0, scaling_factor: float = 1.0,
                 original_max_position_embeddings: int = 4096, beta_fast: float = 32.0,
                 beta_slow: float = 1.0, mscale: float = 1.0, mscale_all_dim: float = 0.0):
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {rope_type!r}")
        if dim <= 0 or dim % 2:
            raise ValueError(f"rotary dim (qk_pos_emb_head_dim) must be positive and even, got {dim}")
        self.dim, self.rope_type = dim, rope_type
        if rope_type == "yarn":
            self.rot_dim = dim
            self.inv_freq = yarn_inv_freq(dim, rotary_base, scaling_factor, original_max_position_embeddings,
                                          beta_fast, beta_slow)
            self.attention_scaling = yarn_concentration(scaling_factor, mscale, mscale_all_dim)
        else:
            self.rot_dim = int(dim * rotary_percent) if rotary_percent < 1.0 else dim
            if self.rot_dim % 2:
                raise ValueError(f"rotated channels int(dim * rotary_percent) = {self.rot_dim} must be even")
            exponents = torch.arange(0, self.rot_dim, 2, dtype=torch.float32) / self.rot_dim
            self.inv_freq = 1.0 / (rotary_base ** exponents)
            self.attention_scaling = 1.0
        self._device_cache: dict = {}

    @classmethod
    def from_config(cls, config, rope_type: Optional[str] = None) -> "MLARotary":
        rope_type = rope_type or getattr(config, "rope_type", "yarn")
        return cls(config.qk_pos_emb_head_dim, rope_type, rotary_base=config.rotary_base,
                   rotary_percent=config.rotary_percent, scaling_factor=config.rotary_scaling_factor,
                   original_max_position_embeddings=config.original_max_position_embeddings,
                   beta_fast=config.beta_fast, beta_slow=config.beta_slow, mscale=config.mscale,
                   mscale_all_dim=config.mscale_all_dim)

    def _freq(self, device) -> torch.Tensor:
        key = str(device)
        if key not in self._device_cache:
            self._device_cache[key] = self.inv_freq.to(device)
        return self._device_cache[key]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos, sin [*positions.shape, rot_dim/2] in fp32 with the YaRN factor folded in; None for NoPE."""
        if self.rope_type == "none":
            return None
        angles = positions.to(torch.float32)[..., None] * self._freq(positions.device)
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling


def apply_mla_rope(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
                   token_dim: int) -> torch.Tensor:
    """Rotate ``x [..., d]`` whose dimension ``token_dim`` indexes tokens; cos/sin are [tokens, r/2].

    The first ``r`` channels hold interleaved pairs; output channels are ``[x_e cos - x_o sin |
    x_o cos + x_e sin]`` followed by the untouched ``d - r`` channels. ``cos_sin=None`` returns x.
    """
    if cos_sin is None:
        return x
    cos, sin = cos_sin
    rot = 2 * cos.shape[-1]
    shape = [1] * x.dim()
    token_dim = token_dim % x.dim()
    shape[token_dim] = cos.shape[0]
    shape[-1] = cos.shape[-1]
    cos = cos.reshape(shape).to(x.dtype)
    sin = sin.reshape(shape).to(x.dtype)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    even, odd = x_rot[..., 0::2], x_rot[..., 1::2]
    out = torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out
