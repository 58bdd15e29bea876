"""Selective recompute of a cheap part of a mixer: its output is dropped after its consumer ran and recomputed
from the part's inputs in backward (megatron-core's ``CheckpointWithoutOutput`` scheme, which needs CUDA for its
RNG bookkeeping; our parts draw no random numbers, so none is kept).

Use: ``part = PartRecompute(); y = part.run(fn, *tensors)``; once every op that keeps ``y`` for backward has run,
``part.discard(z)`` with ``z`` a tensor downstream of them: ``y``'s storage is freed (views of it that later ops
saved keep their metadata) and refilled when ``z``'s gradient arrives, before any of those ops' backward.
Gradients equal the plain part's: the same ``fn`` runs on the same inputs. The refill moves no bytes: the freed
storage takes over the recomputed output's memory (``layers.base.compat.refill_storage``: the storage pointer swap
PyTorch's CUDA-graph trees and FSDP use after ``resize_(0)``); for the part's own backward, whose graph may have
saved that output (FLA's ``l2norm`` saves it), the memory is handed back to it and then returned to the kept
tensors. A torch without the swap copies the bytes instead (one copy kernel per output storage). The autograd
Function is ``layers.ops.eager.recompute``'s, with this part re-running it early.

``recomputes(config, name)``: whether ``--recompute-granularity selective --recompute-modules`` names our
part ``name`` (one of ``layers.base.choices.RECOMPUTE_MODULES``, held in the config field ``hp_recompute_modules``).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from layers.base.choices import RECOMPUTE_MODULES
from layers.base.compat import refill_storage, storage_key, swap_storages
from layers.ops.eager.recompute import rerun, run_without_graph


def recomputes(config, name: str) -> bool:
    """True when ``config`` asks for selective recompute of our part ``name``."""
    if name not in RECOMPUTE_MODULES:
        raise ValueError(f"unknown recompute module {name!r}; ours are {RECOMPUTE_MODULES}")
    return (getattr(config, "recompute_granularity", None) == "selective"
            and name in (getattr(config, "hp_recompute_modules", None) or ()))


def _refill(kept_outputs, new_outputs) -> tuple:
    """Give each freed output storage the recomputed output's memory (``layers.base.compat.refill_storage``);
    returns the swapped ``(kept, new)`` storage pairs (empty when bytes were copied). Outputs sharing a storage are
    refilled once."""
    pairs, done = [], {}   # kept storage -> recomputed storage (one to one)
    for kept, new in zip(kept_outputs, new_outputs):
        kept_storage, new_storage = kept.untyped_storage(), new.untyped_storage()
        key, value = storage_key(kept_storage), storage_key(new_storage)
        if ((kept.shape, kept.stride(), kept.storage_offset()) != (new.shape, new.stride(), new.storage_offset())
                or done.get(key, value) != value or (key not in done and value in done.values())):
            raise RuntimeError(f"recompute: the part's output changed layout between forward and recompute: "
                               f"{tuple(kept.shape)} / {kept.stride()} at {kept.storage_offset()} vs "
                               f"{tuple(new.shape)} / {new.stride()} at {new.storage_offset()}, or shares its "
                               "storage with other outputs differently")
        if key in done:
            continue
        done[key] = value
        if refill_storage(kept_storage, new_storage):
            pairs.append((kept_storage, new_storage))
    return tuple(pairs)


class PartRecompute:
    """One use of a recomputed part (a fresh object per forward); the ``early`` of
    ``layers.ops.eager.recompute.run_without_graph``."""

    def __init__(self):
        self.ctx, self.output, self.recomputed_pair = None, None, None
        self.discarded, self.lent = False, ()

    def run(self, fn, *inputs: torch.Tensor):
        """``fn(*inputs)`` (a tensor or a tuple of tensors) with the graph of ``fn`` left out; inputs are kept for
        backward."""
        out = run_without_graph(fn, inputs, early=self)
        self.output = out if isinstance(out, tuple) else (out,)
        return out

    def discard(self, hook_tensor: torch.Tensor) -> None:
        """Free the output's storage now; refill it when ``hook_tensor``'s gradient is computed."""
        if not hook_tensor.requires_grad:
            return   # no backward will run (evaluation): nothing to discard or recompute
        for t in self.output:
            t.untyped_storage().resize_(0)
        self.discarded = True
        hook_tensor.register_hook(self._recompute)

    def _recompute(self, _grad):
        if self.ctx is None:
            return
        args, out = rerun(self.ctx)
        if self.discarded:   # else the outputs were never freed (no discard): they hold these values already
            with torch.no_grad():
                self.lent = _refill(self.output, out)
        self.recomputed_pair, self.ctx, self.output = (args, out), None, None

    def recomputed(self, ctx) -> tuple:
        """``(args, outputs)`` of the recompute (run now if :meth:`discard` was not called)."""
        if self.recomputed_pair is None:   # discard() was not called: the output is still there
            self._recompute(None)
        pair, self.recomputed_pair = self.recomputed_pair, None
        return pair

    @contextmanager
    def lending(self):
        """The part's own backward: the memory back to the recomputed outputs, which their graph may have saved,
        then to the kept tensors again, as a copy would have left them."""
        _swap(self.lent)
        try:
            yield
        finally:
            _swap(self.lent)
            self.lent = ()


def _swap(pairs) -> None:
    for kept, new in pairs:
        swap_storages(kept, new)
