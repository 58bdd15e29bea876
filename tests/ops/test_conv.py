"""layers.ops.causal_conv1d against an independent fp64 reference: per-sequence F.conv1d over [history | x]."""
import pytest
import torch
import torch.nn.functional as F

from layers.ops import causal_conv1d
from tests.support.reference import rel_err


def reference_conv(x, weight, bias=None, activation=None, cu_seqlens=None, history=None):
    """fp64, one sequence at a time: F.conv1d (cross-correlation) of the sequence behind its W-1 history rows."""
    B, T, D = x.shape
    W = weight.shape[1]
    x, weight = x.double(), weight.double()
    bias = None if bias is None else bias.double()
    if cu_seqlens is None:
        seqs = [x[b] for b in range(B)]
    else:
        bounds = [int(c) for c in cu_seqlens]
        seqs = [x[0, s:e] for s, e in zip(bounds[:-1], bounds[1:])]
    outs = []
    for n, seq in enumerate(seqs):
        before = history[n].double() if history is not None else seq.new_zeros(W - 1, D)
        inp = torch.cat([before, seq], dim=0).T[None]  # [1, D, W-1+L]
        y = F.conv1d(inp, weight[:, None, :], bias, groups=D)[0].T  # [L, D]
        if activation is not None:
            y = y * torch.sigmoid(y)
        outs.append(y)
    if cu_seqlens is None:
        return torch.stack(outs)
    return torch.cat(outs)[None]


def _inputs(B, T, D, W, N, with_bias, with_history, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=gen, dtype=dtype)
    weight = torch.randn(D, W, generator=gen, dtype=dtype) / W ** 0.5
    bias = torch.randn(D, generator=gen, dtype=dtype) if with_bias else None
    history = torch.randn(N, W - 1, D, generator=gen, dtype=dtype) if with_history else None
    return x, weight, bias, history


def _check(B, T, D, W, *, cu=None, with_bias=False, activation=None, with_history=False):
    N = B if cu is None else len(cu) - 1
    x, weight, bias, history = _inputs(B, T, D, W, N, with_bias, with_history)
    leaves = [t for t in (x, weight, bias, history) if t is not None]
    for t in leaves:
        t.requires_grad_(True)
    y = causal_conv1d(x, weight, bias=bias, activation=activation, cu_seqlens=cu, history=history)
    assert y.dtype == x.dtype and y.shape == x.shape
    grad_out = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
    got = torch.autograd.grad(y, leaves, grad_out)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    it = iter(ref_leaves)
    rx, rw = next(it), next(it)
    rb = next(it) if bias is not None else None
    rh = next(it) if history is not None else None
    y_ref = reference_conv(rx, rw, rb, activation, cu, rh)
    want = torch.autograd.grad(y_ref, ref_leaves, grad_out.double())
    assert rel_err(y, y_ref) <= 1e-5
    for g, r in zip(got, want):
        assert rel_err(g, r) <= 1e-4


@pytest.mark.parametrize("W", [1, 2, 4])
@pytest.mark.parametrize("with_bias,activation", [(False, None), (True, "silu"), (True, "swish")])
def test_batched_matches_reference(W, with_bias, activation):
    _check(2, 11, 6, W, with_bias=with_bias, activation=activation)


@pytest.mark.parametrize("W", [2, 4])
def test_packed_documents_including_length_one_and_shorter_than_kernel(W):
    cu = [0, 1, 3, 8, 9, 11, 18]  # lengths 1, 2, 5, 1, 2, 7
    _check(1, 18, 5, W, cu=cu, with_bias=True, activation="silu")
    _check(1, 18, 5, W, cu=torch.tensor(cu, dtype=torch.int32))


@pytest.mark.parametrize("cu", [None, [0, 1, 3, 8, 9, 13]])
def test_history_and_its_gradient(cu):
    B = 2 if cu is None else 1
    _check(B, 13, 4, 4, cu=cu, with_bias=True, activation="silu", with_history=True)


def test_packed_single_document_equals_batched_row():
    x, weight, bias, history = _inputs(1, 9, 3, 3, 1, True, True)
    packed = causal_conv1d(x, weight, bias, "silu", cu_seqlens=[0, 9], history=history)
    batched = causal_conv1d(x, weight, bias, "silu", history=history)
    torch.testing.assert_close(packed, batched, rtol=0, atol=0)


def test_low_precision_keeps_dtype_and_accumulates_in_fp32():
    x, weight, bias, _ = _inputs(1, 16, 8, 4, 1, True, False)
    y = causal_conv1d(x.bfloat16(), weight, bias, "silu")
    assert y.dtype == torch.bfloat16
    y_ref = reference_conv(x.bfloat16().float(), weight, bias, "silu")
    assert rel_err(y, y_ref) <= 1e-2


@pytest.mark.parametrize("cu", [None, [0, 1, 4, 6]])
def test_gradcheck_fp64(cu):
    B = 2 if cu is None else 1
    N = B if cu is None else len(cu) - 1
    x, weight, bias, history = _inputs(B, 6, 2, 3, N, True, True, dtype=torch.float64)
    leaves = tuple(t.requires_grad_(True) for t in (x, weight, bias, history))
    assert torch.autograd.gradcheck(
        lambda a, b, c, d: causal_conv1d(a, b, c, "silu", cu_seqlens=cu, history=d), leaves)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(x=torch.zeros(2, 5)), ValueError, "x must have 3 dimensions"),
    (dict(x=torch.zeros(1, 5, 4, dtype=torch.int64)), TypeError, "x must have a floating dtype"),
    (dict(x=[1.0]), TypeError, "x must be a torch.Tensor"),
    (dict(weight=torch.zeros(4, 1, 3)), ValueError, r"weight must have shape \[D, W\]"),
    (dict(weight=torch.zeros(3, 3)), ValueError, "weight must have D=4 rows"),
    (dict(weight=torch.zeros(4, 0)), ValueError, "kernel size W must be >= 1"),
    (dict(bias=torch.zeros(3)), ValueError, r"bias must have shape \(4,\)"),
    (dict(activation="relu"), ValueError, "activation must be one of"),
    (dict(cu_seqlens=[0, 2, 4]), ValueError, "must end at the sequence length T=5"),
    (dict(cu_seqlens=[0, 3, 3, 5]), ValueError, "strictly increasing"),
    (dict(cu_seqlens=[0.0, 5.0]), TypeError, "cu_seqlens must hold integers"),
    (dict(x=torch.zeros(2, 5, 4), cu_seqlens=[0, 5]), ValueError, "requires batch size 1, got B=2"),
    (dict(history=torch.zeros(1, 3, 4)), ValueError, r"history must have shape \[N, W-1, D\] = \[1, 2, 4\]"),
    (dict(history=torch.zeros(1, 2, 4), cu_seqlens=[0, 2, 5]), ValueError, r"= \[2, 2, 4\]"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
])
def test_errors_name_the_constraint(kwargs, exc, match):
    args = dict(x=torch.zeros(1, 5, 4), weight=torch.zeros(4, 3))
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        causal_conv1d(**args)


def test_cp_context_rejects_history_and_local_cu_seqlens():
    x, weight = torch.zeros(1, 4, 2), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="cp_context does not take history"):
        causal_conv1d(x, weight, history=torch.zeros(1, 2, 2), cp_context=object())
    with pytest.raises(ValueError, match="with cp_context pass cu_seqlens=None"):
        causal_conv1d(x, weight, cu_seqlens=[0, 4], cp_context=object())
