"""Chunked (WY) gated delta rule math behind the stand-in operators, in PyTorch (fp32), differentiable.

Head-major per sequence: q, k ``[HV, L, K]`` (already expanded to value heads), v ``[HV, L, V]``, beta
``[HV, L]``, per-token log gates g ``[HV, L]`` (GDN) or ``[HV, L, K]`` (KDA, natural log). Chunks of C tokens
never cross a sequence; the last chunk is zero-padded (padding never reaches earlier tokens). Within a chunk
with gamma = in-chunk cumsum of g:

    Akk = (I + StrictLower(beta_i sum_d k_id k_jd e^{gamma_id - gamma_jd}))^-1
    w = Akk (beta k e^{gamma}),  u = Akk (beta v)
    kg = k e^{gamma_C - gamma},  qg = q e^{gamma},  Aqk_ij = scale sum_d q_id k_jd e^{gamma_id - gamma_jd} (i >= j)
    per chunk c (state h_c entering it):  v_new = u - w h_c
        h_{c+1} = Diag(e^{gamma_C}) h_c + kg^T v_new,   o = scale qg h_c + Aqk v_new

This is the FLA formulation (research/fla_and_cp.md section 5) that fla-npu's operators implement.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

LN2 = math.log(2.0)


# ---------------------------------------------------------------------------------------------- gates
def l2norm_with_rstd(x):
    rstd = torch.rsqrt(x.float().pow(2).sum(-1) + 1e-6)
    return x.float() * rstd[..., None], rstd


def l2norm_backward(x_hat, rstd, d_hat):
    """Gradient w.r.t. raw x of x_hat = x * rstd, from x_hat and rstd."""
    return rstd[..., None] * (d_hat - x_hat * (x_hat * d_hat).sum(-1, keepdim=True))


def gdn_gate(g, A_log, dt_bias):
    """-exp(A_log[h]) softplus(g + dt_bias[h]) for head-major g [..., HV, L]."""
    x = g if dt_bias is None else g + dt_bias.float()[:, None]
    return -A_log.float().exp()[:, None] * F.softplus(x)


def kda_gate(g, A_log, dt_bias, lower_bound):
    """KDA gate for head-major g [..., HV, L, K]; dt_bias [HV*K]."""
    HV, K = g.shape[-3], g.shape[-1]
    x = g if dt_bias is None else g + dt_bias.float().view(HV, 1, K)
    if lower_bound is None:
        return -A_log.float().exp()[:, None, None] * F.softplus(x)
    if A_log is not None:
        x = A_log.float().exp()[:, None, None] * x
    return lower_bound * torch.sigmoid(x)


def beta_activation(beta, use_sigmoid, allow_neg_eigval):
    if not use_sigmoid:
        return beta.float()
    return torch.sigmoid(beta.float()) * (2.0 if allow_neg_eigval else 1.0)


# ---------------------------------------------------------------------------------------- segmentation
def segments(batch: int, tokens: int, cu_seqlens):
    """[(batch row, start, end)] of every sequence: rows, or packed documents when cu_seqlens is given."""
    if cu_seqlens is None or len(cu_seqlens) == 0:
        return [(b, 0, tokens) for b in range(batch)]
    cu = [int(x) for x in cu_seqlens]
    return [(0, s, e) for s, e in zip(cu[:-1], cu[1:])]


def num_chunks(length: int, C: int) -> int:
    return -(-length // C)


def _pad_chunks(x, C, dim=1, edge=False):
    """Pad dim ``dim`` (tokens) to a multiple of C (zeros, or the last value with ``edge``), split into [NT, C]."""
    L = x.shape[dim]
    pad = num_chunks(L, C) * C - L
    if pad:
        if edge:
            filler = x.narrow(dim, L - 1, 1).expand(*x.shape[:dim], pad, *x.shape[dim + 1:])
        else:
            shape = list(x.shape)
            shape[dim] = pad
            filler = x.new_zeros(shape)
        x = torch.cat([x, filler], dim=dim)
    return x.unflatten(dim, (-1, C))


def _unpad(x, L, dim=1):
    return x.flatten(dim, dim + 1).narrow(dim, 0, L)


# ------------------------------------------------------------------------------------------- prepare
def chunk_cumsum(g, C):
    """In-chunk cumulative sum of per-token log gates; g [HV, L] or [HV, L, K] -> same shape."""
    L = g.shape[1]
    return _unpad(_pad_chunks(g, C).cumsum(2), L)


def per_token_gate(gamma, C):
    """Inverse of chunk_cumsum (first token of each chunk keeps its value)."""
    L = gamma.shape[1]
    gc = _pad_chunks(gamma, C)
    g = torch.cat([gc[:, :, :1], gc[:, :, 1:] - gc[:, :, :-1]], dim=2)
    return _unpad(g, L)


def wy_lower(k, beta, gamma, C):
    """The strictly lower matrix L of each chunk, A = (I + L)^-1: L_ij = beta_i sum_d k_id k_jd e^{gamma_id -
    gamma_jd} (i > j). k [HV, L, K], beta [HV, L], gamma [HV, L] or [HV, L, K] -> [HV, NT, C, C]."""
    HV, L, K = k.shape
    gam = gamma if gamma.dim() == 3 else gamma[..., None].expand(HV, L, K)
    kc, bc, gc = _pad_chunks(k, C), _pad_chunks(beta, C), _pad_chunks(gam, C, edge=True)
    lower = torch.tril(torch.ones(C, C, dtype=torch.bool, device=k.device), -1)
    diff = (gc[:, :, :, None, :] - gc[:, :, None, :, :]).masked_fill(~lower[..., None], float("-inf"))
    kk = (kc[:, :, :, None, :] * kc[:, :, None, :, :] * torch.exp(diff)).sum(-1)
    return (bc[..., None] * kk).masked_fill(~lower, 0.0)


def prepare(q, k, v, beta, gamma, scale, C):
    """WY quantities of one sequence (see module doc). gamma is [HV, L] (GDN) or [HV, L, K] (KDA), natural log.

    Returns a dict of head-major [HV, L, ...] tensors: Akk, Aqk ([HV, L, C] rows), w, u, kg, qg, decay
    ([HV, NT, K], e^{gamma_C} per chunk and channel).
    """
    HV, L, K = k.shape
    per_channel = gamma.dim() == 3
    gam = gamma if per_channel else gamma[..., None].expand(HV, L, K)
    kc, vc, qc = _pad_chunks(k, C), _pad_chunks(v, C), _pad_chunks(q, C)
    bc = _pad_chunks(beta, C)
    gc = _pad_chunks(gam, C, edge=True)           # [HV, NT, C, K]; padding repeats the last gamma (no decay)
    diff = gc[:, :, :, None, :] - gc[:, :, None, :, :]                   # gamma_i - gamma_j, [HV,NT,C,C,K]
    lower = torch.tril(torch.ones(C, C, dtype=torch.bool, device=k.device), -1)
    causal = torch.tril(torch.ones(C, C, dtype=torch.bool, device=k.device))
    decay_ij = torch.exp(diff.masked_fill(~causal[..., None], float("-inf")))
    kk = (kc[:, :, :, None, :] * kc[:, :, None, :, :] * decay_ij).sum(-1)
    a_raw = (bc[..., None] * kk).masked_fill(~lower, 0.0)
    eye = torch.eye(C, dtype=k.dtype, device=k.device)
    Akk = torch.linalg.solve_triangular(eye + a_raw, eye.expand_as(a_raw), upper=False, unitriangular=True)
    w = Akk @ (bc[..., None] * kc * torch.exp(gc))
    u = Akk @ (bc[..., None] * vc)
    qk = (qc[:, :, :, None, :] * kc[:, :, None, :, :] * decay_ij).sum(-1)
    Aqk = scale * qk.masked_fill(~causal, 0.0)
    g_last = gc[:, :, -1:, :]                     # the last real token's gamma (edge padding)
    kg = kc * torch.exp(g_last - gc)
    qg = qc * torch.exp(gc)
    return {"Akk": _unpad(Akk, L), "Aqk": _unpad(Aqk, L), "w": _unpad(w, L), "u": _unpad(u, L),
            "kg": _unpad(kg, L), "qg": _unpad(qg, L), "decay": torch.exp(g_last[:, :, 0, :])}


# ------------------------------------------------------------------------------------------ state pass
def state_pass(w, u, kg, decay, C, h0=None):
    """Chunk recurrence of one sequence: w, kg [HV, L, K], u [HV, L, V], decay [HV, NT, K], h0 [HV, K, V].

    Returns (h [HV, NT, K, V] entering each chunk, v_new [HV, L, V], final state [HV, K, V])."""
    HV, L, K = w.shape
    V = u.shape[-1]
    wc, uc, kc = _pad_chunks(w, C), _pad_chunks(u, C), _pad_chunks(kg, C)
    S = w.new_zeros(HV, K, V) if h0 is None else h0.float()
    hs, vs = [], []
    for c in range(wc.shape[1]):
        hs.append(S)
        v_new = uc[:, c] - wc[:, c] @ S
        vs.append(v_new)
        S = decay[:, c, :, None] * S + kc[:, c].transpose(-1, -2) @ v_new
    return torch.stack(hs, 1), _unpad(torch.stack(vs, 1), L), S


def outputs(qg, Aqk, v_new, h, scale, C):
    """o [HV, L, V] = scale qg h_c + Aqk v_new (per chunk)."""
    L = qg.shape[1]
    qc, ac, vc = _pad_chunks(qg, C), _pad_chunks(Aqk, C), _pad_chunks(v_new, C)
    return _unpad(scale * qc @ h + ac @ vc, L)


def state_backward(qg, kg, w, do, dv_local, decay, scale, C, dht=None):
    """Reverse chunk recurrence: dh[c] = dL/dh_{c+1} (state leaving chunk c), dv2 = dv_local + kg dh[c],
    dh0 = dL/dh_0. qg is pre-gated (unscaled); do [HV, L, V]. Returns (dh [HV, NT, K, V], dh0, dv2)."""
    HV, L, K = kg.shape
    V = do.shape[-1]
    qc, kc, wc = _pad_chunks(qg, C), _pad_chunks(kg, C), _pad_chunks(w, C)
    doc, dvc = _pad_chunks(do, C), _pad_chunks(dv_local, C)
    dS = kg.new_zeros(HV, K, V) if dht is None else dht.float()
    dhs, dv2s = [None] * qc.shape[1], [None] * qc.shape[1]
    for c in range(qc.shape[1] - 1, -1, -1):
        dhs[c] = dS
        dv2 = dvc[:, c] + kc[:, c] @ dS
        dv2s[c] = dv2
        dS = decay[:, c, :, None] * dS + scale * qc[:, c].transpose(-1, -2) @ doc[:, c] \
            - wc[:, c].transpose(-1, -2) @ dv2
    return torch.stack(dhs, 1), dS, _unpad(torch.stack(dv2s, 1), L)


def transition(w, kg, decay, C):
    """Segment transition M = prod_c (Diag(decay_c) - kg_c^T w_c), [HV, K, K] (first chunk rightmost)."""
    HV, L, K = w.shape
    wc, kc = _pad_chunks(w, C), _pad_chunks(kg, C)
    M = torch.eye(K, dtype=w.dtype, device=w.device).expand(HV, K, K)
    for c in range(wc.shape[1]):
        M = (torch.diag_embed(decay[:, c]) - kc[:, c].transpose(-1, -2) @ wc[:, c]) @ M
    return M


def expand_heads(x, HV):
    """[H, ...] -> [HV, ...] (value head i reads head i // (HV / H))."""
    return x if x.shape[0] == HV else x.repeat_interleave(HV // x.shape[0], dim=0)


def reduce_heads(dx, H):
    """Adjoint of expand_heads: sum the gradients of the value heads sharing one q/k head."""
    HV = dx.shape[0]
    return dx if HV == H else dx.unflatten(0, (H, HV // H)).sum(1)
