"""gloo ranks for the CP checks: FLA's stacked all-gather output, and device tensors staged through host memory.

Two process-wide patches of ``torch.distributed`` (idempotent), used by the self-check's CP ranks on gloo and by the
CP tests (tests/support/triton_cases.py, tests/backends/test_backend_triton.py):

- :func:`accept_stacked_all_gather_on_gloo`: FLA's KCP all-gathers into an output stacked ``[P, *input.shape]``,
  which NCCL accepts and gloo refuses (it wants ``[P * input.shape[0], ...]``); the output is passed as that flat
  view (same memory).
- :func:`install_gloo_device_staging`: several ranks on ONE accelerator cannot use NCCL / HCCL (they refuse two
  ranks on one device), and gloo moves only CPU tensors, so the collectives the CP engine uses copy device tensors
  to the host and back (synchronously). Modules of ``layers`` that bound one of these functions at import are
  rebound too. This checks the CP math on the device's kernels, not the device's collectives.
"""
from __future__ import annotations

import sys
import types

import torch.distributed as dist

STAGED = ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
          "all_to_all_single", "batch_isend_irecv")


def accept_stacked_all_gather_on_gloo():
    """Let ``dist.all_gather_into_tensor`` take a stacked ``[P, *input.shape]`` output on gloo (see module doc)."""
    original = dist.all_gather_into_tensor
    if getattr(original, "accepts_stacked", False):
        return

    def all_gather_into_tensor(output, input, *args, **kwargs):
        if output.dim() == input.dim() + 1 and input.dim() > 0 and output.is_contiguous():
            output = output.view(-1, *input.shape[1:])
        return original(output, input, *args, **kwargs)

    all_gather_into_tensor.accepts_stacked = True
    dist.all_gather_into_tensor = all_gather_into_tensor


class _Done:
    """Work handle of a collective that already completed (the staged copies are synchronous)."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


def _on_device(t) -> bool:
    return t.device.type != "cpu"


def _stage_through_host(fn):
    """Wrap ``fn(output, input, ...)``: device tensors go through host copies."""
    def staged(output, input, *args, async_op=False, **kwargs):
        if not (_on_device(output) or _on_device(input)):
            return fn(output, input, *args, async_op=async_op, **kwargs)
        host = output.detach().cpu()
        fn(host, input.detach().cpu(), *args, async_op=False, **kwargs)
        output.copy_(host)
        return _Done() if async_op else None
    staged.staged = True
    return staged


def _staged_batch_isend_irecv(original):
    def staged(ops):
        if not any(_on_device(op.tensor) for op in ops):
            return original(ops)
        host_ops, copies = [], []
        for op in ops:
            buf = op.tensor.detach().cpu()
            if op.op is dist.irecv:
                copies.append((op.tensor, buf))
            host_ops.append(dist.P2POp(op.op, buf, op.peer, op.group, op.tag))
        for work in original(host_ops):
            work.wait()
        for target, buf in copies:
            target.copy_(buf)
        return [_Done()]
    staged.staged = True
    return staged


def install_gloo_device_staging():
    """Stage the CP engine's collectives of device tensors through host memory (see module doc)."""
    staged = {}
    for name in STAGED:
        original = getattr(dist, name, None)
        if original is None or getattr(original, "staged", False):
            continue
        wrap = _staged_batch_isend_irecv if name == "batch_isend_irecv" else _stage_through_host
        staged[original] = wrap(original)
        setattr(dist, name, staged[original])
    for module_name, module in list(sys.modules.items()):
        if module_name == "layers" or module_name.startswith("layers."):
            for attr, value in list(vars(module).items()):
                if isinstance(value, types.FunctionType) and value in staged:
                    setattr(module, attr, staged[value])
