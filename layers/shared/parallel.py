"""What the mixers share about megatron's process groups: their TP / CP groups, the CP group of a forward, the
activation-gradient sum over TP (parameters': ``tp_replicated_grads``), the per-group ``auto`` CP choice, and the
class a spec entry builds.

``None`` stands for "no group" (size 1, rank 0) wherever a group is taken.
"""
from __future__ import annotations

import importlib

import torch
import torch.distributed as dist


def group_size(group) -> int:
    """Ranks in ``group`` (1 for None)."""
    return 1 if group is None else group.size()


def group_rank(group) -> int:
    """This process's rank in ``group`` (0 for None)."""
    return 0 if group is None else group.rank()


def tp_cp_groups(pg_collection) -> tuple:
    """``(tp_group, cp_group)`` of a mixer: ``pg_collection``'s, each missing one from megatron's
    ``parallel_state`` when it is initialized, else None."""
    from megatron.core import parallel_state  # here: importing megatron.core prints its start-up warnings

    tp = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if parallel_state.model_parallel_is_initialized():
        tp = parallel_state.get_tensor_model_parallel_group() if tp is None else tp
        cp = parallel_state.get_context_parallel_group() if cp is None else cp
    return tp, cp


def forward_cp_group(packed_seq_params, default):
    """The CP group of a forward: the micro-batch's ``PackedSeqParams.cp_group`` (megatron's hybrid CP), else
    ``default``. megatron's hybrid CP marks a micro-batch without CP by ``local_cp_size=1`` and no group: None (no
    CP). ValueError when ``local_cp_size`` is larger than 1 without a ``cp_group``."""
    if packed_seq_params is None:
        return default
    group = getattr(packed_seq_params, "cp_group", None)
    local_size = getattr(packed_seq_params, "local_cp_size", None)
    if group is None and local_size is not None:
        if local_size == 1:
            return None
        raise ValueError(f"packed_seq_params.local_cp_size={local_size} needs packed_seq_params.cp_group (got None)")
    return default if group is None else group


def _all_reduce(grad, group):
    grad = grad.contiguous()   # all_reduce works in place on contiguous memory
    dist.all_reduce(grad, group=group)
    return grad


class SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over ``group`` (every TP rank's heads contribute).

    megatron's ``copy_to_tensor_model_parallel_region`` reduces ``grad.contiguous()`` and returns the
    unreduced gradient when it arrives non-contiguous, which happens after layout transposes.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class AllReduceSum(torch.autograd.Function):
    """Sum over ``group`` in forward and in backward (each rank's output depends on every rank's input: a norm's
    sum of squares over TP-split channels)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


def spec_module(spec):
    """The class a ``ModuleSpec`` (or a bare class) builds; ``(module path, name)`` specs are imported."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if not isinstance(spec, ModuleSpec):
        return spec
    module = spec.module
    if isinstance(module, tuple):
        module = getattr(importlib.import_module(module[0]), module[1])
    return module


class ContextParallelMixer:
    """The CP group bookkeeping both mixers share: ``self.cp_group`` (the layer's) and ``self.cp_auto_choices``
    (``cp_*="auto"``: CP group -> the choice made at the layer's first CP forward on that group)."""

    cp_group = None
    cp_auto_choices: dict

    def cp_group_for(self, packed_seq_params):
        """The CP group of a forward (:func:`forward_cp_group` with the layer's group as default)."""
        return forward_cp_group(packed_seq_params, self.cp_group)

    def cp_auto_choice(self, cp_group):
        """What ``auto`` chose for ``cp_group`` (the group object a forward used, see :meth:`cp_group_for`), or
        None before the layer's first CP forward on that group. One per group: megatron's hybrid CP hands
        micro-batches CP groups of several sizes, and a choice for one size may not be valid on another."""
        return self.cp_auto_choices.get(cp_group)
