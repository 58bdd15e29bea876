"""Gradients of TP-replicated parameters that every TP rank's heads contribute to (GDN / KDA's output-norm weight,
shared by all heads while TP splits the heads): each rank's gradient is partial and must be summed over TP, once
per step.

* With sequence parallelism the parameter is marked ``sequence_parallel=True``: megatron-core's
  ``finalize_model_grads`` (0.16 and 0.19: ``_allreduce_non_tensor_model_parallel_grads``) sums it over TP together
  with the layer norms' gradients, in the one coalesced all-reduce per step it issues for them anyway.
* Without it megatron-core sums nothing over TP (it has no attribute for "sum these": its
  ``average_gradients_across_tp_domain`` averages). A tensor hook sums the gradient at every backward (one
  all-reduce per parameter per micro-batch), unless the model config's ``finalize_model_grads_func`` is
  :func:`finalize_model_grads` of this module (or any function with ``reduces_pending_tp_grads = True``): then the
  hook only marks the parameter pending, and :func:`finalize_model_grads` runs megatron-core's and then sums every
  pending gradient of the model in one coalesced all-reduce per TP group and step. The hook reads the config at
  each backward, so a training loop that keeps megatron-core's function (Megatron-LM 0.16's ``train`` replaces
  ours unless the launcher patches it) still gets correct gradients, per micro-batch.

Sums are linear, so summing the accumulated ``main_grad`` after the data-parallel reduction and the per-token
scaling equals summing each micro-batch's gradient before them.
"""
from __future__ import annotations

import weakref

import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from layers.shared.parallel import group_size

PENDING = "_hp_tp_grad_sum_pending"   # parameter attribute from its backward to the finalization: the TP group
REDUCES_PENDING = "reduces_pending_tp_grads"   # attribute of a finalize function that sums the pending gradients


def sum_grad_over_tp(param, config, tp_group) -> None:
    """Make ``param``'s gradient the sum over ``tp_group`` of every rank's (see the module docstring): under
    ``config.sequence_parallel`` through megatron-core's finalization, otherwise by a hook (per micro-batch, or
    deferred to :func:`finalize_model_grads` when the config's ``finalize_model_grads_func`` is it)."""
    sp = bool(getattr(config, "sequence_parallel", False))
    param.sequence_parallel = sp
    if sp or group_size(tp_group) == 1 or not param.requires_grad:
        return
    param_ref = weakref.ref(param)

    def hook(grad):
        if getattr(getattr(config, "finalize_model_grads_func", None), REDUCES_PENDING, False):
            setattr(param_ref(), PENDING, tp_group)
            return grad
        grad = grad.contiguous()   # all_reduce works in place on contiguous memory
        dist.all_reduce(grad, group=tp_group)
        return grad

    param.register_hook(hook)


def reduce_pending_tp_grads(model) -> int:
    """Sum the pending gradients (``main_grad`` when megatron's DDP gave one, else ``grad``) of ``model`` (a module
    or a list of model chunks) over their TP groups, one coalesced all-reduce per group, and clear the marks.
    Returns the number of all-reduces issued. Every TP rank marks the same parameters (same layers, same config)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    by_group: dict = {}
    for chunk in chunks:
        for param in chunk.parameters():
            group = getattr(param, PENDING, None)
            if group is None:
                continue
            delattr(param, PENDING)
            grad = param.main_grad if hasattr(param, "main_grad") else param.grad
            if grad is not None:
                by_group.setdefault(id(group), (group, []))[1].append(getattr(grad, "_local_tensor", grad).data)
    for group, grads in by_group.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(summed)
    return len(by_group)


def finalize_model_grads(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    """megatron-core's ``finalize_model_grads`` (same arguments: set it as ``config.finalize_model_grads_func``),
    then the once-per-step TP sum of the pending replicated gradients (:func:`reduce_pending_tp_grads`)."""
    from megatron.core.distributed import finalize_model_grads as megatron_finalize_model_grads

    megatron_finalize_model_grads(model, num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    reduce_pending_tp_grads(model)


setattr(finalize_model_grads, REDUCES_PENDING, True)
