"""Eager GDN/KDA ops against the independent fp64 per-token recurrence in ``tests/support/reference.py``.

Outputs and final states within relative L2 1e-5 (fp32), every gradient within 1e-4; gradcheck in fp64;
split-and-chain equals one run; low-precision inputs keep their dtype.
"""
from __future__ import annotations

import pytest
import torch

from layers.ops.delta_rule import chunk_gated_delta_rule, chunk_kda
from tests.support.reference import as_f64_leaves, make_problem, recurrent_delta_rule, rel_err

OPS = {"gdn": chunk_gated_delta_rule, "kda": chunk_kda}
OUT_TOL, GRAD_TOL = 1e-5, 1e-4

# (id, kinds, make_problem keywords). Packed lengths: 1, 65, 130 (> 2 chunks, not a multiple of 64), 3.
CASES = [
    ("gva_batch_h0", ("gdn", "kda"), dict(B=2, T=37, H=2, HV=4, K=16, V=8, initial_state=True)),
    ("gva_no_h0_scale", ("gdn", "kda"), dict(B=2, T=29, H=1, HV=3, K=8, V=12, scale=0.37)),
    ("packed_h0", ("gdn", "kda"), dict(B=1, T=199, H=1, HV=2, K=8, V=8, cu_seqlens=[0, 1, 66, 196, 199],
                                       initial_state=True, l2norm_in_kernel=True, beta_sigmoid=True)),
    ("gates_in_kernel", ("gdn", "kda"), dict(B=2, T=70, H=1, HV=2, K=8, V=4, initial_state=True,
                                             l2norm_in_kernel=True, beta_sigmoid=True, gate_in_kernel=True)),
    ("gate_no_dt_bias", ("gdn", "kda"), dict(B=1, T=45, H=2, HV=2, K=8, V=8, gate_in_kernel=True,
                                             dt_bias=False, l2norm_in_kernel=True)),
    ("strong_forgetting", ("gdn", "kda"), dict(B=1, T=130, H=1, HV=2, K=8, V=8, forget="strong",
                                               initial_state=True)),
    ("weak_forgetting", ("gdn", "kda"), dict(B=1, T=150, H=1, HV=2, K=8, V=8, forget="weak",
                                             initial_state=True)),
    ("strong_gate_packed", ("gdn", "kda"), dict(B=1, T=140, H=1, HV=2, K=8, V=8, cu_seqlens=[0, 70, 71, 140],
                                                forget="strong", gate_in_kernel=True, initial_state=True,
                                                l2norm_in_kernel=True, beta_sigmoid=True)),
    # ~ -16 per step: the in-chunk cumulative decay reaches ~ -1000, where fp32 differences of it lose digits
    ("very_strong_gate", ("gdn", "kda"), dict(B=1, T=140, H=1, HV=2, K=8, V=8, cu_seqlens=[0, 70, 71, 140],
                                              forget="very_strong", gate_in_kernel=True, initial_state=True,
                                              l2norm_in_kernel=True, beta_sigmoid=True)),
    ("lower_bound", ("kda",), dict(B=1, T=90, H=1, HV=2, K=8, V=8, gate_in_kernel=True, lower_bound=-5.0,
                                   l2norm_in_kernel=True, beta_sigmoid=True, initial_state=True)),
    ("single_token_batch", ("gdn", "kda"), dict(B=3, T=1, H=1, HV=1, K=4, V=4, initial_state=True)),
    ("lower_bound_no_A_log", ("kda",), dict(B=2, T=33, H=1, HV=2, K=8, V=8, gate_in_kernel=True,
                                            lower_bound=-1.0, A_log=False, l2norm_in_kernel=True)),
]
PARAMS = [pytest.param(kind, kw, id=f"{kind}-{name}") for name, kinds, kw in CASES for kind in kinds]


def _cotangents(o_shape, s_shape, seed):
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(o_shape, generator=gen, dtype=torch.float64), torch.randn(s_shape, generator=gen,
                                                                                 dtype=torch.float64)


def _run_and_grad(fn, tensors, flags, do, dS):
    o, S = fn(**tensors, **flags, output_final_state=True)
    loss = (o.double() * do).sum() + (S.double() * dS).sum()
    names = list(tensors)
    grads = torch.autograd.grad(loss, [tensors[n] for n in names], allow_unused=True)
    return o, S, dict(zip(names, grads))


def _ours(kind):
    return lambda **kw: OPS[kind](**kw)


def _ref(kind):
    return lambda **kw: recurrent_delta_rule(kind, **kw)


def _compare(kind, tensors, flags, *, out_weight=1.0, seed=0):
    ref_tensors = as_f64_leaves(tensors)
    o_ref, S_ref = recurrent_delta_rule(kind, **ref_tensors, **flags)
    do, dS = _cotangents(o_ref.shape, S_ref.shape, seed)
    do = do * out_weight
    o, S, grads = _run_and_grad(_ours(kind), tensors, flags, do, dS)
    _, _, ref_grads = _run_and_grad(_ref(kind), ref_tensors, flags, do, dS)
    return (o, o_ref), (S, S_ref), {n: (grads[n], ref_grads[n]) for n in tensors}


@pytest.mark.parametrize("kind,kw", PARAMS)
def test_matches_reference(kind, kw):
    tensors, flags = make_problem(kind, **kw)
    before = {n: x.detach().clone() for n, x in tensors.items()}
    (o, o_ref), (S, S_ref), grads = _compare(kind, tensors, flags)
    for name, x in tensors.items():
        assert torch.equal(x.detach(), before[name]), f"{name} was modified in place"
    assert o.dtype == torch.float32 and o.shape == o_ref.shape
    assert S.dtype == torch.float32 and S.shape == S_ref.shape
    assert rel_err(o, o_ref) <= OUT_TOL, f"output rel err {rel_err(o, o_ref):.3e}"
    assert rel_err(S, S_ref) <= OUT_TOL, f"final state rel err {rel_err(S, S_ref):.3e}"
    errors = {}
    for name, (got, want) in grads.items():
        assert got is not None, f"no gradient for {name}"
        assert got.dtype == tensors[name].dtype and got.shape == tensors[name].shape, name
        errors[name] = rel_err(got, want)
    bad = {n: f"{e:.3e}" for n, e in errors.items() if not e <= GRAD_TOL}
    assert not bad, f"gradient rel err above {GRAD_TOL}: {bad}"


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_gradients_through_final_state_only(kind):
    """Loss on the final state alone: every input still gets the reference gradient."""
    tensors, flags = make_problem(kind, B=1, T=100, H=1, HV=2, K=8, V=8, cu_seqlens=[0, 3, 100],
                                  initial_state=True, gate_in_kernel=True, l2norm_in_kernel=True,
                                  beta_sigmoid=True, seed=3)
    _, _, grads = _compare(kind, tensors, flags, out_weight=0.0, seed=3)
    bad = {n: f"{rel_err(a, b):.3e}" for n, (a, b) in grads.items() if not rel_err(a, b) <= GRAD_TOL}
    assert not bad, bad


def test_kda_safe_gate_same_math():
    """safe_gate=True (FLA's tensor-core path, lower_bound in [-5, 0)) computes the same function."""
    tensors, flags = make_problem("kda", B=1, T=70, H=1, HV=2, K=8, V=8, gate_in_kernel=True, lower_bound=-5.0,
                                  l2norm_in_kernel=True, beta_sigmoid=True, initial_state=True, seed=9)
    o, S = chunk_kda(**tensors, **flags, safe_gate=True, output_final_state=True)
    o_ref, S_ref = recurrent_delta_rule("kda", **tensors, **flags)
    assert rel_err(o, o_ref) <= OUT_TOL and rel_err(S, S_ref) <= OUT_TOL


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_no_final_state_when_not_requested(kind):
    tensors, flags = make_problem(kind, B=1, T=10, initial_state=True)
    o, S = OPS[kind](**tensors, **flags)
    assert S is None
    o_ref, _ = recurrent_delta_rule(kind, **tensors, **flags)
    assert rel_err(o, o_ref) <= OUT_TOL


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_gradcheck_fp64(kind):
    """Our backward is the derivative of our forward (fp64, tiny packed GVA problem, gates in kernel)."""
    tensors, flags = make_problem(kind, B=1, T=7, H=1, HV=2, K=3, V=2, cu_seqlens=[0, 1, 7],
                                  initial_state=True, gate_in_kernel=True, l2norm_in_kernel=True,
                                  beta_sigmoid=True, seed=5)
    if kind == "kda":
        flags["lower_bound"] = -2.0
    names = list(tensors)
    inputs = tuple(tensors[n].detach().double().requires_grad_() for n in names)

    def fn(*xs):
        o, S = OPS[kind](**dict(zip(names, xs)), **flags, output_final_state=True)
        return o, S

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


def _split_flags(flags, cu_part):
    out = dict(flags)
    out["cu_seqlens"] = None if cu_part is None else torch.tensor(cu_part, dtype=torch.int64)
    return out


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("split", [64, 37, 1])
def test_split_and_chain_equals_one_run(kind, split):
    """Run [0, split) then [split, T) with the first final state as initial state: same outputs, final
    state and gradients (including through the handed-over state) as one run."""
    tensors, flags = make_problem(kind, B=2, T=150, H=1, HV=2, K=8, V=8, initial_state=True,
                                  gate_in_kernel=True, l2norm_in_kernel=True, beta_sigmoid=True, seed=7)
    op = OPS[kind]
    do, dS = _cotangents((2, 150, 2, 8), (2, 2, 8, 8), 7)
    o, S, grads = _run_and_grad(lambda **kw: op(**kw), tensors, flags, do, dS)

    seq = ("q", "k", "v", "g", "beta")
    head = {n: (x[:, :split] if n in seq else x) for n, x in tensors.items()}
    o1, S1 = op(**head, **flags, output_final_state=True)
    tail = {n: (x[:, split:] if n in seq else x) for n, x in tensors.items()}
    tail["initial_state"] = S1
    o2, S2 = op(**tail, **flags, output_final_state=True)
    oc = torch.cat([o1, o2], 1)
    assert rel_err(oc, o) <= OUT_TOL and rel_err(S2, S) <= OUT_TOL
    loss = (oc.double() * do).sum() + (S2.double() * dS).sum()
    chained = torch.autograd.grad(loss, list(tensors.values()))
    bad = {n: f"{rel_err(a, grads[n]):.3e}" for n, a in zip(tensors, chained) if not rel_err(a, grads[n]) <= GRAD_TOL}
    assert not bad, bad


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_split_and_chain_packed(kind):
    """Packed documents [0,1,66,196,199] cut at 100 (inside the third document): the second part starts
    with that document's state and zero states for the documents after it."""
    cu = [0, 1, 66, 196, 199]
    tensors, flags = make_problem(kind, B=1, T=199, H=1, HV=2, K=8, V=8, cu_seqlens=cu, initial_state=True,
                                  l2norm_in_kernel=True, seed=11)
    op = OPS[kind]
    o, S = op(**tensors, **flags, output_final_state=True)
    seq = ("q", "k", "v", "g", "beta")
    h0 = tensors.pop("initial_state")
    head = {n: x[:, :100] for n, x in tensors.items()}
    o1, S1 = op(**head, **_split_flags(flags, [0, 1, 66, 100]), initial_state=h0[:3], output_final_state=True)
    tail = {n: x[:, 100:] for n, x in tensors.items() if n in seq}
    tail.update({n: x for n, x in tensors.items() if n not in seq})
    h_tail = torch.cat([S1[2:3], h0[3:4]], 0)
    o2, S2 = op(**tail, **_split_flags(flags, [0, 96, 99]), initial_state=h_tail, output_final_state=True)
    assert rel_err(torch.cat([o1, o2], 1), o) <= OUT_TOL
    assert rel_err(torch.cat([S1[:2], S2], 0), S) <= OUT_TOL


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_keep_dtype(kind, dtype):
    tensors, flags = make_problem(kind, B=1, T=80, H=1, HV=2, K=16, V=16, initial_state=True,
                                  l2norm_in_kernel=True, beta_sigmoid=True, gate_in_kernel=True, dtype=dtype,
                                  seed=13)
    o, S = OPS[kind](**tensors, **flags, output_final_state=True)
    assert o.dtype == dtype and S.dtype == torch.float32
    o_ref, S_ref = recurrent_delta_rule(kind, **tensors, **flags)  # reference on the same rounded inputs
    assert rel_err(o, o_ref) <= 2e-2 and rel_err(S, S_ref) <= 2e-2
    (o.float().sum() + S.sum()).backward()
    for name, x in tensors.items():
        assert x.grad is not None and x.grad.dtype == x.dtype, name
        assert torch.isfinite(x.grad.float()).all(), name


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_reference_matches_transformers(kind):
    """Cross-check of the reference itself against transformers' chunked pure-PyTorch implementations."""
    if kind == "gdn":
        mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
        fn = getattr(mod.torch_chunk_gated_delta_rule, "__wrapped__", mod.torch_chunk_gated_delta_rule)
    else:
        mod = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
        fn = getattr(mod.chunk_kimi_delta_attention, "__wrapped__", mod.chunk_kimi_delta_attention)
    tensors, flags = make_problem(kind, B=2, T=70, H=2, HV=2, K=8, V=8, initial_state=True,
                                  l2norm_in_kernel=True, seed=17)
    t = {n: x.detach() for n, x in tensors.items()}
    o_ref, S_ref = recurrent_delta_rule(kind, **t, **flags)
    o, S = fn(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["initial_state"],
              output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(S, S_ref) <= 1e-5
