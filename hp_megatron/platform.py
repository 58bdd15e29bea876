"""CPU shims for megatron-core, applied only when no CUDA device is present.

megatron-core assumes CUDA in a few places (RNG tracker, current_device, synchronize). On a CPU-only
machine (tests, the gloo example) :func:`apply_cpu_shims` redirects those to CPU; on GPU/NPU it does
nothing. Nothing here changes numerics.
"""
from __future__ import annotations

import torch

_applied = False


def cuda_available() -> bool:
    return torch.cuda.is_available()


def apply_cpu_shims(seed: int | None = None) -> bool:
    """Make megatron-core usable on CPU with gloo; returns True when shims were applied."""
    global _applied
    if cuda_available():
        return False
    if not _applied:
        torch.cuda.current_device = lambda: torch.device("cpu")
        torch.cuda.synchronize = lambda *args, **kwargs: None
        _applied = True
    from megatron.core.tensor_parallel import random as tp_random

    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    if seed is not None:
        torch.manual_seed(seed)
    return True
