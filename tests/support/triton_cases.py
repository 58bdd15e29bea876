"""Cases shared by the triton-backend tests on a GPU (tests/backends/test_backend_triton.py) and on CPU through Triton's
interpreter (tests/backends/test_backend_triton_interpreter.py): a backend run against the eager op on fp32 copies
of the same values, single rank and under every CP method. Importing this module does not import FLA.

A layout is ``(name, layout, B, T, global cu_seqlens or None)``; a problem is ``make_problem`` keywords.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from layers.ops import causal_conv1d, chunk_gated_delta_rule, chunk_kda
from tests.support.reference import make_problem, rel_err

OPS = {"gdn": chunk_gated_delta_rule, "kda": chunk_kda}


def to_leaves(tensors, device, dtype):
    """Leaf copies on ``device``: q/k/v/g/beta in ``dtype``, states and gate parameters in fp32."""
    out = {}
    for name, x in tensors.items():
        target = torch.float32 if name in ("initial_state", "A_log", "dt_bias") else dtype
        out[name] = x.detach().to(device=device, dtype=target).requires_grad_()
    return out


def _run(kind, backend, tensors, flags, do, dS, **extra):
    """Run an op, backprop ``<o, do> + <S, dS>``; returns (o, S, grads) in fp32 on CPU."""
    o, S = OPS[kind](**tensors, **flags, output_final_state=True, backend=backend, **extra)
    loss = (o.float() * do).sum() + (S.float() * dS).sum()
    names = list(tensors)
    grads = torch.autograd.grad(loss, [tensors[n] for n in names], allow_unused=True)
    return (o.detach().float().cpu(), S.detach().float().cpu(),
            {n: None if g is None else g.float().cpu() for n, g in zip(names, grads)})


def compare_single_rank(kind, problem, device, backend="triton", dtype=torch.bfloat16, safe_gate=False):
    """Relative errors of ``backend`` (``dtype`` inputs) against eager (fp32 copies of the same values):
    output, final state and every input gradient."""
    tensors, flags = make_problem(kind, **problem)
    extra = {"safe_gate": safe_gate} if kind == "kda" else {}
    low = to_leaves(tensors, device, dtype)
    ref = {n: x.detach().float().requires_grad_() for n, x in low.items()}
    gen = torch.Generator().manual_seed(7)
    B, T, HV, V = tensors["v"].shape
    N = B if flags.get("cu_seqlens") is None else flags["cu_seqlens"].numel() - 1
    K = tensors["q"].shape[-1]
    do = torch.randn(B, T, HV, V, generator=gen).to(device)
    dS = torch.randn(N, HV, K, V, generator=gen).to(device)
    o, S, grads = _run(kind, backend, low, flags, do, dS, **extra)
    o_ref, S_ref, grads_ref = _run(kind, "eager", ref, flags, do, dS, **extra)
    errs = {"o": rel_err(o, o_ref), "final_state": rel_err(S, S_ref)}
    for name in grads:
        errs[f"d{name}"] = rel_err(grads[name], grads_ref[name])
    return errs


def compare_conv_single_rank(B, T, D, cu_seqlens, with_history, with_bias, device, dtype, width=4, seed=3):
    """``causal_conv1d`` (triton, x and history in ``dtype``) against eager on fp32 copies of the same rounded
    values: relative errors of y and of the gradients of x, weight, and bias / history when present."""
    gen = torch.Generator().manual_seed(seed)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    raw = {"x": torch.randn(B, T, D, generator=gen), "weight": torch.randn(D, width, generator=gen) / width}
    if with_bias:
        raw["bias"] = torch.randn(D, generator=gen)
    if with_history:
        raw["history"] = torch.randn(N, width - 1, D, generator=gen)
    dy = torch.randn(B, T, D, generator=gen).to(device)
    low = {n: x.to(device, dtype if n in ("x", "history") else torch.float32) for n, x in raw.items()}
    results = {}
    for backend in ("triton", "eager"):
        leaves = {n: (x if backend == "triton" else x.float()).detach().clone().requires_grad_()
                  for n, x in low.items()}
        y = causal_conv1d(leaves["x"], leaves["weight"], bias=leaves.get("bias"), activation="silu",
                          cu_seqlens=cu_seqlens, history=leaves.get("history"), backend=backend)
        grads = torch.autograd.grad((y.float() * dy).sum(), list(leaves.values()))
        results[backend] = (y.float(), dict(zip(leaves, grads)))
    (y, g), (y_ref, g_ref) = results["triton"], results["eager"]
    return {"y": rel_err(y, y_ref), **{f"d{n}": rel_err(g[n].float(), g_ref[n]) for n in g}}


def _layout(layouts, layout_name):
    return next(c for c in layouts if c[0] == layout_name)


def _global_problem(kind, layouts, layout_name, problem, seed):
    _, layout, B, T, cu = _layout(layouts, layout_name)
    problem = dict(problem, B=B, T=T, cu_seqlens=cu, seed=seed)
    if kind == "kda":
        problem["lower_bound"] = -5.0
    tensors, flags = make_problem(kind, **problem)
    flags.pop("cu_seqlens", None)
    return layout, tensors, flags, (None if cu is None else torch.tensor(cu, dtype=torch.int64))


def _allreduce_cpu(x):
    x = x.detach().float().cpu().contiguous()
    dist.all_reduce(x)
    return x


def cp_case(kind, layouts, layout_name, problem, method, opts, backend, device, dtype, seed=11, inspect=None):
    """One CP case on every rank: CP(``backend``) vs single-rank eager of the same global problem; returns
    relative errors of the output and of every input gradient (the same on all ranks). ``method``
    "hybrid_ulysses<U>_<state method>" is the state method with ``opts["ulysses_degree"]``. ``inspect(ctx)``, if
    given, returns entries added to the result after the backward (e.g. what the CP context's CommStats
    recorded)."""
    from layers.cp import build_cp_context, shard, unshard

    layout, tensors, flags, cu = _global_problem(kind, layouts, layout_name, problem, seed)
    extra = {"safe_gate": True} if kind == "kda" else {}
    method_name = method.rsplit("_", 1)[1] if method.startswith("hybrid") else method  # hybrid_ulysses2_<state>
    ctx = build_cp_context(None, method=method_name, layout=layout, cu_seqlens=cu, **opts)
    # Reference: the whole problem on this rank, eager fp32 (values rounded to dtype first).
    low = to_leaves(tensors, device, dtype)
    ref = {n: x.detach().float().requires_grad_() for n, x in low.items()}
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(tensors["v"].shape, generator=gen).to(device)
    o_ref, _ = OPS[kind](**ref, **flags, cu_seqlens=cu, backend="eager", **extra)
    ref_grads = torch.autograd.grad((o_ref * do).sum(), list(ref.values()))
    # CP: shard the global leaves (gradients land at this rank's tokens), run, unshard.
    local = {n: (shard(x, ctx, 1) if n in ("q", "k", "v", "g", "beta") else x) for n, x in low.items()}
    o_local, _ = OPS[kind](**local, **flags, cp_context=ctx, backend=backend, **extra)
    loss = (o_local.float() * shard(do, ctx, 1)).sum()
    grads = torch.autograd.grad(loss, list(low.values()))
    o_full = unshard(o_local.detach(), ctx, 1)
    errs = {"o": rel_err(o_full.float().cpu(), o_ref.detach().cpu())}
    for name, g, g_ref in zip(low, grads, ref_grads):
        errs[f"d{name}"] = rel_err(_allreduce_cpu(g), g_ref.cpu())  # each rank holds its tokens' part
    if inspect is not None:
        errs.update(inspect(ctx))
    return errs


def cp_conv_case(layouts, layout_name, method, opts, backend, device, dtype, channels=64, seed=5):
    """Causal conv (width 4, silu) under CP(``backend``) vs single-rank eager: errors of y, dx, dweight."""
    from layers.cp import build_cp_context, shard, unshard

    _, layout, B, T, cu = _layout(layouts, layout_name)
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int64)
    ctx = build_cp_context(None, method=method, layout=layout, cu_seqlens=cu, conv_kernel_size=4, **opts)
    gen = torch.Generator().manual_seed(seed)
    D, W = channels, 4
    x = torch.randn(B, T, D, generator=gen).to(device, dtype).requires_grad_()
    w = (torch.randn(D, W, generator=gen) / W).to(device).requires_grad_()
    dy = torch.randn(B, T, D, generator=gen).to(device)
    x_ref, w_ref = x.detach().float().requires_grad_(), w.detach().clone().requires_grad_()
    y_ref = causal_conv1d(x_ref, w_ref, activation="silu", cu_seqlens=cu, backend="eager")
    gx_ref, gw_ref = torch.autograd.grad((y_ref * dy).sum(), [x_ref, w_ref])
    y_local = causal_conv1d(shard(x, ctx, 1), w, activation="silu", cp_context=ctx, backend=backend)
    gx, gw = torch.autograd.grad((y_local.float() * shard(dy, ctx, 1)).sum(), [x, w])
    y_full = unshard(y_local.detach(), ctx, 1)
    return {"y": rel_err(y_full.float().cpu(), y_ref.detach().cpu()),
            "dx": rel_err(_allreduce_cpu(gx), gx_ref.cpu()), "dweight": rel_err(_allreduce_cpu(gw), gw_ref.cpu())}
