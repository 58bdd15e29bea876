"""Selective recompute of a cheap part of a mixer: its output is dropped after its consumer ran and recomputed
from the part's inputs in backward (megatron-core's ``CheckpointWithoutOutput`` scheme, which needs CUDA for its
RNG bookkeeping; our parts draw no random numbers, so none is kept).

Use: ``part = PartRecompute(); y = part.run(fn, *tensors)``; once every op that keeps ``y`` for backward has run,
``part.discard(z)`` with ``z`` a tensor downstream of them: ``y``'s storage is freed (views of it that later ops
saved keep their metadata) and refilled when ``z``'s gradient arrives, before any of those ops' backward.
Gradients equal the plain part's: the same ``fn`` runs on the same inputs. The refill moves no bytes: the freed
storage takes over the recomputed output's memory (``UntypedStorage._swap_data_ptr_``, the pointer swap PyTorch's
CUDA-graph trees and FSDP use after ``resize_(0)``); for the part's own backward, whose graph may have saved that
output (FLA's ``l2norm`` saves it), the memory is handed back to it and then returned to the kept tensors. A torch
without the swap copies the bytes instead (one copy kernel per output storage).

``recomputes(config, name)``: whether ``--recompute-granularity selective --recompute-modules`` names our
part ``name`` (one of ``layers.base.choices.RECOMPUTE_MODULES``, held in the config field ``hp_recompute_modules``).
"""
from __future__ import annotations

import torch

from layers.base.choices import RECOMPUTE_MODULES


def recomputes(config, name: str) -> bool:
    """True when ``config`` asks for selective recompute of our part ``name``."""
    if name not in RECOMPUTE_MODULES:
        raise ValueError(f"unknown recompute module {name!r}; ours are {RECOMPUTE_MODULES}")
    return (getattr(config, "recompute_granularity", None) == "selective"
            and name in (getattr(config, "hp_recompute_modules", None) or ()))


class _RunWithoutGraph(torch.autograd.Function):
    """Runs ``part.fn(*inputs)`` without building its graph; backward backpropagates through the recomputed one."""

    @staticmethod
    def forward(ctx, part, *inputs):
        with torch.no_grad():
            out = part.fn(*inputs)
        ctx.save_for_backward(*inputs)
        ctx.part = part
        part.ctx = ctx
        return out

    @staticmethod
    def backward(ctx, *grads):
        if ctx.part.recomputed is None:   # discard() was not called: the output is still there
            ctx.part._recompute(None)
        part = ctx.part
        inputs, outputs = part.recomputed
        part.recomputed = None
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        _swap(part.lent)   # the memory back to the recomputed outputs, which their graph may have saved
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        _swap(part.lent)   # and to the kept tensors again, as a copy would have left them
        part.lent = ()
        return (None,) + tuple(t.grad if t.requires_grad else None for t in inputs)


_SWAPS = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def _swap(pairs) -> None:
    for kept, new in pairs:
        kept._swap_data_ptr_(new)


def _refill(kept_outputs, new_outputs) -> tuple:
    """Give each freed output storage the recomputed output's memory; returns the swapped ``(kept, new)`` storage
    pairs (empty when bytes were copied). Outputs sharing a storage are refilled once."""
    pairs, done = [], {}   # kept storage -> recomputed storage (one to one)
    for kept, new in zip(kept_outputs, new_outputs):
        kept_storage, new_storage = kept.untyped_storage(), new.untyped_storage()
        key, value = kept_storage._cdata, new_storage._cdata
        if ((kept.shape, kept.stride(), kept.storage_offset()) != (new.shape, new.stride(), new.storage_offset())
                or done.get(key, value) != value or (key not in done and value in done.values())):
            raise RuntimeError(f"recompute: the part's output changed layout between forward and recompute: "
                               f"{tuple(kept.shape)} / {kept.stride()} at {kept.storage_offset()} vs "
                               f"{tuple(new.shape)} / {new.stride()} at {new.storage_offset()}, or shares its "
                               "storage with other outputs differently")
        if key in done:
            continue
        done[key] = value
        if _SWAPS:
            kept_storage._swap_data_ptr_(new_storage)
            pairs.append((kept_storage, new_storage))
        else:
            kept_storage.resize_(new_storage.size())
            kept_storage.copy_(new_storage)
    return tuple(pairs)


class PartRecompute:
    """One use of a recomputed part (a fresh object per forward)."""

    def __init__(self):
        self.fn, self.ctx, self.output, self.recomputed = None, None, None, None
        self.discarded, self.lent = False, ()

    def run(self, fn, *inputs: torch.Tensor):
        """``fn(*inputs)`` (a tensor or a tuple of tensors) with the graph of ``fn`` left out; inputs are kept for
        backward."""
        self.fn = fn
        out = _RunWithoutGraph.apply(self, *inputs)
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
        inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in self.ctx.saved_tensors)
        with torch.enable_grad():
            out = self.fn(*inputs)
        out = out if isinstance(out, tuple) else (out,)
        if self.discarded:   # else the outputs were never freed (no discard): they hold these values already
            with torch.no_grad():
                self.lent = _refill(self.output, out)
        self.recomputed, self.ctx, self.output, self.fn = (inputs, out), None, None, None
