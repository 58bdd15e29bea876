"""Eager decode steps (backend interface ``delta_rule_step`` / ``causal_conv1d_step``; inputs validated).

One token per sequence, vectorized over sequences and heads, state in fp32 (updated in place)::

    S' = decay * S                  decay = exp(g) per head (GDN) or per key channel (KDA)
    S  = S' + k (beta (v - S'^T k))^T,   o = scale * S^T q

which is the chunked op's recurrence ``S_t = exp(g_t)(I - b k k^T) S_{t-1} + b k v^T`` (GDN) /
``(I - b k k^T) Diag(exp(g_t)) S_{t-1} + b k v^T`` (KDA) for one token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from layers.ops.gates import prepare_inputs
from layers.ops.kinds import delta_kind


def delta_rule_step(kind, q, k, v, g, beta, state, *, scale, lower_bound=None, **flags):
    """q, k [N,1,H,K]; v [N,1,HV,V]; g [N,1,HV(,K)]; beta [N,1,HV]; state [N,HV,K,V] fp32 -> o [N,1,HV,V]."""
    out_dtype = q.dtype
    kind = delta_kind(kind)
    q, k, v, g, beta = (x[:, 0].float() for x in
                        prepare_inputs(kind, q, k, v, g, beta, lower_bound=lower_bound, **flags))
    group = v.shape[1] // q.shape[1]   # value head i reads query/key head i // group
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    state.mul_(kind.decay(g))                                                      # [N,HV,K|1,1]
    delta = (v - (k.unsqueeze(-2) @ state).squeeze(-2)) * beta[..., None]          # [N,HV,V]
    state.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    o = (q.unsqueeze(-2) @ state).squeeze(-2) * scale
    return o[:, None].to(out_dtype)


def causal_conv1d_step(x, history, weight, *, bias=None, activation=None):
    """x [N,1,D], history [N,W-1,D] (shifted in place), weight [D,W] -> y [N,1,D] in x's dtype (fp32 math)."""
    window = torch.cat([history, x.to(history.dtype)], dim=1)            # [N, W, D], oldest first
    y = (window.float() * weight.t().float()).sum(1, keepdim=True)
    if bias is not None:
        y = y + bias.float()
    if activation is not None:
        y = F.silu(y)
    history.copy_(window[:, 1:])
    return y.to(x.dtype)
