"""CPU shims for megatron-core, applied only when no CUDA device is present.

megatron-core assumes CUDA in a few places (RNG tracker, current_device, synchronize, current_stream). On a CPU-only
machine (tests, the gloo example) :func:`apply_cpu_shims` redirects those to CPU; on GPU/NPU it does
nothing. It also flushes denormal floats to zero on this thread and the threads it starts later
(``torch.set_flush_denormal``): the delta-rule kernels multiply strongly decayed terms whose products fall below
1.2e-38, and x86 CPUs compute with such operands up to 300x slower (a [32,64,64] batched matmul: 0.12 ms vs
37 ms); GPUs run them at full speed. This changes results by less than 1.2e-38 absolute (2.2e-308 in fp64).

:data:`CPU_SAFE_CONFIG` is the one set of ``TransformerConfig`` fields that keeps megatron-core off the fused
kernels of Apex / Transformer Engine / CUDA, and :data:`MEGATRON_LM_CPU_FLAGS` the same fields as Megatron-LM's
command line plus what its training loop needs on gloo (tests/integration/test_training_library.py keeps the two equal).
"""
from __future__ import annotations

import contextlib

import torch

_applied = False

# TransformerConfig fields under which megatron-core runs on any device: parameters made on the host, no fused
# kernels of Apex / Transformer Engine (gradient accumulation into main_grad, bias + activation, bias + dropout,
# RoPE, masked softmax, persistent LayerNorm). The example builds every model with them (its layers are
# megatron-core's local modules and ours, on every device); on GPU they cost the fusions' speed and a host-side
# initialization (then one copy to the device), nothing else.
CPU_SAFE_CONFIG = {"use_cpu_initialization": True, "gradient_accumulation_fusion": False,
                   "bias_activation_fusion": False, "bias_dropout_fusion": False, "apply_rope_fusion": False,
                   "masked_softmax_fusion": False, "persist_layer_norm": False}

# Megatron-LM's flags for a run of its training loop on CPU (gloo): the CPU_SAFE_CONFIG fields, local (not TE)
# modules, the inference RNG tracker (its CUDA tracker needs a device) and no rerun state machine (CUDA RNG).
MEGATRON_LM_CPU_FLAGS = ("--distributed-backend", "gloo", "--transformer-impl", "local", "--inference-rng-tracker",
                         "--rerun-mode", "disabled", "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
                         "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
                         "--no-masked-softmax-fusion", "--no-persist-layer-norm")


def cuda_available() -> bool:
    return torch.cuda.is_available()


class _CpuStream:
    """``torch.cuda.current_stream()`` on CPU, where work is ordered anyway: waits are no-ops (megatron-core 0.19's
    DDP gradient sync waits on the current stream for CUDA-graph events)."""

    def wait_event(self, event):
        return None

    def wait_stream(self, stream):
        return None

    def synchronize(self):
        return None


_CPU_STREAM = _CpuStream()


def apply_cpu_shims(seed: int | None = None) -> bool:
    """Make megatron-core usable on CPU with gloo; returns True when shims were applied."""
    global _applied
    if cuda_available():
        return False
    if not _applied:
        torch.cuda.current_device = lambda: torch.device("cpu")
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.current_stream = lambda *args, **kwargs: _CPU_STREAM
        _applied = True
    torch.set_flush_denormal(True)
    from megatron.core.tensor_parallel import random as tp_random

    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    if seed is not None:
        torch.manual_seed(seed)
    return True


@contextlib.contextmanager
def single_rank_megatron(seed: int | None = None, *, model_parallel: bool = True):
    """One process as a whole megatron-core world for the duration: a one-rank gloo group (created unless one
    exists; yields ``torch.distributed.group.WORLD``), :func:`apply_cpu_shims` (``seed``: torch's RNG seeded; on
    CUDA megatron's CUDA RNG tracker seeded instead) and, with ``model_parallel``, megatron-core's parallel state
    at TP=PP=CP=EP=1. Tears down only what it created. RuntimeError if an existing group has several ranks."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    created_group = not dist.is_initialized()
    if created_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError(f"single_rank_megatron runs in one process; torch.distributed has world size "
                           f"{dist.get_world_size()}")
    created_state = model_parallel and not parallel_state.model_parallel_is_initialized()
    if created_state:
        parallel_state.initialize_model_parallel(1, 1)
    apply_cpu_shims(seed)
    if seed is not None and cuda_available():  # megatron's GPU init draws from its CUDA RNG tracker
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed, tp_rank=0, ep_rank=0, etp_rank=0)
    try:
        yield dist.group.WORLD
    finally:
        if created_state:
            parallel_state.destroy_model_parallel()
        if created_group:
            dist.destroy_process_group()


class _GlooDistributed:
    """``torch.distributed`` for a megatron module that averages with ``ReduceOp.AVG``, which gloo lacks: such an
    all-reduce is a SUM divided by the group's size; everything else is ``torch.distributed``'s."""

    def __getattr__(self, name):
        return getattr(torch.distributed, name)

    @staticmethod
    def all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        if op != torch.distributed.ReduceOp.AVG:
            return torch.distributed.all_reduce(tensor, op=op, group=group, async_op=async_op)
        if async_op:
            raise ValueError("an averaging all-reduce on gloo is emulated synchronously; async_op=True is unsupported")
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, group=group)
        tensor.div_(torch.distributed.get_world_size(group))
        return None


class _CpuDeviceTorch:
    """``torch`` for a megatron module that hard-codes ``device="cuda"`` in factory calls: maps it to CPU; its
    ``torch.distributed`` averages on gloo (:class:`_GlooDistributed`)."""

    _factories = ("zeros", "ones", "empty", "tensor", "full")
    distributed = _GlooDistributed()

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
    allocate their token counter with ``device="cuda"``), the MoE loss tracker (``device="cuda"``,
    ``ReduceOp.AVG``, which gloo lacks) and the CP slice of rotary tables (``.cuda()``).
    Returns True when shims were applied (no CUDA device)."""
    if not apply_cpu_shims(seed):
        return False
    import importlib

    # the schedules' token counter; the MoE loss tracker (zeros on "cuda", ReduceOp.AVG over data-parallel)
    for name in ("megatron.core.pipeline_parallel.schedules", "megatron.core.transformer.moe.moe_utils"):
        importlib.import_module(name).torch = _CpuDeviceTorch()
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
