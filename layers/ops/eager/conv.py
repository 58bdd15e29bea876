"""Eager depthwise causal convolution (backend interface ``causal_conv1d``; inputs already validated).

y[t, d] = act(bias_d + sum_{i<W} weight[d, i] * x[t - W + 1 + i, d]); the W-1 positions before each sequence
come from ``history`` ``[N, W-1, D]`` (zeros when None). Every sequence (batch row, or packed document) is
laid out behind its own W-1 history slots in one padded stream, so a single valid convolution over that
stream never mixes sequences. Computes in fp32 (fp64 for fp64 inputs); returns x's dtype.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F


def _compute_dtype(*dtypes) -> torch.dtype:
    out = torch.float32
    for dt in dtypes:
        out = torch.promote_types(out, dt)
    return out


def _valid_depthwise(xp: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Valid depthwise conv along dim 1 of channel-last ``xp [B, L, D]`` with ``weight [D, W]`` -> [B, L-W+1, D]."""
    W = weight.shape[1]
    n = xp.shape[1] - W + 1
    y = xp[:, :n] * weight[:, 0]
    for i in range(1, W):  # W kernel taps, each one fused multiply-add over all tokens
        y = torch.addcmul(y, xp[:, i:i + n], weight[:, i])
    return y


def _packed_layout(cu_seqlens: torch.Tensor, W: int, with_history: bool):
    return _packed_layout_cached(tuple(cu_seqlens.tolist()), W, with_history)


@lru_cache(maxsize=64)
def _packed_layout_cached(cu_key: tuple, W: int, with_history: bool):
    """Index maps for packed documents (CPU int64).

    Returns ``(source_index [T + N(W-1)], output_index [T])``: the padded stream row r reads row
    ``source_index[r]`` of ``cat([x_tokens (T), history_rows (N(W-1)) or one zero row])``, and token t's
    output is row ``output_index[t]`` of the valid convolution over that stream.
    """
    cu_seqlens = torch.tensor(cu_key, dtype=torch.int64)
    N = cu_seqlens.numel() - 1
    T = int(cu_seqlens[-1])
    H = W - 1
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    doc = torch.repeat_interleave(torch.arange(N), lengths)  # [T] document of each token
    token_pos = torch.arange(T) + (doc + 1) * H  # row of token t in the padded stream
    source = torch.empty(T + N * H, dtype=torch.int64)
    source[token_pos] = torch.arange(T)
    if H > 0:
        hist_pos = (cu_seqlens[:-1] + torch.arange(N) * H)[:, None] + torch.arange(H)  # [N, H]
        source[hist_pos.reshape(-1)] = (T + torch.arange(N * H)) if with_history else T
    return source, token_pos - H


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, *, bias=None, activation=None, cu_seqlens=None,
                  history=None) -> torch.Tensor:
    """x ``[B,T,D]``, weight ``[D,W]``, bias ``[D]`` or None, activation None | "silu" | "swish",
    cu_seqlens CPU int64 ``[N+1]`` (B == 1) or None, history ``[N, W-1, D]`` or None -> y ``[B,T,D]`` (x.dtype)."""
    B, T, D = x.shape
    W = weight.shape[1]
    dtype = _compute_dtype(x.dtype, weight.dtype, *(() if bias is None else (bias.dtype,)),
                           *(() if history is None else (history.dtype,)))
    xc, wc = x.to(dtype), weight.to(dtype)
    hist = None if history is None else history.to(dtype)
    if cu_seqlens is None:
        if hist is None:
            hist = xc.new_zeros(B, W - 1, D)
        y = _valid_depthwise(torch.cat([hist, xc], dim=1), wc)
    else:
        source, out_index = _packed_layout(cu_seqlens, W, hist is not None)
        extra = hist.reshape(-1, D) if hist is not None else xc.new_zeros(1, D)
        table = torch.cat([xc[0], extra], dim=0)
        padded = table.index_select(0, source.to(x.device))
        y = _valid_depthwise(padded[None], wc)[:, out_index.to(x.device)]
    if bias is not None:
        y = y + bias.to(dtype)
    if activation is not None:  # "silu" and "swish" name the same function
        y = F.silu(y)
    return y.to(x.dtype)
