"""Run an eager function without keeping its intermediates: save its tensor inputs, recompute it in backward.

The eager ops are chains of PyTorch ops; left to autograd, every op saves its own inputs (the fp32 upcasts,
the chunked WY quantities, the conv's padded stream and pre-activation, each element-wise step of the gated
norm), several times the bytes of the inputs. :func:`recompute` keeps only the inputs (``save_for_backward``)
and, in backward, runs the same function again with autograd on and differentiates that graph: the gradients
are exactly those of the plain function (same ops, same order, deterministic), at the cost of one more forward
per backward. Only first-order gradients (``torch.autograd.grad`` without ``create_graph``).
"""
from __future__ import annotations

import torch


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, *args):
        ctx.fn = fn
        ctx.slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.args = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.slots))
        with torch.no_grad():
            out = fn(*args)
        single = isinstance(out, torch.Tensor)
        ctx.single = single
        return out if single else tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        args = list(ctx.args)
        saved = ctx.saved_tensors
        wanted = []
        for slot, tensor in zip(ctx.slots, saved):
            leaf = tensor.detach().requires_grad_(ctx.needs_input_grad[slot + 1])
            args[slot] = leaf
            if leaf.requires_grad:
                wanted.append(slot)
        with torch.enable_grad():
            out = ctx.fn(*args)
        outs = (out,) if ctx.single else tuple(out)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        result = [None] * len(args)
        if pairs and wanted:
            found = torch.autograd.grad([o for o, _ in pairs], [args[i] for i in wanted],
                                        [g for _, g in pairs], allow_unused=True)
            for slot, grad in zip(wanted, found):
                result[slot] = grad
        return (None, *result)


def recompute(fn, *args):
    """``fn(*args)`` with only the tensor ``args`` saved for backward (``fn`` returns a tensor or a tuple of
    tensors / None; it must be deterministic). Without grad mode or grad-requiring inputs it is a plain call."""
    if not torch.is_grad_enabled() or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return fn(*args)
    return _Recompute.apply(fn, *args)
