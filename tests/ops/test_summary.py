"""Affine segment summaries (S_out = M S_in + E) against the fp64 per-token reference.

M must equal the product of the per-token transitions, E the end state from zero, so that any incoming
state S_in reproduces the run's final state; summaries compose like running the segments back to back, and
the adjoint M^T dS_out is the gradient the run carries to its initial state.
"""
from __future__ import annotations

import pytest
import torch

from layers.ops.delta_rule import chunk_gated_delta_rule, chunk_kda
from layers.ops.summary import apply_summary, segment_summary
from tests.support.reference import as_f64_leaves, make_problem, recurrent_delta_rule, rel_err, transition_product


def compose_summaries(later, earlier):
    """Summary of running ``earlier`` then ``later``: (M2 M1, M2 E1 + E2)."""
    (M2, E2), (M1, E1) = later, earlier
    return M2 @ M1, M2 @ E1 + E2


def summary_adjoint(M: torch.Tensor, dS_out: torch.Tensor) -> torch.Tensor:
    """Gradient carried to S_in by a segment: M^T dS_out."""
    return M.transpose(-1, -2) @ dS_out


OPS = {"gdn": chunk_gated_delta_rule, "kda": chunk_kda}
TOL = 1e-5
# A transition M is a product of contractions, small by cancellation (norm ~1e-3 after 150 weakly forgetting
# steps); the chunked WY form builds it as Diag(e^gamma_C) - Kt^T W per chunk, measured at ~1e-5 relative
# to fp64 where a per-token fp32 product gets ~6e-7. Its effect on states is held to TOL below.
M_TOL = 3e-5
SUMMARY_FLAGS = ("use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "use_gate_in_kernel", "lower_bound",
                 "cu_seqlens")

CASES = [
    ("batch_gva", ("gdn", "kda"), dict(B=2, T=77, H=1, HV=2, K=8, V=6)),
    ("packed_gates", ("gdn", "kda"), dict(B=1, T=199, H=2, HV=4, K=8, V=8, cu_seqlens=[0, 1, 66, 196, 199],
                                          gate_in_kernel=True, l2norm_in_kernel=True, beta_sigmoid=True)),
    ("strong", ("gdn", "kda"), dict(B=1, T=130, H=1, HV=2, K=8, V=8, forget="strong")),
    ("weak", ("gdn", "kda"), dict(B=1, T=130, H=1, HV=2, K=8, V=8, forget="weak")),
    ("lower_bound", ("kda",), dict(B=1, T=70, H=1, HV=2, K=8, V=8, gate_in_kernel=True, lower_bound=-5.0,
                                   l2norm_in_kernel=True, beta_sigmoid=True)),
]
PARAMS = [pytest.param(kind, kw, id=f"{kind}-{name}") for name, kinds, kw in CASES for kind in kinds]


def _summary(kind, t, flags):
    kw = {n: flags[n] for n in SUMMARY_FLAGS if n in flags}
    return segment_summary(kind, t["k"], t["v"], t["g"], t["beta"], A_log=t.get("A_log"),
                           dt_bias=t.get("dt_bias"), **kw)


def _ref_kw(t, flags):
    kw = {n: flags[n] for n in SUMMARY_FLAGS if n in flags}
    return dict(kw, A_log=t.get("A_log"), dt_bias=t.get("dt_bias"))


def transition_err(M, M_ref):
    """Relative L2 error of a transition, with the denominator floored at 1e-4 of the identity's norm: a
    segment that forgets (almost) everything has M ~ 0 (fp32 underflow), which must then be ~0 absolutely."""
    floor = 1e-4 * M_ref.shape[-1] ** 0.5 * (M_ref[..., 0, 0].numel() ** 0.5)
    return float((M.double() - M_ref.double()).norm() / max(float(M_ref.double().norm()), floor))


def _random_state(N, HV, K, V, seed):
    return torch.randn(N, HV, K, V, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind,kw", PARAMS)
def test_summary_matches_reference(kind, kw):
    tensors, flags = make_problem(kind, **kw)
    t = {n: x.detach() for n, x in tensors.items()}
    M, E = _summary(kind, t, flags)
    N = kw["B"] if "cu_seqlens" not in kw else len(kw["cu_seqlens"]) - 1
    HV, K, V = kw["HV"], kw["K"], kw["V"]
    assert M.shape == (N, HV, K, K) and E.shape == (N, HV, K, V)
    assert M.dtype == torch.float32 and E.dtype == torch.float32

    M_ref = transition_product(kind, t["k"], t["g"], t["beta"], **_ref_kw(t, flags))
    _, E_ref = recurrent_delta_rule(kind, **t, **flags)
    assert transition_err(M, M_ref) <= M_TOL, f"M rel err {transition_err(M, M_ref):.3e}"
    assert rel_err(E, E_ref) <= TOL, f"E rel err {rel_err(E, E_ref):.3e}"
    for seed in (1, 2):  # any incoming state: the summary reproduces the run's final state
        S_in = _random_state(N, HV, K, V, seed) * (10.0 if seed == 2 else 1.0)
        _, S_ref = recurrent_delta_rule(kind, **t, **flags, initial_state=S_in)
        S_out = apply_summary(M, E, S_in)
        assert rel_err(S_out, S_ref) <= TOL, f"S_in seed {seed}: rel err {rel_err(S_out, S_ref):.3e}"
        _, S_op = OPS[kind](**t, **flags, initial_state=S_in, output_final_state=True)
        assert rel_err(S_out, S_op) <= TOL


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("cuts", [(64,), (37, 101), (1, 2, 130)])
@pytest.mark.parametrize("forget", ["weak", "mixed"])
def test_compose_equals_summary_of_concatenation(kind, cuts, forget):
    tensors, flags = make_problem(kind, B=2, T=150, H=1, HV=2, K=8, V=8, gate_in_kernel=True, forget=forget,
                                  l2norm_in_kernel=True, beta_sigmoid=True, seed=21)
    t = {n: x.detach() for n, x in tensors.items()}
    whole = _summary(kind, t, flags)
    seq = ("q", "k", "v", "g", "beta")
    bounds = (0,) + cuts + (150,)
    acc = None
    for s, e in zip(bounds[:-1], bounds[1:]):
        part = {n: (x[:, s:e] if n in seq else x) for n, x in t.items()}
        summ = _summary(kind, part, flags)
        acc = summ if acc is None else compose_summaries(summ, acc)
    assert transition_err(acc[0], whole[0]) <= M_TOL, f"M rel err {transition_err(acc[0], whole[0]):.3e}"
    assert rel_err(acc[1], whole[1]) <= TOL, f"E rel err {rel_err(acc[1], whole[1]):.3e}"
    S_in = _random_state(2, 2, 8, 8, 5)
    _, S_ref = recurrent_delta_rule(kind, **t, **flags, initial_state=S_in)
    assert rel_err(apply_summary(*acc, S_in), S_ref) <= TOL


def test_compose_is_associative():
    gen = torch.Generator().manual_seed(3)
    s = [(torch.randn(2, 3, 4, 4, generator=gen), torch.randn(2, 3, 4, 5, generator=gen)) for _ in range(3)]
    left = compose_summaries(s[2], compose_summaries(s[1], s[0]))
    right = compose_summaries(compose_summaries(s[2], s[1]), s[0])
    M_expected = s[2][0] @ s[1][0] @ s[0][0]
    E_expected = s[2][0] @ (s[1][0] @ s[0][1] + s[1][1]) + s[2][1]
    for got in (left, right):
        assert rel_err(got[0], M_expected) <= 1e-6 and rel_err(got[1], E_expected) <= 1e-6


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_adjoint_matches_autograd(kind):
    """summary_adjoint(M, dS_out) is d<dS_out, S_out>/dS_in, both of apply_summary and of the reference run."""
    tensors, flags = make_problem(kind, B=1, T=100, H=1, HV=2, K=8, V=4, cu_seqlens=[0, 30, 100],
                                  gate_in_kernel=True, l2norm_in_kernel=True, seed=23)
    t = {n: x.detach() for n, x in tensors.items()}
    M, E = _summary(kind, t, flags)
    gen = torch.Generator().manual_seed(4)
    S_in = torch.randn(2, 2, 8, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    dS_out = torch.randn(2, 2, 8, 4, generator=gen)
    got = summary_adjoint(M, dS_out)
    assert got.shape == S_in.shape
    _, S_ref = recurrent_delta_rule(kind, **as_f64_leaves(t), **flags, initial_state=S_in)
    (want,) = torch.autograd.grad(S_ref, S_in, dS_out.double())
    assert rel_err(got, want) <= TOL
    S_in32 = S_in.detach().float().requires_grad_()
    (via_apply,) = torch.autograd.grad(apply_summary(M, E, S_in32), S_in32, dS_out)
    assert rel_err(got, via_apply) <= 1e-6
