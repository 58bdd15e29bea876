"""Elementwise preprocessing shared by the GDN/KDA kernels (FLA 0.6 semantics), fp32, differentiable."""
from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/bf16/fp32 inputs, fp64 for fp64 inputs (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """FLA's l2norm: x / sqrt(sum(x^2) + 1e-6) over the last dim (not F.normalize)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)


def gdn_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """-exp(A_log) * softplus(g + dt_bias); g [..., HV], A_log/dt_bias [HV]."""
    x = g if dt_bias is None else g + dt_bias.to(g.dtype)
    return -A_log.to(g.dtype).exp() * F.softplus(x)


def kda_gate(g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
             lower_bound: float | None) -> torch.Tensor:
    """Per-channel KDA gate; g [..., HV, K], A_log [HV], dt_bias [HV*K].

    Without lower_bound: -exp(A_log)[h] * softplus(g + dt_bias). With it:
    lower_bound * sigmoid(exp(A_log)[h] * (g + dt_bias)), or lower_bound * sigmoid(g + dt_bias) if A_log is None.
    """
    HV, K = g.shape[-2:]
    x = g if dt_bias is None else g + dt_bias.to(g.dtype).view(HV, K)
    if lower_bound is None:
        return -A_log.to(g.dtype).exp()[:, None] * F.softplus(x)
    if A_log is not None:
        x = A_log.to(g.dtype).exp()[:, None] * x
    return lower_bound * torch.sigmoid(x)


def prepare_inputs(kind, q, k, v, g, beta, *, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                   use_gate_in_kernel, A_log, dt_bias, lower_bound=None):
    """Return (q, k, v, g, beta) in fp32 (fp64 for fp64 inputs) with the in-kernel transforms applied; ``kind``
    is a ``layers.ops.kinds.DeltaKind`` (its ``gate``)."""
    dt = compute_dtype(q.dtype)
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta)
    if use_gate_in_kernel:
        g = kind.gate(g, A_log, dt_bias, lower_bound)
    return q, k, v, g, beta
