"""Collectives for context parallelism over ``torch.distributed`` (any backend: gloo, NCCL, HCCL).

Two layers:

* raw functions (``*_raw``, ``exchange``): no autograd, optional ``async_op`` returning the work handle;
* differentiable functions built on them (``all_gather``, ``all_to_all``, ``send_recv``) whose backward is the
  adjoint collective, plus ``all_to_all_start``, which launches the forward all-to-all asynchronously and returns
  a ``Pending`` whose ``wait()`` yields the (differentiable) result, so local work can overlap it.

Conventions: ``group`` is a process group or None (= WORLD); ranks in arguments are ranks *inside the group*.
Stacked tensors have the group dimension first: ``all_gather(x)`` returns ``[P, *x.shape]`` with entry i from
group rank i; ``all_to_all(x)`` takes ``[P, ...]`` whose entry i goes to group rank i and returns ``[P, ...]``
whose entry i came from group rank i.

Byte accounting (into ``stats``, a ``CommStats`` or None), per rank, counting only data that leaves or enters
the rank (algorithm-independent lower bounds of the collective):
all_gather of n bytes: sent = received = (P-1) n; reduce_scatter of a [P, ...] tensor of n bytes:
sent = received = (P-1) n / P; all_to_all of n bytes: sent = received = (P-1) n / P; point-to-point: the
bytes of every message to / from another rank (messages to self are local copies and are not counted).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from layers.cp.accounting import current_phase

# torch >= 2.13 names the single-tensor collectives *_single; older releases *_into_tensor / *_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# -- group helpers ------------------------------------------------------------------------------------------
def group_size(group=None) -> int:
    return dist.get_world_size(group)


def group_rank(group=None) -> int:
    return dist.get_rank(group)


def global_rank(group, rank: int) -> int:
    """Global rank of ``rank`` inside ``group`` (None = WORLD)."""
    if group is None or group is dist.GroupMember.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def broadcast_from_rank0(fn, group):
    """``fn()`` evaluated on group rank 0 and broadcast to every rank (``broadcast_object_list``; collective). An
    exception on rank 0 is broadcast too and re-raised on every rank, so no rank is left waiting."""
    box = [None]
    if group_rank(group) == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as err:   # noqa: BLE001 (re-raised below on every rank)
            box[0] = ("error", err)
    dist.broadcast_object_list(box, src=global_rank(group, 0), group=group)
    status, value = box[0]
    if status == "error":
        raise value
    return value


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _account(stats, name, sent, received, messages=1):
    if stats is not None and stats.enabled:
        stats.add(name, sent, received, messages, phase=current_phase())


# -- raw collectives ----------------------------------------------------------------------------------------
def all_gather_raw(x: torch.Tensor, group=None, stats=None, async_op: bool = False):
    """[P, *x.shape] stacked copies of ``x`` from every group rank (tuple ``(out, work)`` if async)."""
    P = group_size(group)
    x = x.contiguous()
    out = torch.empty((P,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    _account(stats, "all_gather", (P - 1) * _nbytes(x), (P - 1) * _nbytes(x), messages=P - 1)
    if P == 1:
        out[0].copy_(x)
        return (out, None) if async_op else out
    work = _all_gather_single(out.view(-1), x.view(-1), group=group, async_op=async_op)
    return (out, work) if async_op else out


def reduce_scatter_raw(x: torch.Tensor, group=None, stats=None, async_op: bool = False):
    """Sum over ranks of ``x[i]`` delivered to group rank i; ``x`` is ``[P, ...]``; returns ``x.shape[1:]``."""
    P = group_size(group)
    if x.shape[0] != P:
        raise ValueError(f"reduce_scatter input must have the group size P={P} as dim 0, got {tuple(x.shape)}")
    x = x.contiguous()
    out = torch.empty(tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    share = _nbytes(x) // P
    _account(stats, "reduce_scatter", (P - 1) * share, (P - 1) * share, messages=P - 1)
    if P == 1:
        out.copy_(x[0])
        return (out, None) if async_op else out
    work = _reduce_scatter_single(out.view(-1), x.view(-1), group=group, async_op=async_op)
    return (out, work) if async_op else out


def all_to_all_raw(x: torch.Tensor, group=None, stats=None, async_op: bool = False):
    """``x`` [P, ...]: entry i goes to group rank i; returns [P, ...] with entry i from group rank i."""
    P = group_size(group)
    if x.shape[0] != P:
        raise ValueError(f"all_to_all input must have the group size P={P} as dim 0, got {tuple(x.shape)}")
    x = x.contiguous()
    out = torch.empty_like(x)
    share = _nbytes(x) // P
    _account(stats, "all_to_all", (P - 1) * share, (P - 1) * share, messages=P - 1)
    if P == 1:
        out.copy_(x)
        return (out, None) if async_op else out
    work = dist.all_to_all_single(out.view(-1), x.view(-1), group=group, async_op=async_op)
    return (out, work) if async_op else out


def exchange(sends, recvs, group=None, stats=None, async_op: bool = False, name: str = "p2p"):
    """Point-to-point messages in one batch: ``sends`` = [(tensor, dst)], ``recvs`` = [(buffer, src)].

    Ranks are group ranks. Messages between the same pair are matched in list order (the k-th send to a
    peer meets the k-th receive from this rank there). Messages to self are copied in order. Receive
    buffers are filled in place; returns the list of work handles when ``async_op`` (wait them before
    reading the buffers), else None.
    """
    me = group_rank(group)
    self_sends = [t for t, dst in sends if dst == me]
    self_recvs = [b for b, src in recvs if src == me]
    if len(self_sends) != len(self_recvs):
        raise ValueError(f"exchange: {len(self_sends)} messages to self but {len(self_recvs)} receives from self")
    for t, b in zip(self_sends, self_recvs):
        b.copy_(t)
    ops, sent, received, count = [], 0, 0, {}
    for t, dst in sends:
        if dst == me:
            continue
        tag = count.get(("s", dst), 0)
        count[("s", dst)] = tag + 1
        t = t.contiguous()
        ops.append(dist.P2POp(dist.isend, t, global_rank(group, dst), group, tag))
        sent += _nbytes(t)
    for b, src in recvs:
        if src == me:
            continue
        if not b.is_contiguous():
            raise ValueError("exchange: receive buffers must be contiguous")
        tag = count.get(("r", src), 0)
        count[("r", src)] = tag + 1
        ops.append(dist.P2POp(dist.irecv, b, global_rank(group, src), group, tag))
        received += _nbytes(b)
    _account(stats, name, sent, received, messages=len(ops))
    works = dist.batch_isend_irecv(ops) if ops else []
    if async_op:
        return works
    for w in works:
        w.wait()
    return None


# -- differentiable collectives -----------------------------------------------------------------------------
class _Collective(torch.autograd.Function):
    """A raw collective in forward and its adjoint collective in backward, both accounted in ``stats``.

    Adjoints: all_gather <-> reduce_scatter; all_to_all is its own adjoint (entry i of the output came from
    rank i, so its gradient goes back to rank i). With ``pending`` the forward is launched asynchronously.
    """

    @staticmethod
    def forward(ctx, x, collective, adjoint, group, stats, pending):
        ctx.adjoint, ctx.group, ctx.stats = adjoint, group, stats
        if pending is None:
            return collective(x, group, stats)
        out, pending.work = collective(x, group, stats, async_op=True)
        return out

    @staticmethod
    def backward(ctx, g):
        return ctx.adjoint(g, ctx.group, ctx.stats), None, None, None, None, None


@dataclass
class Pending:
    """An asynchronously launched differentiable collective; ``wait()`` returns its result."""

    work: object = None
    result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.result


def all_gather(x: torch.Tensor, group=None, stats=None) -> torch.Tensor:
    """Differentiable all-gather: ``[P, *x.shape]``; backward reduce-scatters (sums) the gradient to owners."""
    return _Collective.apply(x, all_gather_raw, reduce_scatter_raw, group, stats, None)


def all_to_all(x: torch.Tensor, group=None, stats=None) -> torch.Tensor:
    """Differentiable all-to-all of ``x`` [P, ...] (entry i to rank i); backward is the same all-to-all."""
    return _Collective.apply(x, all_to_all_raw, all_to_all_raw, group, stats, None)


def all_to_all_start(x: torch.Tensor, group=None, stats=None) -> Pending:
    p = Pending()
    p.result = _Collective.apply(x, all_to_all_raw, all_to_all_raw, group, stats, p)
    return p


class _SendRecv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dsts, srcs, recv_shapes, group, stats, dtype, device, anchor, *send_tensors):
        ctx.dsts, ctx.srcs, ctx.group, ctx.stats = dsts, srcs, group, stats
        ctx.recv_meta = (recv_shapes, dtype, device)
        ctx.send_meta = [(t.shape, t.dtype, t.device) for t in send_tensors]
        bufs = [torch.empty(shape, dtype=dtype, device=device) for shape in recv_shapes]
        exchange(list(zip(send_tensors, dsts)), list(zip(bufs, srcs)), group, stats, name="send_recv")
        anchor_out = anchor.view_as(anchor) if anchor is not None else None
        return (*bufs, anchor_out)

    @staticmethod
    def backward(ctx, *grads):
        # gradients of what we received go back to its sources; we receive the gradients of what we sent.
        recv_shapes, dtype, device = ctx.recv_meta
        g_recv, g_anchor = grads[:-1], grads[-1]
        sends = [(g.contiguous() if g is not None else torch.zeros(shape, dtype=dtype, device=device), src)
                 for g, shape, src in zip(g_recv, recv_shapes, ctx.srcs)]
        bufs = [torch.empty(shape, dtype=dt, device=dev) for shape, dt, dev in ctx.send_meta]
        exchange(sends, list(zip(bufs, ctx.dsts)), ctx.group, ctx.stats, name="send_recv")
        return (None,) * 7 + (g_anchor,) + tuple(bufs)


def send_recv(send_tensors, dsts, recv_shapes, srcs, group=None, stats=None, *, dtype=None, device=None,
              anchor=None):
    """Differentiable point-to-point exchange; returns ``(received, anchor_out)``, received a tuple.

    ``send_tensors[i]`` goes to group rank ``dsts[i]``; ``recv_shapes[j]`` is received from ``srcs[j]`` with
    ``dtype``/``device`` (default: those of the first sent tensor, or of ``anchor``). Every rank must list
    matching messages (same order per peer, as in ``exchange``). Backward sends the gradient of every received
    tensor back to its source (zeros if unused) and returns the gradient of every sent tensor.

    Deadlock rule: backward communicates, so this op's backward must run on every rank that took part.
    A rank whose received tensors may not reach its loss (e.g. it receives nothing) passes its local
    activation as ``anchor`` and continues with ``anchor_out`` (the same tensor, routed through this op).
    """
    if len(send_tensors) != len(dsts) or len(recv_shapes) != len(srcs):
        raise ValueError(f"send_recv: {len(send_tensors)} tensors for {len(dsts)} destinations, "
                         f"{len(recv_shapes)} shapes for {len(srcs)} sources")
    ref = send_tensors[0] if send_tensors else anchor
    if dtype is None or device is None:
        if ref is None:
            raise ValueError("send_recv without tensors to send needs dtype and device (or an anchor)")
        dtype = dtype or ref.dtype
        device = device or ref.device
    out = _SendRecv.apply(tuple(dsts), tuple(srcs), tuple(tuple(s) for s in recv_shapes), group, stats,
                          dtype, torch.device(device), anchor, *send_tensors)
    return tuple(out[:-1]), out[-1]
