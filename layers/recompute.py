"""Selective recompute of a cheap part of a mixer: its output is dropped after its consumer ran and recomputed
from the part's inputs in backward (megatron-core's ``CheckpointWithoutOutput`` scheme, which needs CUDA for its
RNG bookkeeping; our parts draw no random numbers, so none is kept).

Use: ``part = PartRecompute(); y = part.run(fn, *tensors)``; once every op that keeps ``y`` for backward has run,
``part.discard(z)`` with ``z`` a tensor downstream of them: ``y``'s storage is freed (views of it that later ops
saved keep their metadata) and refilled when ``z``'s gradient arrives, before any of those ops' backward.
Gradients equal the plain part's: the same ``fn`` runs on the same inputs.

``recomputes(config, name)``: whether ``--recompute-granularity selective --recompute-modules`` names our
part ``name`` (one of ``layers.choices.RECOMPUTE_MODULES``, held in the config field ``hp_recompute_modules``).
"""
from __future__ import annotations

import torch

from layers.choices import RECOMPUTE_MODULES


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
        inputs, outputs = ctx.part.recomputed
        ctx.part.recomputed = None
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None,) + tuple(t.grad if t.requires_grad else None for t in inputs)


class PartRecompute:
    """One use of a recomputed part (a fresh object per forward)."""

    def __init__(self):
        self.fn, self.ctx, self.output, self.recomputed = None, None, None, None

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
        hook_tensor.register_hook(self._recompute)

    def _recompute(self, _grad):
        if self.ctx is None:
            return
        inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in self.ctx.saved_tensors)
        with torch.enable_grad():
            out = self.fn(*inputs)
        out = out if isinstance(out, tuple) else (out,)
        with torch.no_grad():
            for kept, new in zip(self.output, out):
                kept.untyped_storage().resize_(new.untyped_storage().size())
                kept.untyped_storage().copy_(new.untyped_storage())
        self.recomputed, self.ctx, self.output, self.fn = (inputs, out), None, None, None
