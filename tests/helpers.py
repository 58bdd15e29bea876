"""Small stand-ins shared by single-process tests."""
from __future__ import annotations

import contextlib
import tempfile

import torch
import torch.distributed as dist


class FakeGroup:
    """A process group that only answers ``size()`` and ``rank()``: enough for code that reads the CP size
    and rank from a group (megatron-core's and our ``get_batch_on_this_cp_rank``)."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


# transformers binds flash-linear-attention's kernels in place of these pure-PyTorch functions when FLA imports.
_FLA_BOUND_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
                        "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")


def use_transformers_torch_path(module):
    """Reset a transformers modeling ``module`` (Qwen3-Next, Kimi-Linear) to its own pure-PyTorch GDN/KDA functions
    and return it: where FLA is installed transformers calls FLA's Triton kernels instead, which cannot run on
    CPU and would not be an independent reference. Idempotent."""
    for name in _FLA_BOUND_FUNCTIONS:
        fn = getattr(module, name, None)
        if fn is not None and hasattr(fn, "__wrapped__"):
            setattr(module, name, fn.__wrapped__)
    return module


@contextlib.contextmanager
def single_rank_world(seed: int, *, model_parallel: bool = True):
    """A one-rank gloo group (created here unless one exists; yields ``dist.group.WORLD``), megatron-core's CPU
    shims with the RNG seeded with ``seed`` (on CUDA: megatron's CUDA RNG tracker), and with ``model_parallel``
    megatron-core's parallel state at TP=PP=CP=EP=1. Tears down only what it set up."""
    from megatron.core import parallel_state

    from hp_megatron.platform import apply_cpu_shims

    created_group = not dist.is_initialized()
    if created_group:
        store = tempfile.NamedTemporaryFile(delete=False)
        dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
    created_state = model_parallel and not parallel_state.model_parallel_is_initialized()
    if created_state:
        parallel_state.initialize_model_parallel(1, 1)
    apply_cpu_shims(seed)
    if torch.cuda.is_available():  # megatron's GPU init draws from its CUDA RNG tracker
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed, tp_rank=0, ep_rank=0, etp_rank=0)
    try:
        yield dist.group.WORLD
    finally:
        if created_state:
            parallel_state.destroy_model_parallel()
        if created_group:
            dist.destroy_process_group()
