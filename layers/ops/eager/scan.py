"""The only sequential part of the chunked delta rule: the chunk-to-chunk state pass.

Per chunk c (WY form, fp32):  H_c = S;  Vn_c = U_c - W_c S;  S <- decay_c * S + Kt_c^T Vn_c
with W, U from the intra-chunk triangular solve, Kt = K * exp(gamma_C - gamma) and decay = exp(gamma_C)
per key channel. The backward pass runs the reverse recurrence only for the state gradient and does the
rest batched over all chunks afterwards (the layout FLA's kernels use).
"""
from __future__ import annotations

import torch


class StateScan(torch.autograd.Function):
    """(W [n,HV,C,K], U [n,HV,C,V], Kt [n,HV,C,K], decay [n,HV,K], S0 [N,HV,K,V] sorted or None)
    -> (H [n,HV,K,V] state entering each chunk, Vn [n,HV,C,V], S_final [N,HV,K,V] sorted)."""

    @staticmethod
    def forward(ctx, W, U, Kt, decay, S0, steps):
        n, HV, C, K = W.shape
        V = U.shape[-1]
        offsets, counts = steps
        N = counts[0] if counts else 0
        S = W.new_zeros(N, HV, K, V) if S0 is None else S0.clone()
        H = W.new_empty(n, HV, K, V)
        Vn = W.new_empty(n, HV, C, V)
        for off, a in zip(offsets, counts):
            sl = slice(off, off + a)
            Sa = S[:a]
            H[sl] = Sa
            vn = torch.baddbmm(U[sl].reshape(a * HV, C, V), W[sl].reshape(a * HV, C, K),
                               Sa.reshape(a * HV, K, V), beta=1.0, alpha=-1.0).view(a, HV, C, V)
            Vn[sl] = vn
            S[:a] = torch.baddbmm((decay[sl, :, :, None] * Sa).reshape(a * HV, K, V),
                                  Kt[sl].reshape(a * HV, C, K).transpose(1, 2),
                                  vn.reshape(a * HV, C, V)).view(a, HV, K, V)
        ctx.steps = steps
        ctx.has_s0 = S0 is not None
        ctx.save_for_backward(W, Kt, decay, H, Vn)
        return H, Vn, S

    @staticmethod
    def backward(ctx, dH, dVn, dS_final):
        W, Kt, decay, H, Vn = ctx.saved_tensors
        n, HV, C, K = W.shape
        V = Vn.shape[-1]
        offsets, counts = ctx.steps
        N = counts[0] if counts else 0
        dH = torch.zeros_like(H) if dH is None else dH
        dVn = torch.zeros_like(Vn) if dVn is None else dVn
        dS = W.new_zeros(N, HV, K, V) if dS_final is None else dS_final.clone()
        dS_next = torch.empty_like(H)    # gradient w.r.t. the state leaving each chunk
        dV = torch.empty_like(Vn)        # total gradient w.r.t. Vn (direct + through the state)
        for off, a in zip(reversed(offsets), reversed(counts)):
            sl = slice(off, off + a)
            dSa = dS[:a]
            dS_next[sl] = dSa
            dv = torch.baddbmm(dVn[sl].reshape(a * HV, C, V), Kt[sl].reshape(a * HV, C, K),
                               dSa.reshape(a * HV, K, V)).view(a, HV, C, V)
            dV[sl] = dv
            dS[:a] = torch.baddbmm((decay[sl, :, :, None] * dSa + dH[sl]).reshape(a * HV, K, V),
                                   W[sl].reshape(a * HV, C, K).transpose(1, 2), dv.reshape(a * HV, C, V),
                                   beta=1.0, alpha=-1.0).view(a, HV, K, V)
        dW = -(dV @ H.transpose(-1, -2))
        dKt = Vn @ dS_next.transpose(-1, -2)
        ddecay = (H * dS_next).sum(-1)
        return dW, dV, dKt, ddecay, (dS if ctx.has_s0 else None), None
