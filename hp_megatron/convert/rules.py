"""One conversion rule per megatron-core tensor: which Hugging Face tensors build it, and how (both ways).

Keys are those of the whole model at TP=PP=EP=1 (``GPTModel.state_dict()`` keys, global layer numbers and
global expert indices), tensors are full (unsharded). Streaming converters read only ``hf_keys`` of one rule at
a time, so peak memory is bounded by the largest rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass(frozen=True)
class TensorRule:
    """``mcore_key`` <- ``to_mcore([hf tensors in hf_keys order])``; ``to_hf(mcore tensor)`` returns the HF
    tensors in ``hf_keys`` order (the exact inverse: HF -> ours -> HF is bit-exact)."""

    mcore_key: str
    hf_keys: tuple[str, ...]
    to_mcore: Callable[[Sequence[torch.Tensor]], torch.Tensor]
    to_hf: Callable[[torch.Tensor], Sequence[torch.Tensor]]


def identity_rule(mcore_key: str, hf_key: str) -> TensorRule:
    """A tensor stored identically on both sides."""
    return TensorRule(mcore_key, (hf_key,), lambda ts: ts[0], lambda t: (t,))


def concat_rule(mcore_key: str, hf_keys: Sequence[str], dim: int = 0,
                sizes: Sequence[int] | None = None) -> TensorRule:
    """``mcore_key`` is the HF tensors concatenated along ``dim`` (megatron's SwiGLU ``linear_fc1`` is
    ``[gate; up]``); back, it is split into ``sizes`` along ``dim`` (equal parts when None)."""

    def to_hf(t):
        if sizes is not None:
            return t.split(list(sizes), dim=dim)
        if t.shape[dim] % len(hf_keys):
            raise ValueError(f"{mcore_key}: dim {dim} of size {t.shape[dim]} does not split into "
                             f"{len(hf_keys)} equal parts")
        return t.chunk(len(hf_keys), dim=dim)

    return TensorRule(mcore_key, tuple(hf_keys), lambda ts: torch.cat(list(ts), dim=dim), to_hf)


def grouped_qkv_rule(mcore_key: str, q_key: str, k_key: str, v_key: str, *, num_heads: int, num_groups: int,
                     head_dim: int) -> TensorRule:
    """megatron's fused ``linear_qkv`` (weight ``[(heads + 2 * groups) * head_dim, hidden]``, or its bias):
    rows per query group ``g`` are ``[q heads of g, k_g, v_g]``, from separate HF ``q/k/v_proj`` tensors."""
    if num_heads % num_groups:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_groups={num_groups}")
    per_group = num_heads // num_groups

    def to_mcore(ts):
        q, k, v = ts
        rest = q.shape[1:]
        grouped = [q.reshape(num_groups, per_group * head_dim, *rest), k.reshape(num_groups, head_dim, *rest),
                   v.reshape(num_groups, head_dim, *rest)]
        return torch.cat(grouped, dim=1).reshape(-1, *rest)

    def to_hf(t):
        rest = t.shape[1:]
        q, k, v = t.reshape(num_groups, (per_group + 2) * head_dim, *rest).split(
            [per_group * head_dim, head_dim, head_dim], dim=1)
        return (q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest))

    return TensorRule(mcore_key, (q_key, k_key, v_key), to_mcore, to_hf)
