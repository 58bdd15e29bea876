"""Run a function without keeping its intermediates: save its tensor inputs, recompute it in backward.

The eager ops are chains of PyTorch ops; left to autograd, every op saves its own inputs (the fp32 upcasts,
the chunked WY quantities, the conv's padded stream and pre-activation, each element-wise step of the gated
norm), several times the bytes of the inputs. :func:`recompute` keeps only the inputs (``save_for_backward``)
and, in backward, runs the same function again with autograd on and differentiates that graph: the gradients
are exactly those of the plain function (same ops, same order, deterministic), at the cost of one more forward
per backward. Only first-order gradients.

The one autograd Function of the package: ``layers.shared.recompute.PartRecompute`` (a mixer part whose output
is also freed) runs through :func:`run_without_graph` with an ``early`` object that re-runs the function before
this Function's backward (see :class:`_Recompute`).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch


def rerun(ctx) -> tuple:
    """``(args, outputs)`` of ``ctx.fn`` run again with autograd on: the saved tensors as fresh leaves (requiring
    grad where the Function's input did) in ``args``, the outputs as a tuple."""
    args = list(ctx.args)
    for slot, tensor in zip(ctx.slots, ctx.saved_tensors):
        args[slot] = tensor.detach().requires_grad_(ctx.needs_input_grad[slot + 2])
    with torch.enable_grad():
        out = ctx.fn(*args)
    return args, ((out,) if isinstance(out, torch.Tensor) else tuple(out))


class _Recompute(torch.autograd.Function):
    """``fn(*args)`` under ``no_grad`` with only the tensor ``args`` saved; backward differentiates ``fn`` run
    again on them (:func:`rerun`).

    ``early`` (None or an object with ``ctx``, ``recomputed(ctx)`` and ``lending()``): it gets the ``ctx`` and may
    re-run ``fn`` before this backward; ``recomputed(ctx)`` then returns that ``(args, outputs)``, and the gradient
    flows through them inside ``lending()``, into every leaf ``fn`` reaches (parameters it reads included). Without
    ``early`` only the tensor ``args`` get gradients.
    """

    @staticmethod
    def forward(ctx, fn, early, *args):
        ctx.fn, ctx.early = fn, early
        ctx.slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.args = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.slots))
        with torch.no_grad():
            out = fn(*args)
        if early is not None:
            early.ctx = ctx
        return out if isinstance(out, torch.Tensor) else tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        early = ctx.early
        args, outs = rerun(ctx) if early is None else early.recomputed(ctx)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        leaves = [args[i] for i in ctx.slots if args[i].requires_grad]
        if pairs and (leaves or early is not None):
            with nullcontext() if early is None else early.lending():
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs],
                                        inputs=leaves if early is None else None)
        return (None, None, *(a.grad if i in ctx.slots and a.requires_grad else None for i, a in enumerate(args)))


def run_without_graph(fn, args, early=None):
    """``fn(*args)`` through :class:`_Recompute` (always, even without grad-requiring inputs)."""
    return _Recompute.apply(fn, early, *args)


def recompute(fn, *args):
    """``fn(*args)`` with only the tensor ``args`` saved for backward (``fn`` returns a tensor or a tuple of
    tensors / None; it must be deterministic). Without grad mode or grad-requiring inputs it is a plain call."""
    if not torch.is_grad_enabled() or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return fn(*args)
    return run_without_graph(fn, args)
