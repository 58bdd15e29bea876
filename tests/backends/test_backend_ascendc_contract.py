"""Contract tests of issue 27: the fla-npu stand-in enforces the pinned revision's contracts, and the ascendc
backend meets them (one test group per item; item numbers follow docs/backends.md's table).

The stand-in's checks are tested directly (so it cannot drift back to permissive), then the backend is
tested through it: equality with eager where the item is fixed, a clear error where it is a limit.
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
from tests.support.ascendc_standin import (GRAD_TOL, OUT_TOL, STANDIN, StandinDevice, assert_close, compare,
                                          forget_fla_npu, install_standin)

pytestmark = pytest.mark.skipif(os.environ.get("HP_ASCEND_REAL") == "1", reason="targets the stand-in")
K128 = dict(K=128, V=128)
SCALE = 128 ** -0.5


@pytest.fixture
def pinned(monkeypatch):
    """The stand-in as the pinned revision ships it (KDA backward stages not exported), fp32 allowed."""
    for name in ("FLA_NPU_STANDIN_SOC", "FLA_NPU_STANDIN_KDA_BWD_EXPORTED", "FLA_NPU_STANDIN_DHU_USES_DHT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(runtime, "DEVICE", runtime.DEVICE)
    monkeypatch.setattr(runtime, "KERNEL_DTYPES", runtime.KERNEL_DTYPES)
    module = install_standin(kda_bwd_exported=False)
    yield module
    for name in ("FLA_NPU_STANDIN_SOC", "FLA_NPU_STANDIN_KDA_BWD_EXPORTED"):
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
def test_11_gdn_cp_needs_ascend950(pinned, monkeypatch):
    from layers.cp.ascendc import state_passing_cp

    _soc(monkeypatch, "Ascend910B3")
    ctx = types.SimpleNamespace(state_method="p2p")
    plan = types.SimpleNamespace(local_cu_seqlens=torch.tensor([0, 16]))
    x = torch.zeros(1, 16, 1, 128)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"on Ascend910B3: chunk_gated_delta_rule_fwd_prepare "
                                        r"\(GDN CP summaries\) needs Ascend 950: use cp_method='ulysses'"):
        state_passing_cp("gdn", ctx, plan, x, x, x, x[..., 0], x[..., 0], scale=SCALE, flags={})


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
