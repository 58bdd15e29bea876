"""Gradient accumulation of the GDN / KDA mixers over two micro-batches at TP2 (with and without sequence
parallelism) through megatron-core's DDP and the config's ``finalize_model_grads_func``: megatron-core's own (the
output-norm weight's hook sums it over TP per micro-batch) or ``layers.shared.tp_replicated_grads``' (summed once per
step). Each run's parameter gradients (DDP's ``main_grad``, gathered over TP) against a single-rank layer that
accumulates the same micro-batches, and the TP all-reduces it issued during the backward passes and in the
finalization. Runs in the 4-rank spawn of ``tests/support/delta_layer_cases`` (TP2 x DP2: both data-parallel
replicas see the same micro-batches, so DDP's average over them is the single-rank gradient).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from tests.support.reference import rel_err

MICRO = 2
RUNS = tuple((kind, sp, finalize) for kind in ("gdn", "kda") for sp, finalize in
             ((False, "megatron"), (False, "ours"), (True, "megatron"), (True, "ours")))


def run_label(kind, sp, finalize) -> str:
    return f"{kind}-tp2{'-sp' if sp else ''}-{MICRO}micro-{finalize}_finalize"


@contextmanager
def counting_all_reduces(group, counts: dict, key: str):
    """Count ``torch.distributed.all_reduce`` calls on ``group`` into ``counts[key]`` while the block runs."""
    original = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        if kwargs.get("group", args[1] if len(args) > 1 else None) is group:
            counts[key] = counts.get(key, 0) + 1
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        yield
    finally:
        dist.all_reduce = original


def _accumulate(layer, inputs, grad_outputs):
    for x, g in zip(inputs, grad_outputs):
        y, _ = layer(x)
        y.backward(g)


def run(kind, sp, finalize) -> dict:
    """One run on this rank: ``{"param_grads": {name: rel err}, "backward_all_reduces", "finalize_all_reduces"}``."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads as megatron_finalize

    from hp_megatron.platform import apply_cpu_shims
    from layers.shared.tp_replicated_grads import finalize_model_grads as our_finalize
    from tests.support.delta_layer_cases import BATCH, HIDDEN, SEQ, build_layer, groups, layer_config

    gen = torch.Generator().manual_seed(17)
    inputs = [torch.randn(SEQ, BATCH, HIDDEN, generator=gen) for _ in range(MICRO)]
    grad_outputs = [torch.randn(SEQ, BATCH, HIDDEN, generator=gen) for _ in range(MICRO)]
    apply_cpu_shims(2024)
    ref = build_layer(kind, *groups(1, 1), layer_config(1, 1, False), {})
    _accumulate(ref, inputs, grad_outputs)
    ref_grads = ref.global_parts({n: p.grad for n, p in ref.named_parameters()})

    tp_group = parallel_state.get_tensor_model_parallel_group()
    config = layer_config(2, 1, sp)
    config.finalize_model_grads_func = our_finalize if finalize == "ours" else megatron_finalize
    apply_cpu_shims(2024)
    layer = build_layer(kind, tp_group, parallel_state.get_context_parallel_group(), config, {})
    model = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                    module=layer)
    if sp:  # each TP rank holds its sequence shard of the input and of the output
        rank = dist.get_rank(tp_group)
        inputs, grad_outputs = ([t.chunk(2)[rank] for t in ts] for ts in (inputs, grad_outputs))
    counts = {"backward_all_reduces": 0, "finalize_all_reduces": 0}
    with counting_all_reduces(tp_group, counts, "backward_all_reduces"):
        _accumulate(model, inputs, grad_outputs)
    with counting_all_reduces(tp_group, counts, "finalize_all_reduces"):
        config.finalize_model_grads_func([model])
    grads = layer.global_parts({n: p.main_grad for n, p in layer.named_parameters()})
    assert sorted(grads) == sorted(ref_grads)
    return {"param_grads": {n: rel_err(grads[n], ref_grads[n]) for n in ref_grads}, **counts}


def run_all() -> dict:
    """Every run of :data:`RUNS` at TP2 (collective over the world: re-initializes megatron's parallel state at
    TP2 and restores TP1 after)."""
    from megatron.core import parallel_state

    from tests.support.delta_layer_cases import _guarded

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(2, 1)
    try:
        return {run_label(*r): _guarded(run, *r) for r in RUNS}
    finally:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(1, 1)
