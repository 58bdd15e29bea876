"""Affine segment summaries: S_out = M S_in + E for a whole segment (per sequence and value head), fp32.

M = A_T ... A_1 (K x K) is the product of the per-token transitions and E the end state from zero. They
come from one state pass with values [v | 0_K] and initial state [0 | I_K]: the state columns evolve
independently, so the final state is [E | M]. Summaries compose associatively and their adjoint
(dS_in = M^T dS_out) is what the context-parallel engine sends backwards.
"""
from __future__ import annotations

import torch

from layers.ops.backends import get_backend
from layers.ops.kinds import delta_kind


def _augmented_inputs(k, v, cu_seqlens):
    """Values [v | 0_K] (v's dtype, exact) and initial states [0 | I_K] [N,HV,K,V+K] (fp32; fp64 for fp64 v)."""
    B, T, HV, V = v.shape
    K = k.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    dt = torch.float64 if v.dtype == torch.float64 else torch.float32
    v_aug = torch.cat([v, v.new_zeros(B, T, HV, K)], dim=-1)
    S0 = torch.zeros(N, HV, K, V + K, device=v.device, dtype=dt)
    S0[..., V:] = torch.eye(K, device=v.device, dtype=dt)
    return v_aug, S0


def augmented_final_states(kind, impl, k, v, g, beta, cu_seqlens, flags):
    """Final states [N, HV, K, V+K] = [E | M] (fp32; fp64 for fp64 input) of every sequence, through the
    backend module ``impl`` (its ``delta_rule_final_state``).

    Inputs are validated ``[B,T,...]`` tensors; ``flags`` are the op's gate/beta/l2norm keywords.
    """
    v_aug, S0 = _augmented_inputs(k, v, cu_seqlens)
    return impl.delta_rule_final_state(delta_kind(kind), k, v_aug, g, beta, initial_state=S0, cu_seqlens=cu_seqlens,
                                       **flags)


def augmented_pass(kind, impl, q, k, v, g, beta, cu_seqlens, scale, flags):
    """One op pass with values [v | 0_K] and initial states [0 | I_K] -> (o_aug [B,T,HV,V+K], final [N,HV,K,V+K]).

    Outputs are linear in the initial state, so a sequence entered with state S_in has output
    ``o_aug[..., :V] + o_aug[..., V:] @ S_in`` (o_aug in the op's output dtype); ``final`` = [E | M] as in
    :func:`augmented_final_states`. The CP engine's generic path gets outputs and summaries from this one pass
    and applies the incoming states afterwards.
    """
    v_aug, S0 = _augmented_inputs(k, v, cu_seqlens)
    op = delta_kind(kind).backend_op(impl)
    return op(q, k, v_aug, g, beta, scale=scale, initial_state=S0, output_final_state=True, cu_seqlens=cu_seqlens,
              **flags)


def segment_summary(kind, k, v, g, beta, *, cu_seqlens=None, backend="eager", **flags):
    """(M [N,HV,K,K], E [N,HV,K,V]) fp32 of each sequence of validated GDN/KDA inputs (differentiable).

    ``flags``: use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, use_gate_in_kernel, A_log, dt_bias
    (and lower_bound for KDA), as in the ops.
    """
    V = v.shape[-1]
    final = augmented_final_states(kind, get_backend(backend), k, v, g, beta, cu_seqlens, flags)
    return final[..., V:], final[..., :V]


def apply_summary(M: torch.Tensor, E: torch.Tensor, S_in: torch.Tensor) -> torch.Tensor:
    """S_out = M S_in + E."""
    return M @ S_in + E
