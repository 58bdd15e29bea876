"""The only sequential part of the chunked delta rule: the chunk-to-chunk state pass.

Per chunk c (WY form, fp32):  H_c = S;  Vn_c = U_c - W_c S;  S <- decay_c * S + Kt_c^T Vn_c
with W, U from the intra-chunk triangular solve, Kt = K * exp(gamma_C - gamma) and decay = exp(gamma_C)
per key channel. The backward pass runs the reverse recurrence only for the state gradient and does the
rest batched over all chunks afterwards (the layout FLA's kernels use).

Chunks are step-major with sequences sorted longest first (``chunking.ChunkLayout``): step j touches chunks
[off_j, off_j + a_j) and sequences [0, a_j). States are written straight into their slot of H (and the
state gradients into their slot of dS_next), so a step costs two batched matmuls and no extra copies.
"""
from __future__ import annotations

import torch


def _bmm_into(out, base, x, y, alpha):
    """out = base + alpha * x @ y on [a, HV, m, n] views (out may be a slice of a larger buffer)."""
    a, HV = out.shape[:2]
    torch.baddbmm(base.reshape(a * HV, *base.shape[2:]), x.reshape(a * HV, *x.shape[2:]),
                  y.reshape(a * HV, *y.shape[2:]), alpha=alpha, out=out.view(a * HV, *out.shape[2:]))


class StateScan(torch.autograd.Function):
    """(W [n,HV,C,K], U [n,HV,C,V], Kt [n,HV,C,K], decay [n,HV,K], S0 [N,HV,K,V] sorted or None, steps)
    -> (H [n,HV,K,V] state entering each chunk, Vn [n,HV,C,V], S_final [N,HV,K,V] sorted)."""

    @staticmethod
    def forward(ctx, W, U, Kt, decay, S0, steps):
        n, HV, C, K = W.shape
        V = U.shape[-1]
        offsets, counts = steps
        N = counts[0] if counts else 0
        H = W.new_empty(n, HV, K, V)
        Vn = W.new_empty(n, HV, C, V)
        S_final = W.new_empty(N, HV, K, V)
        if N:
            H[:N] = 0 if S0 is None else S0
        for j, (off, a) in enumerate(zip(offsets, counts)):
            sl = slice(off, off + a)
            Sa = H[sl]
            _bmm_into(Vn[sl], U[sl], W[sl], Sa, alpha=-1.0)
            a_next = counts[j + 1] if j + 1 < len(counts) else 0
            target = H[off + a: off + a + a_next] if a_next == a else W.new_empty(a, HV, K, V)
            _bmm_into(target, decay[sl, :, :, None] * Sa, Kt[sl].transpose(-1, -2), Vn[sl], alpha=1.0)
            if a_next != a:   # sequences [a_next, a) end here; the rest go on
                H[off + a: off + a + a_next] = target[:a_next]
                S_final[a_next:a] = target[a_next:]
        ctx.steps = steps
        ctx.has_s0 = S0 is not None
        ctx.save_for_backward(W, Kt, decay, H, Vn)
        return H, Vn, S_final

    @staticmethod
    def backward(ctx, dH, dVn, dS_final):
        W, Kt, decay, H, Vn = ctx.saved_tensors
        n, HV, C, K = W.shape
        V = Vn.shape[-1]
        offsets, counts = ctx.steps
        N = counts[0] if counts else 0
        dH = torch.zeros_like(H) if dH is None else dH
        dVn = torch.zeros_like(Vn) if dVn is None else dVn
        dS_final = W.new_zeros(N, HV, K, V) if dS_final is None else dS_final
        dS_next = torch.empty_like(H)    # gradient w.r.t. the state leaving each chunk
        dV = torch.empty_like(Vn)        # total gradient w.r.t. Vn (direct + through the state)
        dS0 = W.new_empty(N, HV, K, V)
        last = len(counts) - 1
        if last >= 0:
            dS_next[offsets[last]: offsets[last] + counts[last]] = dS_final[:counts[last]]
        for j in range(last, -1, -1):
            off, a = offsets[j], counts[j]
            sl = slice(off, off + a)
            dSa = dS_next[sl]
            _bmm_into(dV[sl], dVn[sl], Kt[sl], dSa, alpha=1.0)
            if j == 0:
                target = dS0[:a]
            else:   # gradient leaving chunk j-1: these a sequences, plus those that ended at step j-1
                prev_off, prev_a = offsets[j - 1], counts[j - 1]
                target = dS_next[prev_off: prev_off + a]
                if prev_a != a:
                    dS_next[prev_off + a: prev_off + prev_a] = dS_final[a:prev_a]
            _bmm_into(target, decay[sl, :, :, None] * dSa + dH[sl], W[sl].transpose(-1, -2), dV[sl], alpha=-1.0)
        dW = torch.matmul(dV, H.transpose(-1, -2)).neg_()
        dKt = Vn @ dS_next.transpose(-1, -2)
        ddecay = (H * dS_next).sum(-1)
        return dW, dV, dKt, ddecay, (dS0 if ctx.has_s0 else None), None
