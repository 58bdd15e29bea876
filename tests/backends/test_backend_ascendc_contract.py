"""Contract tests of issues 27 and 33: the fla-npu stand-in enforces the real package's contracts, and the
ascendc backend meets them (one test group per item; item numbers follow docs/backends.md's tables: ``test_<n>``
for issue 27, ``test_33_<n>`` for issue 33).

The stand-in's checks are tested directly (so it cannot drift back to permissive), then the backend is
tested through it: equality with eager where the item is fixed, a clear error where it is a limit. Where
fla-npu revisions disagree (h / dh layout, dht honoured or not, which ops are exported, wrapped signatures), the
stand-in plays each build (its knobs) and the backend is tested against every one.
"""
from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from layers.ops import chunk_gated_delta_rule, chunk_kda
from layers.ops.ascendc import runtime
from tests.support.reference import make_problem, rel_err
from tests.support.ascendc_standin import (GRAD_TOL, KNOBS, OUT_TOL, STANDIN, StandinDevice, assert_close, compare,
                                           forget_fla_npu, install_standin)

pytestmark = pytest.mark.skipif(os.environ.get("HP_ASCEND_REAL") == "1", reason="targets the stand-in")
K128 = dict(K=128, V=128)
SCALE = 128 ** -0.5


@pytest.fixture
def pinned(monkeypatch):
    """The stand-in as the pinned revision ships it (KDA backward stages not exported), fp32 allowed."""
    for name in KNOBS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(runtime, "DEVICE", runtime.DEVICE)
    monkeypatch.setattr(runtime, "KERNEL_DTYPES", runtime.KERNEL_DTYPES)
    module = install_standin(kda_bwd_exported=False)
    yield module
    for name in KNOBS:
        os.environ.pop(name, None)
    if STANDIN in sys.path:
        sys.path.remove(STANDIN)
    forget_fla_npu()


@pytest.fixture
def later(pinned):
    """A later revision: the same stand-in with the KDA backward stages exported."""
    return install_standin(kda_bwd_exported=True)


def _soc(monkeypatch, name):
    monkeypatch.setattr(runtime, "DEVICE", StandinDevice(name))


def _rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _gdn_inputs(T=64, H=1, dtype=torch.float32):
    q, k, v = (_rand(1, T, H, 128, dtype=dtype, seed=s) for s in (1, 2, 3))
    k = torch.nn.functional.normalize(k.float(), dim=-1).to(dtype)
    return q, k, v, -0.1 * _rand(1, T, H, seed=4).abs(), torch.sigmoid(_rand(1, T, H, seed=5))


# ---------------------------------------------------------------------- 1: exports of the pinned revision
def test_1_export_table_and_short_names(pinned):
    assert "npu_chunk_kda_bwd_prepare" not in pinned._ASCENDC_OPS
    assert not hasattr(pinned, "chunk_kda_bwd_prepare") and not hasattr(pinned, "chunk_kda_bwd_finalize")
    for name in pinned._ASCENDC_OPS:
        assert getattr(pinned, name) is getattr(pinned, name[4:])


def test_1_kda_forward_runs_without_backward_exports(pinned):
    tensors, flags = make_problem("kda", B=1, T=70, H=1, HV=1, **K128)
    with torch.no_grad():
        o, _ = chunk_kda(**tensors, **flags, backend="ascendc")
        o_ref, _ = chunk_kda(**tensors, **flags, backend="eager")
    assert rel_err(o, o_ref) <= OUT_TOL


def test_1_kda_backward_names_missing_exports(pinned):
    tensors, flags = make_problem("kda", B=1, T=16, H=1, HV=1, **K128)
    leaves = {n: x.requires_grad_() for n, x in tensors.items()}
    with pytest.raises(RuntimeError, match=r"chunk_kda_bwd_prepare \(missing\).*export npu_chunk_kda_bwd_prepare"):
        chunk_kda(**leaves, **flags, backend="ascendc")


# ------------------------------------------------------------------- 2 / 5: composite forward's slots
def test_2_5_composite_forward_slots(pinned):
    q, k, v, g, beta = _gdn_inputs()
    out = pinned.chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=SCALE, layout="BSND")
    assert out[4] is None                                   # beta_eff only with the in-kernel sigmoid
    assert tuple(out[2].shape) == (1, 64, 1)                # g_cumsum token-major [B,T,HV]
    out = pinned.chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=SCALE, layout="BSND",
                                            use_beta_sigmoid_in_kernel=True)
    assert tuple(out[4].shape) == (1, 64, 1)


def test_5_dv_local_takes_head_major_gate(pinned):
    q, k, v, g, _ = _gdn_inputs(T=64, H=2)
    hm = [x.transpose(1, 2).contiguous() for x in (q, k, v)]
    with pytest.raises(RuntimeError, match=r"g must be \[B,HV,T\]"):
        pinned.chunk_bwd_dv_local(*hm, g, SCALE, 64)
    pinned.chunk_bwd_dv_local(*hm, g.transpose(1, 2).contiguous(), SCALE, 64)


@pytest.mark.parametrize("sigmoid", [False, True])
def test_2_7_gdn_backward_with_and_without_in_kernel_sigmoid(pinned, sigmoid):
    errs, _ = compare("gdn", dict(B=1, T=70, H=1, HV=1, beta_sigmoid=sigmoid, **K128))
    assert max(errs.values()) <= GRAD_TOL, errs


# ------------------------------------------------------------------------- 3 / 7: backward dtypes
def test_3_composite_backward_demands_bf16_states(pinned):
    q, k, v, g, beta = _gdn_inputs()
    fwd = pinned.chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=SCALE, layout="BSND")
    state = torch.zeros(1, 1, 128, 128)
    for name in ("initial_state", "dht"):
        with pytest.raises(RuntimeError, match=f"{name} must be bfloat16"):
            pinned.chunk_gated_delta_rule_bwd(q, k, v, fwd[2], beta, fwd[3], torch.ones_like(v), SCALE,
                                              layout="BSND", **{name: state})
    grads = pinned.chunk_gated_delta_rule_bwd(q, k, v, fwd[2], beta, fwd[3], torch.ones_like(v), SCALE,
                                              layout="BSND", initial_state=state.bfloat16(), dht=state.bfloat16())
    assert grads[5] is not None                             # dh0


def test_7_beta_raw_needs_beta_dtype(pinned):
    q, k, v, g, beta = _gdn_inputs()
    fwd = pinned.chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=SCALE, layout="BSND",
                                            use_beta_sigmoid_in_kernel=True)
    with pytest.raises(RuntimeError, match="beta_raw must be given with beta's dtype"):
        pinned.chunk_gated_delta_rule_bwd(q, k, v, fwd[2], fwd[4], fwd[3], torch.ones_like(v), SCALE, layout="BSND",
                                          beta_raw=beta.bfloat16(), use_beta_sigmoid_in_kernel=True)


# ------------------------------------------------------------------------------ 4: chunk_indices
def test_4_cu_seqlens_needs_chunk_indices(pinned):
    q, k, v, g, beta = _gdn_inputs(T=100)
    cu = [0, 30, 100]
    with pytest.raises(RuntimeError, match="chunk_indices must be provided together"):
        pinned.chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=SCALE, cu_seqlens=cu, layout="TND")
    with pytest.raises(RuntimeError, match="canonical"):
        pinned.chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=SCALE, cu_seqlens=cu, chunk_indices=[0, 0],
                                          layout="TND")
    assert runtime.chunk_indices(cu) == [0, 0, 1, 0, 1, 1]
    pinned.chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=SCALE, cu_seqlens=cu,
                                      chunk_indices=runtime.chunk_indices(cu), layout="TND")
    hm = [x.transpose(1, 2).contiguous() for x in (q, k, v)]
    with pytest.raises(RuntimeError, match="chunk_indices must be provided together"):
        pinned.chunk_bwd_dv_local(*hm, g.transpose(1, 2).contiguous(), SCALE, 64, cu_seqlens=cu)
    with pytest.raises(RuntimeError, match=r"ceil\(T/64\)"):  # 2 chunks for T = 100, the sequences need 3
        pinned.chunk_gated_delta_rule_bwd_dhu(hm[0], hm[1], hm[1], hm[2], hm[2], SCALE, 64,
                                              g=g.transpose(1, 2).contiguous(), cu_seqlens=cu)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_4_6_packed_backend_matches_eager(later, kind):
    errs, _ = compare(kind, dict(B=1, T=100, H=1, HV=1, cu_seqlens=[0, 30, 100], initial_state=True, **K128))
    assert_close(errs, kind=kind)


# ----------------------------------------------------------------------------------- 6: rank-4 fwd_h
def test_6_fwd_h_is_rank4_only(pinned):
    x = _rand(1, 64, 128)
    with pytest.raises(RuntimeError, match="rank-4"):
        pinned.chunk_fwd_h(x, x, x, gk=torch.zeros(1, 64, 128), cu_seqlens=[0, 64], use_exp2=True)


# ----------------------------------------------------------------------------------- 8: CP summary gk
def test_8_backward_summary_gk_dtype(pinned):
    x = _rand(1, 1, 64, 128)
    with pytest.raises(RuntimeError, match="gk must be bfloat16/float16"):
        pinned.chunk_delta_h_bwd_preprocess(x, x, x, x, x, SCALE, 64, gk=torch.zeros(1, 1, 64, 128),
                                            cu_seqlens=[0, 64])
    pinned.chunk_delta_h_bwd_preprocess(x, x, x, x, x, SCALE, 64, gk=torch.zeros(1, 1, 64, 128).bfloat16(),
                                        cu_seqlens=[0, 64])


# ------------------------------------------------------------------------------------- 9: KDA gate
def test_9_kernel_gate_forms(pinned):
    x = _rand(1, 64, 1, 128)
    beta = torch.full((1, 64, 1), 0.5)
    A_log, g = torch.zeros(1), _rand(1, 64, 1, 128, seed=7)
    base = dict(layout="BSND", use_gate_in_kernel=True, A_log=A_log)
    softplus = pinned.chunk_kda_fwd_prepare(x, x, x, g, beta, SCALE, **base)[0]
    bounded = pinned.chunk_kda_fwd_prepare(x, x, x, g, beta, SCALE, lower_bound=-5.0, **base)[0]
    assert torch.equal(softplus, bounded)                   # without safe_gate the bound is ignored
    safe = pinned.chunk_kda_fwd_prepare(x, x, x, g, beta, SCALE, lower_bound=-5.0, safe_gate=True, **base)[0]
    assert not torch.equal(softplus, safe)
    with pytest.raises(RuntimeError, match="A_log must be float32"):
        pinned.chunk_kda_fwd_prepare(x, x, x, g, beta, SCALE, layout="BSND", use_gate_in_kernel=True,
                                     lower_bound=-5.0, safe_gate=True)


@pytest.mark.parametrize("safe_gate,lower_bound,A_log", [(False, -5.0, True), (False, None, True),
                                                          (True, -3.0, False)])
def test_9_backend_gate_matches_eager(later, safe_gate, lower_bound, A_log):
    errs, _ = compare("kda", dict(B=1, T=70, H=1, HV=1, gate_in_kernel=True, lower_bound=lower_bound,
                                  A_log=A_log, **K128), safe_gate=safe_gate)
    assert max(errs.values()) <= GRAD_TOL, errs


# -------------------------------------------------------------------------------- 10: dhu and dht
def test_10_pinned_dhu_ignores_dht(pinned, monkeypatch):
    x = _rand(1, 1, 64, 128)
    gk = torch.zeros(1, 1, 64, 128)
    args = (x, x, x, x, x, SCALE, 64)
    dht = _rand(1, 1, 128, 128, seed=9)
    plain = pinned.chunk_gated_delta_rule_bwd_dhu(*args, gK=gk, use_exp2=True)[0]
    assert torch.equal(plain, pinned.chunk_gated_delta_rule_bwd_dhu(*args, gK=gk, dht=dht, use_exp2=True)[0])
    monkeypatch.setenv("FLA_NPU_STANDIN_DHU_USES_DHT", "1")
    assert not torch.equal(plain, pinned.chunk_gated_delta_rule_bwd_dhu(*args, gK=gk, dht=dht, use_exp2=True)[0])


@pytest.mark.parametrize("uses_dht", ["0", "1"])
def test_10_kda_final_state_gradient_either_build(later, monkeypatch, uses_dht):
    monkeypatch.setenv("FLA_NPU_STANDIN_DHU_USES_DHT", uses_dht)
    errs, _ = compare("kda", dict(B=1, T=100, H=1, HV=2, cu_seqlens=[0, 5, 70, 100], initial_state=True, **K128))
    assert max(errs.values()) <= GRAD_TOL, errs


# ----------------------------------------------------------------------------------- 11: SoC, dtypes
def test_11_gdn_cp_on_a2_needs_the_building_blocks(pinned, monkeypatch):
    """Ascend 910B has no chunk_gated_delta_rule_fwd_prepare: GDN CP takes its w / u from recompute_w_u_fwd, so a
    build without that export is one error naming it (checked before any kernel runs)."""
    from layers.cp.ascendc import state_passing_cp

    _soc(monkeypatch, "Ascend910B3")
    for name in ("recompute_w_u_fwd", "npu_recompute_w_u_fwd"):
        monkeypatch.delattr(pinned, name)
    runtime.require_api.cache_clear()
    ctx = types.SimpleNamespace(state_method="p2p")
    plan = types.SimpleNamespace(local_cu_seqlens=torch.tensor([0, 16]))
    x = torch.zeros(1, 16, 1, 128)
    pinned.CALLS.clear()
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"\(gdn_staged_bwd\).*recompute_w_u_fwd \(missing\)"):
        state_passing_cp("gdn", ctx, plan, x, x, x, x[..., 0], x[..., 0], scale=SCALE, flags={})
    assert pinned.CALLS == []
    runtime.require_api.cache_clear()


@pytest.mark.parametrize("soc", ["Ascend910B3", "Ascend910_9391"])
def test_11_forward_on_a2_a3(pinned, monkeypatch, soc):
    """In-kernel L2 norm / sigmoid are 950-only: elsewhere they run in PyTorch; A3 gets BNSD."""
    _soc(monkeypatch, soc)
    tensors, flags = make_problem("gdn", B=1, T=100, H=1, HV=2, cu_seqlens=[0, 30, 100], l2norm_in_kernel=True,
                                  beta_sigmoid=True, **K128)
    with torch.no_grad():
        o, _ = chunk_gated_delta_rule(**tensors, **flags, backend="ascendc")
        o_ref, _ = chunk_gated_delta_rule(**tensors, **flags, backend="eager")
    assert rel_err(o, o_ref) <= OUT_TOL


def test_11_composite_gdn_is_bf16_only(pinned, monkeypatch):
    monkeypatch.setattr(runtime, "KERNEL_DTYPES", dict(runtime.KERNEL_DTYPES_REAL))
    tensors, flags = make_problem("gdn", B=1, T=16, H=1, HV=1, dtype=torch.float16, **K128)
    with pytest.raises(TypeError, match="bfloat16"):
        chunk_gated_delta_rule(**tensors, **flags, backend="ascendc")


# --------------------------------------------------------------------------------- 12: zero-length
def test_12_zero_length_pieces(pinned):
    q, k, v, g, beta = _gdn_inputs(T=64)
    cu = [0, 0, 64]
    with pytest.raises(RuntimeError, match="zero-length"):
        pinned.chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=SCALE, cu_seqlens=cu,
                                          chunk_indices=runtime.chunk_indices(cu), layout="TND")
    hm = [x.transpose(1, 2).contiguous() for x in (q, k, v)]
    gate = torch.zeros(1, 1, 64)
    with pytest.raises(RuntimeError, match="zero-length"):
        pinned.pre_process_fwd_kernel_merged(hm[1], hm[1], hm[2], g=gate, cu_seqlens=cu)
    with pytest.raises(RuntimeError, match="zero-length"):
        pinned.chunk_delta_h_bwd_preprocess(hm[0], hm[1], hm[1], hm[2], hm[2], SCALE, 64, g=gate,
                                            cu_seqlens=[10, 10])
    with pytest.raises(RuntimeError, match="must be positive"):
        pinned.merge_fwd_bwd_kernel(torch.zeros(1, 128, 128), torch.zeros(2, 1, 128, 256), 0, 1)


def test_12_backend_cp_names_zero_length_limit(pinned):
    """Does not arise from layers/cp/plan.py (empty documents are rejected; zigzag parts are len / 2P > 0);
    a plan with one gets a clear error instead of a kernel failure."""
    from layers.cp.ascendc import state_passing_cp

    ctx = types.SimpleNamespace(state_method="p2p")
    plan = types.SimpleNamespace(local_cu_seqlens=torch.tensor([0, 8, 8, 16]))
    x = torch.zeros(1, 16, 1, 128)
    with pytest.raises(ValueError, match="zero-length local pieces"):
        state_passing_cp("kda", ctx, plan, x, x, x, x, x[..., 0], scale=SCALE, flags={})


# ------------------------------------------------------------------------- 13: import and renames
def test_13_import_file_not_found_names_package(monkeypatch):
    """fla_npu's import looks for its OPP directory and can raise FileNotFoundError: a RuntimeError naming it."""
    import importlib

    real_import = importlib.import_module

    def failing(name, *args, **kwargs):
        if name == "fla_npu.ops.ascendc":
            raise FileNotFoundError("/usr/local/Ascend/opp/vendors/fla_npu: no such directory")
        return real_import(name, *args, **kwargs)
    forget_fla_npu()
    monkeypatch.setattr(importlib, "import_module", failing)
    with pytest.raises(RuntimeError, match="fla-npu .*FileNotFoundError"):
        runtime.load_ops()
    runtime.load_ops.cache_clear()


def test_13_version_and_summary_spellings(pinned, monkeypatch):
    assert not hasattr(pinned, "__version__") and runtime.version() == "26.6.0+standin"
    assert runtime.require_api("cp") is pinned              # pinned spelling: chunk_delta_h_bwd_preprocess
    later_api = types.ModuleType("fla_npu.ops.ascendc")
    for name in pinned.__all__:
        setattr(later_api, name, getattr(pinned, name))
    later_api.pre_process_bwd_kernel_merged = later_api.chunk_delta_h_bwd_preprocess
    del later_api.chunk_delta_h_bwd_preprocess
    monkeypatch.setitem(sys.modules, "fla_npu.ops.ascendc", later_api)
    runtime.load_ops.cache_clear()
    runtime.require_api.cache_clear()
    ops = runtime.require_api("cp")
    assert runtime.op(ops, "pre_process_bwd_kernel_merged") is pinned.chunk_delta_h_bwd_preprocess
    del later_api.pre_process_bwd_kernel_merged
    runtime.require_api.cache_clear()
    with pytest.raises(RuntimeError, match="pre_process_bwd_kernel_merged / chunk_delta_h_bwd_preprocess"):
        runtime.require_api("cp")
    runtime.require_api.cache_clear()
    runtime.load_ops.cache_clear()


# ================================================================================================ issue 33
# ------------------------------------------------------- 33.1: the composite GDN backward ignores dht
def _composite_bwd_grads(standin, dht):
    q, k, v, g, beta = _gdn_inputs(T=70)
    fwd = standin.chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=SCALE, layout="BSND")
    return standin.chunk_gated_delta_rule_bwd(q, k, v, fwd[2], beta, fwd[3], torch.ones_like(v), SCALE,
                                              layout="BSND", dht=dht)[:5]


def test_33_1_composite_backward_ignores_dht(pinned, monkeypatch):
    dht = _rand(1, 1, 128, 128, seed=9).bfloat16()
    plain, with_dht = _composite_bwd_grads(pinned, None), _composite_bwd_grads(pinned, dht)
    assert all(torch.equal(a, b) for a, b in zip(plain, with_dht))     # like the kernel's (void)dht
    monkeypatch.setenv("FLA_NPU_STANDIN_DHU_USES_DHT", "1")
    assert not torch.equal(plain[1], _composite_bwd_grads(pinned, dht)[1])    # dk (the final state has no q)


@pytest.mark.parametrize("dht_honoured", [False, True])
@pytest.mark.parametrize("layout", ["dense", "packed"])
def test_33_1_gdn_final_state_gradient_either_build(pinned, dht_honoured, layout):
    """The final-state gradient reaches every input (dummy tokens), whether the build honours dht or not."""
    install_standin(dht_honoured=dht_honoured)
    problem = dict(B=2, T=70) if layout == "dense" else dict(B=1, T=100, cu_seqlens=[0, 5, 70, 100])
    errs, _ = compare("gdn", dict(H=1, HV=2, initial_state=True, l2norm_in_kernel=True, beta_sigmoid=True,
                                  **problem, **K128))
    assert_close(errs, kind="gdn")


# ------------------------------------------------------------------- 33.2: h / dh chunk-first or not
def test_33_2_chunk_state_layouts(pinned, monkeypatch):
    kg, w, u = (_rand(1, 2, 100, 128, seed=s) for s in (1, 2, 3))
    gk = -0.01 * _rand(1, 2, 100, 128, seed=4).abs()
    cu = [0, 30, 100]                                                   # 1 + 2 = 3 chunks, HV = 2
    h, v_new, _ = pinned.chunk_fwd_h(kg, w, u, gk=gk, cu_seqlens=cu, chunk_indices=runtime.chunk_indices(cu),
                                     use_exp2=True)
    assert tuple(h.shape) == (1, 3, 2, 128, 128)                        # chunk-first [B, NT, HV, K, V]
    aqk = torch.zeros(2, 100, 64)
    qg = _rand(2, 100, 128)
    pinned.chunk_kda_fwd_finalize(qg, aqk, v_new[0], h, output_layout="TND", cu_seqlens=cu)
    with pytest.raises(RuntimeError, match="h must have NT-first shape"):
        pinned.chunk_kda_fwd_finalize(qg, aqk, v_new[0], h.transpose(1, 2), output_layout="TND", cu_seqlens=cu)
    monkeypatch.setenv("FLA_NPU_STANDIN_H_LAYOUT", "head_first")
    h_hf = pinned.chunk_fwd_h(kg, w, u, gk=gk, cu_seqlens=cu, chunk_indices=runtime.chunk_indices(cu),
                              use_exp2=True)[0]
    assert torch.equal(h_hf, h.transpose(1, 2))


@pytest.mark.parametrize("h_layout", ["chunk_first", "head_first"])
@pytest.mark.parametrize("case", [
    pytest.param(dict(B=1, T=100, H=1, HV=3, cu_seqlens=[0, 30, 100]), id="real_chunks_eq_heads"),  # NT = HV = 3
    pytest.param(dict(B=1, T=64, H=1, HV=3), id="extended_chunks_eq_heads"),                      # 1 + 2 = HV
    pytest.param(dict(B=2, T=70, H=1, HV=1), id="dense"),
])
def test_33_2_kda_backend_either_layout(pinned, h_layout, case):
    """KDA with a final-state gradient (dummy chunks cut out of dh) against eager on both layouts, including
    the shapes where NT equals HV for the real or for the extended chunks."""
    install_standin(h_layout=h_layout)
    errs, _ = compare("kda", dict(initial_state=True, **case, **K128))
    assert_close(errs, kind="kda")


# -------------------------------------------------------------------- 33.3: composite o and d_o are BSND
def test_33_3_composite_o_and_d_o_are_bsnd(pinned):
    q, k, v, g, beta = _gdn_inputs(T=70, H=2)
    hm = [x.transpose(1, 2).contiguous() for x in (q, k, v)]
    o_bsnd, _, g_cumsum, A = pinned.chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=SCALE, layout="BSND")[:4]
    o_bnsd = pinned.chunk_gated_delta_rule_fwd(*hm, g, beta, scale=SCALE, layout="BNSD")[0]
    assert tuple(o_bnsd.shape) == (1, 70, 2, 128) and torch.allclose(o_bnsd, o_bsnd, atol=1e-6)
    with pytest.raises(RuntimeError, match=r"d_o must be BSND \[B,T,HV,V\]"):
        pinned.chunk_gated_delta_rule_bwd(*hm, g_cumsum, beta, A, torch.ones_like(hm[2]), SCALE, layout="BNSD")
    grads = pinned.chunk_gated_delta_rule_bwd(*hm, g_cumsum, beta, A, torch.ones_like(v), SCALE, layout="BNSD")
    assert tuple(grads[0].shape) == tuple(hm[0].shape)                 # dq/dk/dv follow the layout


def test_33_3_a3_forward_in_bnsd(pinned, monkeypatch):
    """Ascend 910_93 runs the composite forward in BNSD; o comes back BSND and must not be transposed again."""
    _soc(monkeypatch, "Ascend910_9391")
    tensors, flags = make_problem("gdn", B=2, T=70, H=2, HV=2, **K128)
    with torch.no_grad():
        o, _ = chunk_gated_delta_rule(**tensors, **flags, backend="ascendc")
        o_ref, _ = chunk_gated_delta_rule(**tensors, **flags, backend="eager")
    assert rel_err(o, o_ref) <= OUT_TOL


# ----------------------------------------------------------------------------- 33.4: KDA is bf16-only
def test_33_4_kda_fp16_is_a_clear_error(pinned, monkeypatch):
    monkeypatch.setattr(runtime, "KERNEL_DTYPES", dict(runtime.KERNEL_DTYPES_REAL))
    tensors, flags = make_problem("kda", B=1, T=16, H=1, HV=1, dtype=torch.float16, **K128)
    with pytest.raises(TypeError, match=r"KDA kernels take \['torch.bfloat16'\].*chunk_fwd_h.*has torch.float16"):
        chunk_kda(**tensors, **flags, backend="ascendc")
    x = _rand(1, 1, 64, 128).half()
    with pytest.raises(RuntimeError, match="k must be bfloat16"):
        pinned.chunk_fwd_h(x, x, x, gk=torch.zeros(1, 1, 64, 128), use_exp2=True)
    with pytest.raises(RuntimeError, match="qg_scaled must be bfloat16"):
        pinned.chunk_kda_fwd_finalize(x, torch.zeros(1, 1, 64, 64).half(), x, torch.zeros(1, 1, 1, 128, 128))


# ---------------------------------------------------------------------------- 33.5: dq_raw comes back fp32
def test_33_5_dq_raw_is_fp32(later):
    aqk, v_new, d_o = (_rand(1, 1, 64, s).bfloat16() for s in (64, 128, 128))
    h = torch.zeros(1, 1, 1, 128, 128).bfloat16()
    d_aqk, dv, dq_raw = later.chunk_kda_bwd_prepare(aqk, v_new, d_o, h, scale=SCALE)
    assert (d_aqk.dtype, dv.dtype, dq_raw.dtype) == (torch.float32, torch.bfloat16, torch.float32)
    x, hb = _rand(1, 1, 64, 128).bfloat16(), torch.zeros(1, 1, 1, 128, 128).bfloat16()
    args = [x, x, x, torch.zeros(1, 1, 64, 128), torch.zeros(1, 1, 64, 128), torch.rand(1, 1, 64), None, None,
            aqk, x, hb, hb, x, d_aqk, dq_raw]
    later.chunk_kda_bwd_finalize(*args, scale=SCALE)
    args[-1] = dq_raw.bfloat16()
    with pytest.raises(RuntimeError, match="dq_raw must be float32"):
        later.chunk_kda_bwd_finalize(*args, scale=SCALE)


# ---------------------------------------------------- 33.6: A_log fp32 [HV], dt_bias fp32 [HV*K], bound range
def test_33_6_kernel_gate_parameters(pinned):
    x, beta = _rand(1, 64, 2, 128), torch.full((1, 64, 2), 0.5)
    g = _rand(1, 64, 2, 128, seed=7)
    base = dict(layout="BSND", use_gate_in_kernel=True)
    pinned.chunk_kda_fwd_prepare(x, x, x, g, beta, SCALE, A_log=torch.zeros(2), dt_bias=torch.zeros(256),
                                 safe_gate=True, lower_bound=-5.0, **base)
    bad = [(dict(A_log=torch.zeros(2).bfloat16()), "A_log must be float32 \\[HV\\]"),
           (dict(A_log=torch.zeros(3)), "A_log must be float32 \\[HV\\]"),
           (dict(A_log=torch.zeros(2), dt_bias=torch.zeros(256).bfloat16()), "dt_bias must be float32"),
           (dict(A_log=torch.zeros(2), dt_bias=torch.zeros(2)), "dt_bias must be float32"),
           (dict(A_log=torch.zeros(2), safe_gate=True, lower_bound=-6.0), r"lower_bound must be in \[-5, 0\)"),
           (dict(A_log=torch.zeros(2), safe_gate=True, lower_bound=0.0), r"lower_bound must be in \[-5, 0\)")]
    for kwargs, message in bad:
        with pytest.raises(RuntimeError, match=message):
            pinned.chunk_kda_fwd_prepare(x, x, x, g, beta, SCALE, **kwargs, **base)


def test_33_6_backend_sends_fp32_gate_parameters(later):
    """A bf16 model's A_log / dt_bias reach the kernel in fp32 (the adapter converts), and the result is eager's."""
    tensors, flags = make_problem("kda", B=1, T=70, H=1, HV=2, gate_in_kernel=True, lower_bound=-4.0, **K128)
    for name in ("A_log", "dt_bias"):
        tensors[name] = tensors[name].bfloat16()
    with torch.no_grad():
        o, _ = chunk_kda(**tensors, **flags, safe_gate=True, backend="ascendc")
        o_ref, _ = chunk_kda(**tensors, **flags, safe_gate=True, backend="eager")
    assert rel_err(o, o_ref) <= OUT_TOL


# ----------------------------------------------------------------- 33.7: the KDA backward is Ascend 950 only
def test_33_7_kda_backward_needs_ascend950(later, monkeypatch):
    from layers.cp.ascendc import state_passing_cp

    _soc(monkeypatch, "Ascend910B3")
    x = torch.zeros(1, 64, 1, 128)
    with pytest.raises(RuntimeError, match="npu_chunk_kda_bwd_prepare: no kernel registered for Ascend910B3 .*"
                                           "chunk_kda_bwd_prepare_def.cpp"):
        later.chunk_kda_bwd_prepare(x[0].transpose(0, 1), x[0].transpose(0, 1), x[0].transpose(0, 1),
                                    torch.zeros(1, 1, 1, 128, 128), scale=SCALE)
    tensors, flags = make_problem("kda", B=1, T=16, H=1, HV=1, **K128)
    leaves = {n: t.requires_grad_() for n, t in tensors.items()}
    with pytest.raises(RuntimeError, match="on Ascend910B3: KDA backward .*register Ascend950 only"):
        chunk_kda(**leaves, **flags, backend="ascendc")
    ctx = types.SimpleNamespace(state_method="p2p")
    plan = types.SimpleNamespace(local_cu_seqlens=torch.tensor([0, 64]))
    with pytest.raises(RuntimeError, match="KDA backward"):
        state_passing_cp("kda", ctx, plan, x.requires_grad_(), x, x, x, x[..., 0], scale=SCALE, flags={})
    with torch.no_grad():                                                # the forward runs on A2/A3
        o, _ = chunk_kda(**tensors, **flags, backend="ascendc")
        o_ref, _ = chunk_kda(**tensors, **flags, backend="eager")
    assert rel_err(o, o_ref) <= OUT_TOL


# -------------------------------------------------- 33.9: versions, and signatures behind _make_raw_wrapper
def test_33_9_npu_extra_states_the_versions():
    import ast

    from layers.ops.ascendc import versions

    setup = ast.parse(open(os.path.join(os.path.dirname(__file__), "..", "..", "setup.py")).read())
    call = next(n for n in ast.walk(setup) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    extras = next(kw.value for kw in call.keywords if kw.arg == "extras_require")
    npu = next(v for k, v in zip(extras.keys, extras.values) if ast.literal_eval(k) == "npu")
    assert ast.literal_eval(npu) == versions.npu_requirements()
    fixed = ["2.7.1.post5", "2.8.0.post5", "2.9.0.post3", "2.10.0.post2", "2.11.0rc3", "2.11.0", "2.12.0rc1",
             "2.13.0", "2.14.1"]
    unfixed = ["2.6.0", "2.7.1", "2.7.1.post4", "2.8.0", "2.8.0.post4", "2.9.0.post2", "2.10.0.post1", "2.11.0rc2"]
    assert all(versions.torch_npu_has_stream_fix(v) for v in fixed)
    assert not any(versions.torch_npu_has_stream_fix(v) for v in unfixed)


def test_33_9_raw_wrapper_signatures(pinned, monkeypatch):
    """Exports wrapped by _make_raw_wrapper read ``(name: str)``: the check reads the implementation's signature
    from ASCENDC_CTYPES_OPS, so a good build passes and a missing keyword is still named."""
    import inspect

    raw = install_standin(raw_wrapper=True)
    assert list(inspect.signature(raw.chunk_kda_fwd_prepare).parameters) == ["name"]
    for feature in runtime.API:
        assert runtime.require_api(feature) is raw
    errs, _ = compare("gdn", dict(B=1, T=70, H=1, HV=1, **K128))
    assert_close(errs, kind="gdn")

    def older(q, k, v, g, beta, scale, chunk_size=64, *, layout="BSND", cu_seqlens=None):
        raise AssertionError("must not be called")
    monkeypatch.setitem(raw.ASCENDC_CTYPES_OPS, "npu_chunk_kda_fwd_prepare", older)
    runtime.require_api.cache_clear()
    with pytest.raises(RuntimeError, match=r"chunk_kda_fwd_prepare lacks parameters .*backward_mode"):
        runtime.require_api("kda")
    monkeypatch.delattr(raw, "ASCENDC_CTYPES_OPS")                    # implementation out of reach: not checked
    runtime.require_api.cache_clear()
    assert runtime.require_api("kda") is raw
    runtime.require_api.cache_clear()
