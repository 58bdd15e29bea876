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
