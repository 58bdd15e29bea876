"""Single-process rows: GDN / KDA forward and backward (dense and packed), the short conv (dense and packed with
history), and the decode steps, each against the eager backend on the same device; DSA's eager sparse path in the
checked dtype against fp32 (``hp_megatron.selfcheck.dsa``)."""
from __future__ import annotations

import torch

from hp_megatron.selfcheck.problems import (CONV, CONV_STEP_TOKENS, CONV_WIDTH, DECODE, KINDS, SINGLE, conv_inputs,
                                            cotangents, delta_inputs, head_dims, to_device)
from hp_megatron.selfcheck.report import Row, error_rows, na_row, rel_err
from layers.ops import causal_conv1d, causal_conv1d_step, delta_rule_step
from layers.ops.delta_rule import chunk_op
from layers.ops.kinds import delta_kind


def _delta_run(kind, backend, leaves, flags, cu, do, dS, grad):
    """Outputs and gradients; ``dS`` None: the final state gets no cotangent."""
    o, S = chunk_op(kind)(**leaves, **flags, cu_seqlens=cu, output_final_state=True, backend=backend)
    out = {"o": o.detach(), "final_state": S.detach()}
    if not grad:
        return out, {}
    loss = (o.float() * do).sum() + ((S.float() * dS).sum() if dS is not None else 0.0)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return out, {f"d{n}": g for n, g in zip(leaves, grads)}


def delta_rows(backend, device, dtype, case, limits):
    """fwd and bwd rows of one GDN / KDA case."""
    op = delta_kind(case.kind).op
    no_bwd = limits.backward.get(case.kind)
    restricted = limits.state_grad.get(case.kind)   # no initial state / final-state gradient, safe gate only
    if no_bwd is None and restricted and (case.initial_state or case.lower_bound is None):
        no_bwd = restricted
    K, V = head_dims(backend)
    try:
        tensors, flags = delta_inputs(case, K, V, dtype)
        cu = None if case.cu_seqlens is None else torch.tensor(case.cu_seqlens, dtype=torch.int64)
        do, dS = (x.to(device) for x in cotangents((case.B, case.T, case.HV, V), (case.N, case.HV, K, V), case.seed))
        dS = None if restricted else dS
        grad = no_bwd is None
        with torch.set_grad_enabled(grad):
            got = _delta_run(case.kind, backend, to_device(tensors, device, dtype, grad), flags, cu, do, dS, grad)
            ref = _delta_run(case.kind, "eager", to_device(tensors, device, torch.float32, grad), flags, cu, do, dS,
                             grad)
    except Exception as error:  # noqa: BLE001 - a row per failure, the check goes on
        return error_rows(op, case.name, ("fwd", "bwd"), dtype, error)
    rows = [Row(op, case.name, "fwd", dtype, {n: rel_err(got[0][n], ref[0][n]) for n in ref[0]}).judge()]
    if no_bwd is not None:
        rows.append(na_row(op, case.name, "bwd", dtype, no_bwd))
    else:
        rows.append(Row(op, case.name, "bwd", dtype, {n: rel_err(got[1][n], ref[1][n]) for n in ref[1]}).judge())
    return rows


def conv_rows(backend, device, dtype, name, B, T, cu, with_history_bias):
    op = "causal_conv1d"
    try:
        N = B if cu is None else len(cu) - 1
        tensors = conv_inputs(B, T, N, with_history_bias, dtype)
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64)
        dy = torch.randn(B, T, tensors["x"].shape[-1], generator=torch.Generator().manual_seed(8)).to(device)
        results = []
        for run_backend, run_dtype in ((backend, dtype), ("eager", torch.float32)):
            leaves = to_device(tensors, device, run_dtype, True)
            y = causal_conv1d(leaves["x"], leaves["weight"], bias=leaves.get("bias"), activation="silu",
                              cu_seqlens=cu_t, history=leaves.get("history"), backend=run_backend)
            grads = torch.autograd.grad((y.float() * dy).sum(), list(leaves.values()))
            results.append((y.detach(), {f"d{n}": g for n, g in zip(leaves, grads)}))
    except Exception as error:  # noqa: BLE001
        return error_rows(op, name, ("fwd", "bwd"), dtype, error)
    (y, g), (y_ref, g_ref) = results
    return [Row(op, name, "fwd", dtype, {"y": rel_err(y, y_ref)}).judge(),
            Row(op, name, "bwd", dtype, {n: rel_err(g[n], g_ref[n]) for n in g_ref}).judge()]


def decode_name(kind):
    case = DECODE[kind]
    return f"{kind} N={case.N} {case.T} tokens in-kernel{' lb=-5' if case.lower_bound else ''}"


CONV_STEP_NAME = f"N=2 {CONV_STEP_TOKENS} tokens bias silu"


def decode_rows(backend, device, dtype, kind, limits):
    """T tokens of ``delta_rule_step`` from a random cached state: outputs and the state after them."""
    case, op, name = DECODE[kind], "delta_rule_step", decode_name(kind)
    if limits.decode.get(kind):
        return [na_row(op, name, "step", dtype, limits.decode[kind])]
    K, V = head_dims(backend)
    try:
        tensors, flags = delta_inputs(case, K, V, dtype)
        state0 = tensors.pop("initial_state")
        outs = []
        with torch.no_grad():
            for run_backend, run_dtype in ((backend, dtype), ("eager", torch.float32)):
                x = to_device(tensors, device, run_dtype, False)
                state = state0.to(device).clone()
                o = [delta_rule_step(kind, *(x[n][:, t:t + 1] for n in ("q", "k", "v", "g", "beta")), state,
                                     A_log=x.get("A_log"), dt_bias=x.get("dt_bias"), **flags, backend=run_backend)
                     for t in range(case.T)]
                outs.append((torch.cat(o, 1), state))
    except Exception as error:  # noqa: BLE001
        return error_rows(op, name, ("step",), dtype, error)
    (o, S), (o_ref, S_ref) = outs
    return [Row(op, name, "step", dtype, {"o": rel_err(o, o_ref), "state": rel_err(S, S_ref)}).judge()]


def conv_step_rows(backend, device, dtype, limits):
    op, name, N = "causal_conv1d_step", CONV_STEP_NAME, 2
    if limits.decode.get("conv"):
        return [na_row(op, name, "step", dtype, limits.decode["conv"])]
    try:
        gen = torch.Generator().manual_seed(9)
        D, W = 64, CONV_WIDTH
        x = torch.randn(N, CONV_STEP_TOKENS, D, generator=gen).to(dtype)
        history0 = torch.randn(N, W - 1, D, generator=gen).to(dtype)
        weight, bias = torch.randn(D, W, generator=gen) / W, torch.randn(D, generator=gen)
        outs = []
        with torch.no_grad():
            for run_backend, run_dtype in ((backend, dtype), ("eager", torch.float32)):
                history = history0.to(device, run_dtype).clone()
                xs = x.to(device, run_dtype)
                y = [causal_conv1d_step(xs[:, t:t + 1], history, weight.to(device), bias=bias.to(device),
                                        activation="silu", backend=run_backend) for t in range(CONV_STEP_TOKENS)]
                outs.append((torch.cat(y, 1), history))
    except Exception as error:  # noqa: BLE001
        return error_rows(op, name, ("step",), dtype, error)
    (y, h), (y_ref, h_ref) = outs
    return [Row(op, name, "step", dtype, {"y": rel_err(y, y_ref), "history": rel_err(h, h_ref)}).judge()]


def single_rows(backend, device, dtype, limits, wanted=lambda op, case: True):
    """Every single-process row (those ``wanted(op, case)`` selects), in table order."""
    rows = []
    for case in SINGLE:
        if wanted(delta_kind(case.kind).op, case.name):
            rows += delta_rows(backend, device, dtype, case, limits)
    for name, B, T, cu, with_history_bias in CONV:
        if wanted("causal_conv1d", name):
            rows += conv_rows(backend, device, dtype, name, B, T, cu, with_history_bias)
    for kind in KINDS:
        if wanted("delta_rule_step", decode_name(kind)):
            rows += decode_rows(backend, device, dtype, kind, limits)
    if wanted("causal_conv1d_step", CONV_STEP_NAME):
        rows += conv_step_rows(backend, device, dtype, limits)
    from hp_megatron.selfcheck.dsa import CASE as DSA_CASE, OP as DSA_OP, dsa_rows   # eager on every backend

    if wanted(DSA_OP, DSA_CASE):
        rows += dsa_rows(device, dtype)
    return rows
