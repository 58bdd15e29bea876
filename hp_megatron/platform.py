"""CPU shims for megatron-core, applied only when no CUDA device is present.

megatron-core assumes CUDA in a few places (RNG tracker, current_device, synchronize). On a CPU-only
machine (tests, the gloo example) :func:`apply_cpu_shims` redirects those to CPU; on GPU/NPU it does
nothing. It also flushes denormal floats to zero on this thread and the threads it starts later
(``torch.set_flush_denormal``): the delta-rule kernels multiply strongly decayed terms whose products fall below
1.2e-38, and x86 CPUs compute with such operands up to 300x slower (a [32,64,64] batched matmul: 0.12 ms vs
37 ms); GPUs run them at full speed. This changes results by less than 1.2e-38 absolute (2.2e-308 in fp64).
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
    torch.set_flush_denormal(True)
    from megatron.core.tensor_parallel import random as tp_random

    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    if seed is not None:
        torch.manual_seed(seed)
    return True


class _CpuDeviceTorch:
    """``torch`` for a megatron module that hard-codes ``device="cuda"`` in factory calls: maps it to CPU."""

    _factories = ("zeros", "ones", "empty", "tensor", "full")

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name not in self._factories:
            return attr

        def factory(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return attr(*args, **kwargs)

        return factory


def _get_pos_emb_on_this_cp_rank_cpu(pos_emb, seq_dim, cp_group):
    """megatron-core's zigzag slice of a rotary table, without ``pin_memory``/``.cuda()``."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, cp_idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


def apply_cpu_training_shims(seed: int | None = None) -> bool:
    """:func:`apply_cpu_shims` plus what training on CPU needs: megatron's pipeline schedules (which
    allocate their token counter with ``device="cuda"``) and the CP slice of rotary tables (``.cuda()``).
    Returns True when shims were applied (no CUDA device)."""
    if not apply_cpu_shims(seed):
        return False
    import importlib

    schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    schedules.torch = _CpuDeviceTorch()
    for name in ("megatron.core.models.common.embeddings.rope_utils",
                 "megatron.core.models.common.embeddings.rotary_pos_embedding",
                 "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "get_pos_emb_on_this_cp_rank"):
            module.get_pos_emb_on_this_cp_rank = _get_pos_emb_on_this_cp_rank_cpu
    return True
