"""Affine segment summaries: S_out = M S_in + E for a whole segment (per sequence and value head), fp32.

M = A_T ... A_1 (K x K) is the product of the per-token transitions and E the end state from zero. They
come from one state pass with values [v | 0_K] and initial state [0 | I_K]: the state columns evolve
independently, so the final state is [E | M]. Summaries compose associatively and their adjoint
(dS_in = M^T dS_out) is what the context-parallel engine sends backwards.
"""
from __future__ import annotations

import torch

from layers.ops.eager.chunk import chunked_delta_rule


def augmented_initial_state(num_seqs: int, HV: int, K: int, V: int, *, device, with_transition=True):
    """[N, HV, K, V+K] fp32: zeros beside the identity (or zeros when ``with_transition`` is False)."""
    S0 = torch.zeros(num_seqs, HV, K, V + K, device=device, dtype=torch.float32)
    if with_transition:
        S0[..., V:] = torch.eye(K, device=device)
    return S0


def segment_summary(kind, k, v, g, beta, *, cu_seqlens=None, use_qk_l2norm_in_kernel=False,
                    use_beta_sigmoid_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                    lower_bound=None):
    """(M [N,HV,K,K], E [N,HV,K,V]) fp32 of each sequence of validated GDN/KDA inputs (differentiable)."""
    B, T, HV, V = v.shape
    K = k.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    v_aug = torch.cat([v.float(), v.new_zeros(B, T, HV, K, dtype=torch.float32)], dim=-1)
    S0 = augmented_initial_state(N, HV, K, V, device=v.device)
    _, final = chunked_delta_rule(kind, k, k, v_aug, g, beta, scale=1.0, initial_state=S0, output_final_state=True,
                                  cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                  use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                                  use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                                  lower_bound=lower_bound, with_output=False)
    return final[..., V:], final[..., :V]


def apply_summary(M: torch.Tensor, E: torch.Tensor, S_in: torch.Tensor) -> torch.Tensor:
    """S_out = M S_in + E."""
    return M @ S_in + E


def compose_summaries(later, earlier):
    """Summary of running ``earlier`` then ``later``: (M2 M1, M2 E1 + E2)."""
    (M2, E2), (M1, E1) = later, earlier
    return M2 @ M1, M2 @ E1 + E2


def summary_adjoint(M: torch.Tensor, dS_out: torch.Tensor) -> torch.Tensor:
    """Gradient carried to S_in by a segment: M^T dS_out."""
    return M.transpose(-1, -2) @ dS_out
