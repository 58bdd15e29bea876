"""CP rows, run on each of the 2 CP ranks: GDN / KDA (forward and backward) under each CP method the backend has,
and the short conv's halo, against the single-rank eager op of the whole problem on the same device.

Every rank builds the same global problem (same seed), shards it (``layers.cp.shard``), runs the op with a
``build_cp_context`` context, and compares the gathered output and the summed gradients with the eager op run on
the whole problem; both ranks compute the same errors. Methods on 2 ranks: p2p, allgather, grouped_allgather_p2p
(group size 2), recursive_doubling and Ulysses; the Ulysses x state hybrids need 4 ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hp_megatron.selfcheck.problems import (CONV_WIDTH, DeltaCase, conv_inputs, cotangents, default_lower_bound,
                                            delta_inputs, head_dims, KINDS, to_device)
from hp_megatron.selfcheck.report import Row, error_rows, na_row, rel_err
from layers.ops import causal_conv1d
from layers.ops.delta_rule import chunk_op
from layers.ops.kinds import delta_kind

WORLD = 2
# name -> (layout, B, T, global cu_seqlens); zigzag documents are multiples of 2P = 4 tokens
LAYOUTS = {"zigzag B=2 T=64": ("zigzag", 2, 64, None),
           "zigzag packed 3 docs T=64": ("zigzag", 1, 64, (0, 16, 48, 64)),
           "contiguous packed 3 docs T=64": ("contiguous", 1, 64, (0, 13, 50, 64)),
           "zigzag B=1 T=64": ("zigzag", 1, 64, None)}
METHODS = (("p2p", {}, "zigzag B=2 T=64"), ("p2p", {}, "zigzag packed 3 docs T=64"),
           ("allgather", {}, "zigzag B=2 T=64"), ("allgather", {}, "contiguous packed 3 docs T=64"),
           ("grouped_allgather_p2p", {"group_size": 2}, "zigzag packed 3 docs T=64"),
           ("recursive_doubling", {}, "zigzag B=1 T=64"), ("ulysses", {}, "contiguous packed 3 docs T=64"))
CONV_LAYOUTS = ("zigzag B=2 T=64", "contiguous packed 3 docs T=64")


def delta_name(method, layout_name):
    return f"CP{WORLD} {method} {layout_name}"


def conv_name(layout_name):
    return f"CP{WORLD} halo {layout_name}"


def plan(wanted) -> list[tuple[str, str, tuple]]:
    """(op, case, phases) of every CP row ``wanted(op, case)`` selects, in table order."""
    rows = [(delta_kind(kind).op, delta_name(method, lay), ("fwd", "bwd")) for kind in KINDS
            for method, _, lay in METHODS]
    rows += [("causal_conv1d", conv_name(lay), ("fwd", "bwd")) for lay in CONV_LAYOUTS]
    return [r for r in rows if wanted(r[0], r[1])]


def _summed(x):
    """Sum over ranks (gloo reduces host tensors; NCCL / HCCL device tensors)."""
    x = x.detach().float().contiguous()
    if dist.get_backend() == "gloo":
        x = x.cpu()
    dist.all_reduce(x)
    return x


def delta_rows(backend, device, dtype, kind, method, opts, layout_name, limits):
    from layers.cp import build_cp_context, shard, unshard

    op, name = delta_kind(kind).op, delta_name(method, layout_name)
    reason = limits.cp_methods.get(method) or (None if method == "ulysses" else limits.state_cp.get(kind))
    if reason:
        return [na_row(op, name, phase, dtype, reason) for phase in ("fwd", "bwd")]
    no_bwd = limits.backward.get(kind) or (None if method == "ulysses" else limits.state_cp_backward.get(kind))
    grad = no_bwd is None
    layout, B, T, cu = LAYOUTS[layout_name]
    K, V = head_dims(backend)
    case = DeltaCase(kind, B=B, T=T, H=2, HV=2, cu_seqlens=cu, lower_bound=default_lower_bound(kind),
                     initial_state=False, seed=11)
    try:
        tensors, flags = delta_inputs(case, K, V, dtype)
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64)
        ctx = build_cp_context(None, method=method, layout=layout, cu_seqlens=cu_t, **opts)
        do = cotangents((B, T, 2, V), (1,), 11)[0].to(device)
        with torch.set_grad_enabled(grad):
            ref = to_device(tensors, device, torch.float32, grad)
            o_ref, _ = chunk_op(kind)(**ref, **flags, cu_seqlens=cu_t, backend="eager")
            ref_grads = torch.autograd.grad((o_ref * do).sum(), list(ref.values())) if grad else ()
            leaves = to_device(tensors, device, dtype, grad)
            local = {n: (shard(x, ctx, 1) if n in ("q", "k", "v", "g", "beta") else x) for n, x in leaves.items()}
            o_local, _ = chunk_op(kind)(**local, **flags, cp_context=ctx, backend=backend)
            grads = (torch.autograd.grad((o_local.float() * shard(do, ctx, 1)).sum(), list(leaves.values()))
                     if grad else ())
        rows = [Row(op, name, "fwd", dtype, {"o": rel_err(unshard(o_local.detach(), ctx, 1), o_ref)}).judge()]
        if grad:
            rows.append(Row(op, name, "bwd", dtype, {f"d{n}": rel_err(_summed(g), g_ref)
                                                     for n, g, g_ref in zip(leaves, grads, ref_grads)}).judge())
        else:
            rows.append(na_row(op, name, "bwd", dtype, no_bwd))
        return rows
    except Exception as error:  # noqa: BLE001 - a row per failure; resynchronise the ranks
        _barrier()
        return error_rows(op, name, ("fwd", "bwd"), dtype, error)


def conv_rows(backend, device, dtype, layout_name):
    from layers.cp import build_cp_context, shard, unshard

    op, name = "causal_conv1d", conv_name(layout_name)
    layout, B, T, cu = LAYOUTS[layout_name]
    try:
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64)
        ctx = build_cp_context(None, method="p2p", layout=layout, cu_seqlens=cu_t, conv_kernel_size=CONV_WIDTH)
        tensors = conv_inputs(B, T, B, False, dtype, seed=12)
        dy = torch.randn(tensors["x"].shape, generator=torch.Generator().manual_seed(13)).to(device)
        ref = to_device(tensors, device, torch.float32, True)
        y_ref = causal_conv1d(ref["x"], ref["weight"], activation="silu", cu_seqlens=cu_t, backend="eager")
        ref_grads = torch.autograd.grad((y_ref * dy).sum(), list(ref.values()))
        leaves = to_device(tensors, device, dtype, True)
        y = causal_conv1d(shard(leaves["x"], ctx, 1), leaves["weight"], activation="silu", cp_context=ctx,
                          backend=backend)
        grads = torch.autograd.grad((y.float() * shard(dy, ctx, 1)).sum(), list(leaves.values()))
        return [Row(op, name, "fwd", dtype, {"y": rel_err(unshard(y.detach(), ctx, 1), y_ref)}).judge(),
                Row(op, name, "bwd", dtype, {f"d{n}": rel_err(_summed(g), g_ref)
                                             for n, g, g_ref in zip(leaves, grads, ref_grads)}).judge()]
    except Exception as error:  # noqa: BLE001
        _barrier()
        return error_rows(op, name, ("fwd", "bwd"), dtype, error)


def _barrier():
    try:
        dist.barrier()
    except Exception:  # noqa: BLE001 - the process group's timeout ends a rank left alone
        pass


def cp_rows(backend, device, dtypes, limits, wanted):
    """Every wanted CP row on this rank (all ranks run the same cases in the same order)."""
    rows = []
    for dtype in dtypes:
        for kind in KINDS:
            for method, opts, lay in METHODS:
                if wanted(delta_kind(kind).op, delta_name(method, lay)):
                    rows += delta_rows(backend, device, dtype, kind, method, opts, lay, limits)
        for lay in CONV_LAYOUTS:
            if wanted("causal_conv1d", conv_name(lay)):
                rows += conv_rows(backend, device, dtype, lay)
    return rows
