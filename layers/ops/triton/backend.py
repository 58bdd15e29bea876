"""The triton backend: flash-linear-attention 0.6's fused kernels behind the ``layers.ops`` contract.

Inputs arrive validated by ``layers/ops/delta_rule.py`` / ``layers/ops/conv.py``; this module only maps the
contract onto FLA's public ops (keywords only), moves packed boundaries to the GPU, and converts the conv
history ``[N, W-1, D]`` into FLA's cache layout ``[N, D, W]``. Autograd is FLA's (gradients for q, k, v, g,
beta, A_log, dt_bias, the initial state, conv weight/bias/history). CP on FLA's kernels lives with the CP engine
(``layers/cp/triton.py``, ``layers/cp/triton_engine_exchange.py``); ``delta_rule_final_state`` serves
``layers.ops.summary`` (V+K wide values, K <= 256).
"""
from __future__ import annotations

import sys

import torch

from layers.ops.kinds import delta_kind
from layers.ops.triton.runtime import (check_available, check_inputs, check_tensor_device, device_cu_seqlens,
                                       gdn_backward_blocker, history_to_fla_cache, load_fla)

from layers.ops.triton.step import causal_conv1d_step, delta_rule_step  # decode steps (layers/ops/step.py)

__all__ = ["check_available", "chunk_gated_delta_rule", "chunk_kda", "causal_conv1d", "delta_rule_final_state",
           "history_to_fla_cache", "delta_rule_step", "causal_conv1d_step", "qk_l2norm"]


def check_gdn_backward(*inputs) -> None:
    """RuntimeError before a GDN forward whose backward FLA cannot compute right here (see runtime)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        reason = gdn_backward_blocker(inputs[0].device)
        if reason is not None:
            raise RuntimeError(reason)


def _common(q, k, v, g, beta, initial_state, cu_seqlens):
    check_inputs(q, k, v, g, beta)
    state = None if initial_state is None else initial_state.float()  # FLA KDA asserts fp32; GDN keeps fp32 too
    cu, cu_cpu = device_cu_seqlens(cu_seqlens, q.device)
    return state, cu, cu_cpu


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale, initial_state, output_final_state,
                           use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, use_gate_in_kernel, A_log,
                           dt_bias, cu_seqlens):
    """GDN through ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` -> ``(o [B,T,HV,V], final [N,HV,K,V] fp32)``."""
    fla = load_fla()
    state, cu, cu_cpu = _common(q, k, v, g, beta, initial_state, cu_seqlens)
    check_gdn_backward(q, k, v, g, beta, A_log, dt_bias, initial_state)
    gate = {"use_gate_in_kernel": True, "A_log": A_log, "dt_bias": dt_bias} if use_gate_in_kernel else {}
    return fla.chunk_gated_delta_rule(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, **gate)


def chunk_kda(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
              use_beta_sigmoid_in_kernel, use_gate_in_kernel, A_log, dt_bias, cu_seqlens, lower_bound=None,
              safe_gate=False):
    """KDA through ``fla.ops.kda.chunk_kda`` -> ``(o [B,T,HV,V], final [N,HV,K,V] fp32)``."""
    fla = load_fla()
    state, cu, cu_cpu = _common(q, k, v, g, beta, initial_state, cu_seqlens)
    gate = {"A_log": A_log, "dt_bias": dt_bias} if use_gate_in_kernel else {}
    return fla.chunk_kda(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, safe_gate=safe_gate, lower_bound=lower_bound,
        cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, **gate)


def qk_l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dim, differentiable, in x's dtype, with FLA's ``l2norm``: the
    ``l2norm_fwd`` / ``l2norm_bwd`` kernels FLA's GDN and KDA ops run with ``use_qk_l2norm_in_kernel``, so a q/k
    normalised here and given to the op with that flag off has the values the flag would give (forward bit for bit;
    in backward the op hands over dq/dk cast to x's dtype, a rounding only below fp32). The mixers call it inside
    their ``hp_conv`` recompute part (layers/mixers/delta/mixer.py), so the op keeps the part's freed outputs instead of
    its own normalised copies."""
    check_tensor_device("x", x)
    return load_fla().l2norm(x)


def delta_rule_final_state(kind, k, v, g, beta, *, initial_state, cu_seqlens, safe_gate=False, **kw):
    """Final states only, for the CP engine's segment summaries (FLA always computes o too; it is dropped).

    ``v`` is the engine's ``[v | 0]`` in v's dtype; FLA wants one dtype for k and v (a no-op cast when they
    already agree)."""
    kind = delta_kind(kind)
    extra = {"safe_gate": safe_gate} if kind.lower_bound_gate else {}
    op = kind.backend_op(sys.modules[__name__])   # this module's chunk_gated_delta_rule / chunk_kda
    _, final = op(k, k, v.to(k.dtype), g, beta, scale=1.0, initial_state=initial_state, output_final_state=True,
                  cu_seqlens=cu_seqlens, **extra, **kw)
    return final


def causal_conv1d(x, weight, *, bias, activation, cu_seqlens, history):
    """Depthwise causal conv through ``fla.modules.causal_conv1d.causal_conv1d`` (Triton) -> y ``[B,T,D]``.

    FLA saves x for backward as given: a strided slice (the mixers' q/k/v columns of the fused in-projection)
    would keep its whole parent alive, so x is made contiguous first (one copy of the D columns instead).
    """
    fla = load_fla()
    x = x.contiguous()
    check_tensor_device("x", x)
    cu, cu_cpu = device_cu_seqlens(cu_seqlens, x.device)
    cache = None
    if history is not None and history.shape[1] > 0:
        cache = history_to_fla_cache(history)
    y, _ = fla.causal_conv1d(x=x, weight=weight, bias=bias, initial_state=cache, output_final_state=False,
                             activation=activation, backend="triton", cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
    return y
