"""Chunked WY delta rule in pure PyTorch (GDN: scalar gate per head, KDA: gate per key channel).

Within a chunk of C tokens, with gamma the in-chunk cumulative log decay (per channel for KDA):
  A    = StrictLower(beta_i * sum_c k_ic k_jc exp(gamma_ic - gamma_jc)),  T = (I + A)^-1
  W    = T (beta K exp(gamma)),  U = T (beta V),  Kt = K exp(gamma_C - gamma)
  Vn   = U - W S,  S' = exp(gamma_C) S + Kt^T Vn                       (StateScan, sequential)
  o    = scale * [ (Q exp(gamma)) S + Tril(sum_c q_ic k_jc exp(gamma_ic - gamma_jc)) Vn ]
Everything but the state pass is batched over chunks, heads and sequences. The pairwise decay factors
are evaluated so that no exponent is positive: exactly for GDN, and for KDA by recursive blocking
(off-diagonal blocks through a reference point between the two tokens, 4-token diagonal blocks elementwise).
"""
from __future__ import annotations

import torch

from layers.ops.eager.chunking import chunk_layout, from_chunks, to_chunks
from layers.ops.gates import prepare_inputs
from layers.ops.kinds import delta_kind
from layers.ops.eager.scan import StateScan

CHUNK_SIZE = 64


def pair_decay(gamma: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """exp(gamma_i - gamma_j) for j <= i, else 0: [..., C] -> [..., C, C] in ``dtype`` (difference in gamma's dtype)."""
    C = gamma.shape[-1]
    keep = torch.ones(C, C, dtype=torch.bool, device=gamma.device).tril()
    return (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~keep, float("-inf")).to(dtype).exp()


def decayed_gram(a: torch.Tensor, b: torch.Tensor, gamma: torch.Tensor, inclusive: bool,
                 pair: torch.Tensor | None = None) -> torch.Tensor:
    """out_ij = sum_c a_ic b_jc exp(gamma_ic - gamma_jc) for j < i (j <= i if inclusive), else 0.

    a, b [..., C, K]; gamma [..., C] (scalar decay; ``pair`` may pass its precomputed ``pair_decay``) or
    [..., C, K] (per channel). Returns [..., C, C].
    """
    if gamma.dim() == a.dim() - 1:
        pair = pair_decay(gamma, a.dtype) if pair is None else pair
        return (a @ b.transpose(-1, -2)) * (pair if inclusive else pair.tril(-1))
    return _channel_gram(a, b, gamma, inclusive)


def _channel_gram(a, b, gamma, inclusive):
    """Per-channel decayed gram by recursive 4-way blocking.

    Off-diagonal blocks are matmuls through a reference point r between the two tokens (the last token
    of the preceding block), so both factors exp(gamma_i - gamma_r), exp(gamma_r - gamma_j) are <= 1.
    Diagonal blocks recurse (batched over blocks); blocks of <= 4 tokens are evaluated elementwise.
    """
    C = a.shape[-2]
    if C <= 4 or C % 4:
        keep = torch.ones(C, C, dtype=torch.bool, device=a.device).tril(0 if inclusive else -1)
        expo = (gamma[..., :, None, :] - gamma[..., None, :, :]).masked_fill(~keep[..., None], float("-inf"))
        return (a[..., :, None, :] * b[..., None, :, :] * expo.to(a.dtype).exp()).sum(-1)
    s = C // 4
    diag = _channel_gram(a.unflatten(-2, (4, s)), b.unflatten(-2, (4, s)), gamma.unflatten(-2, (4, s)), inclusive)
    rows = []
    for blk in range(4):
        cur = slice(blk * s, (blk + 1) * s)
        parts = []
        if blk:
            ref = gamma[..., blk * s - 1: blk * s, :]
            a_ref = a[..., cur, :] * (gamma[..., cur, :] - ref).to(a.dtype).exp()
            b_ref = b[..., : blk * s, :] * (ref - gamma[..., : blk * s, :]).to(a.dtype).exp()
            parts.append(a_ref @ b_ref.transpose(-1, -2))
        parts.append(diag[..., blk, :, :])
        if blk < 3:
            parts.append(a.new_zeros(*a.shape[:-2], s, C - (blk + 1) * s))
        rows.append(torch.cat(parts, dim=-1))
    return torch.cat(rows, dim=-2)


def _chunk_inputs(k, v, g, beta, layout):
    """Gather to chunks and build the WY quantities: (kc, gamma, pair, gexp, W, U, Kt, decay)."""
    kc, vc, bc = to_chunks(k, layout), to_chunks(v, layout), to_chunks(beta, layout)   # bc [n,HV,C]
    # gamma stays fp64: with strong decay it reaches -1e3 in a chunk, and differences of nearby tokens must
    # keep their digits; each difference is cast to the compute dtype before exp.
    dt = kc.dtype
    gamma = to_chunks(g, layout).double().cumsum(2)              # [n,HV,C] or [n,HV,C,K]
    per_channel = gamma.dim() == 4
    gexp = gamma.to(dt).exp()
    gexp = gexp if per_channel else gexp[..., None]
    g_last = gamma[:, :, -1:]                                    # [n,HV,1] or [n,HV,1,K]
    tail = (g_last - gamma).to(dt).exp()
    tail = tail if per_channel else tail[..., None]
    pair = None if per_channel else pair_decay(gamma, dt)        # shared by A and the output's gram
    # I + StrictLower(A): solve_triangular(unitriangular=True) reads only the strictly lower part (and
    # returns no gradient for the rest), so the inclusive gram serves as is
    A = bc[..., None] * decayed_gram(kc, kc, gamma, inclusive=True, pair=pair)
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    # explicit inverse then matmuls: faster on CPU than a triangular solve with a wide right-hand side
    T = torch.linalg.solve_triangular(A, eye.expand_as(A), upper=False, unitriangular=True)
    bc = bc[..., None]
    W, U = T @ (bc * kc * gexp), T @ (bc * vc)
    K = kc.shape[-1]
    decay = g_last.squeeze(2).to(dt).exp()
    if not per_channel:
        decay = decay[..., None].expand(-1, -1, K)
    return kc, gamma, pair, gexp, W, U, kc * tail, decay


def chunked_delta_rule(kind, q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens,
                       use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, use_gate_in_kernel=False,
                       A_log=None, dt_bias=None, lower_bound=None, with_output=True):
    """Eager delta rule of ``kind`` (a ``layers.ops.kinds`` name or descriptor) on validated inputs; see
    layers.ops.delta_rule.

    Returns (o [B,T,HV,V] in q.dtype or None when ``with_output`` is False, final_state [N,HV,K,V] fp32 or None).
    """
    B, T, H, _ = q.shape
    HV = v.shape[2]
    out_dtype = q.dtype
    q, k, v, g, beta = prepare_inputs(delta_kind(kind), q, k, v, g, beta,
                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                      use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                                      use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                                      lower_bound=lower_bound)
    if HV != H:
        q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    layout = chunk_layout(B, T, cu_seqlens, CHUNK_SIZE, q.device)
    kc, gamma, pair, gexp, W, U, Kt, decay = _chunk_inputs(k, v, g, beta, layout)
    order = layout.seq_order
    S0 = None if initial_state is None else initial_state.to(q.dtype).index_select(0, order)
    Hs, Vn, S_sorted = StateScan.apply(W, U, Kt, decay, S0, (layout.step_offsets, layout.step_counts))
    final = S_sorted.index_select(0, layout.seq_inverse) if output_final_state else None
    if not with_output:
        return None, final
    qc = to_chunks(q, layout)
    o = (qc * gexp) @ Hs + decayed_gram(qc, kc, gamma, inclusive=True, pair=pair) @ Vn
    o = from_chunks(o * scale, layout, B, T)
    return o.to(out_dtype), final
