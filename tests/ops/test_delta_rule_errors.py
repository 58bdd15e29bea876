"""Every violated constraint of the public GDN/KDA ops raises ValueError/TypeError naming the constraint and
the offending values; unavailable optional backends raise RuntimeError naming the package."""
from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from layers.ops import chunk_gated_delta_rule, chunk_kda

B, T, H, HV, K, V = 1, 6, 2, 4, 4, 3


def _inputs(kind, **over):
    x = dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, HV, V),
             g=-torch.rand((B, T, HV) if kind == "gdn" else (B, T, HV, K)), beta=torch.rand(B, T, HV))
    x.update(over)
    return x


def _call(kind, **over):
    fn = chunk_gated_delta_rule if kind == "gdn" else chunk_kda
    tensors = {n: over.pop(n) for n in list(over) if n in ("q", "k", "v", "g", "beta")}
    return fn(**_inputs(kind, **tensors), **over)


# (id, kinds, overrides, exception, regex the message must match)
BAD = [
    ("q_not_tensor", "both", dict(q=[[1.0]]), TypeError, r"q must be a torch\.Tensor.*list"),
    ("q_ndim", "both", dict(q=torch.randn(T, H, K)), ValueError, r"q must have 4 dimensions.*\(6, 2, 4\)"),
    ("v_ndim", "both", dict(v=torch.randn(B, T, HV * V)), ValueError, r"v must have 4 dimensions"),
    ("q_int_dtype", "both", dict(q=torch.ones(B, T, H, K, dtype=torch.int64)), TypeError, r"q .*int64"),
    ("k_shape", "both", dict(k=torch.randn(B, T, H, K + 1)), ValueError,
     r"k must have shape \(1, 6, 2, 4\).*\(1, 6, 2, 5\)"),
    ("v_seq_len", "both", dict(v=torch.randn(B, T + 1, HV, V)), ValueError,
     r"v must have shape \[B=1, T=6.*\(1, 7, 4, 3\)"),
    ("qkv_dtypes", "both", dict(k=torch.randn(B, T, H, K, dtype=torch.float64)), TypeError,
     r"share one dtype.*float32.*float64"),
    ("head_divisibility", "both", dict(v=torch.randn(B, T, 3, V), g=None, beta=None), ValueError,
     r"HV=3.*multiple.*H=2"),
    ("g_shape_gdn", "gdn", dict(g=torch.randn(B, T, HV, K)), ValueError,
     r"g must have shape \(1, 6, 4\).*\(1, 6, 4, 4\)"),
    ("g_shape_kda", "kda", dict(g=torch.randn(B, T, HV)), ValueError, r"g must have shape \(1, 6, 4, 4\).*\(1, 6, 4\)"),
    ("g_not_tensor", "both", dict(g=0.5), TypeError, r"g must be a torch\.Tensor"),
    ("beta_shape", "both", dict(beta=torch.rand(B, T, H)), ValueError,
     r"beta must have shape \(1, 6, 4\).*\(1, 6, 2\)"),
    ("scale_zero", "both", dict(scale=0.0), ValueError, r"scale must be a positive finite number.*0\.0"),
    ("scale_negative", "both", dict(scale=-1), ValueError, r"scale must be a positive finite number.*-1"),
    ("scale_string", "both", dict(scale="0.5"), ValueError, r"scale must be a positive finite number.*'0\.5'"),
    ("scale_nan", "both", dict(scale=float("nan")), ValueError, r"scale must be a positive finite number.*nan"),
    ("lower_bound_nan", "kda", dict(use_gate_in_kernel=True, A_log=torch.zeros(HV), lower_bound=float("nan")),
     ValueError, r"lower_bound must be a negative finite number.*nan"),
    ("l2norm_flag_type", "both", dict(use_qk_l2norm_in_kernel="no"), TypeError,
     r"use_qk_l2norm_in_kernel must be a bool"),
    ("gate_flag_type", "both", dict(use_gate_in_kernel=1), TypeError, r"use_gate_in_kernel must be a bool"),
    ("empty_sequence", "both", dict(q=torch.randn(B, 0, H, K), k=torch.randn(B, 0, H, K), v=torch.randn(B, 0, HV, V),
                                    g=None, beta=torch.rand(B, 0, HV)), ValueError, r"every size >= 1"),
    ("output_final_state_type", "both", dict(output_final_state=1), TypeError,
     r"output_final_state must be a bool, got 1"),
    ("gate_without_A_log_gdn", "gdn", dict(use_gate_in_kernel=True), ValueError, r"use_gate_in_kernel=True.*A_log"),
    ("gate_without_A_log_kda", "kda", dict(use_gate_in_kernel=True), ValueError, r"use_gate_in_kernel=True.*A_log"),
    ("A_log_shape", "both", dict(use_gate_in_kernel=True, A_log=torch.zeros(HV + 1)), ValueError,
     r"A_log must have shape \(4,\).*\(5,\)"),
    ("dt_bias_shape_gdn", "gdn", dict(use_gate_in_kernel=True, A_log=torch.zeros(HV), dt_bias=torch.zeros(HV * K)),
     ValueError, r"dt_bias must have shape \(4,\).*\(16,\)"),
    ("dt_bias_shape_kda", "kda", dict(use_gate_in_kernel=True, A_log=torch.zeros(HV), dt_bias=torch.zeros(HV)),
     ValueError, r"dt_bias must have shape \(16,\).*\(4,\)"),
    ("A_log_without_gate", "both", dict(A_log=torch.zeros(HV)), ValueError, r"A_log/dt_bias.*use_gate_in_kernel"),
    ("dt_bias_without_gate", "gdn", dict(dt_bias=torch.zeros(HV)), ValueError, r"A_log/dt_bias.*use_gate_in_kernel"),
    ("lower_bound_positive", "kda", dict(use_gate_in_kernel=True, A_log=torch.zeros(HV), lower_bound=1.0), ValueError,
     r"lower_bound must be a negative finite number.*1\.0"),
    ("lower_bound_without_gate", "kda", dict(lower_bound=-5.0), ValueError, r"lower_bound requires use_gate_in_kernel"),
    ("safe_gate_without_bound", "kda", dict(use_gate_in_kernel=True, A_log=torch.zeros(HV), safe_gate=True),
     ValueError, r"safe_gate=True requires lower_bound in \[-5, 0\).*None"),
    ("safe_gate_bound_too_low", "kda", dict(use_gate_in_kernel=True, A_log=torch.zeros(HV), lower_bound=-6.0,
                                            safe_gate=True), ValueError, r"safe_gate.*-6\.0"),
    ("device_mismatch", "both", dict(use_gate_in_kernel=True, A_log=torch.zeros(HV, device="meta")), ValueError,
     r"one device.*meta"),
    ("cu_first_not_zero", "both", dict(cu_seqlens=torch.tensor([1, 3, 6])), ValueError, r"start at 0, got 1"),
    ("cu_last_not_T", "both", dict(cu_seqlens=torch.tensor([0, 3, 5])), ValueError, r"end at .*T=6, got 5"),
    ("cu_not_increasing", "both", dict(cu_seqlens=torch.tensor([0, 3, 3, 6])), ValueError,
     r"strictly increasing.*\[0, 3, 3, 6\]"),
    ("cu_decreasing", "both", dict(cu_seqlens=torch.tensor([0, 4, 2, 6])), ValueError,
     r"strictly increasing.*\[0, 4, 2, 6\]"),
    ("cu_float_dtype", "both", dict(cu_seqlens=torch.tensor([0.0, 6.0])), TypeError,
     r"cu_seqlens must be int32 or int64.*float32"),
    ("cu_float_list", "both", dict(cu_seqlens=[0, 2.5, 6]), TypeError, r"cu_seqlens must hold integers"),
    ("cu_bad_type", "both", dict(cu_seqlens="0,6"), TypeError, r"cu_seqlens must be a tensor or a list of ints.*str"),
    ("cu_2d", "both", dict(cu_seqlens=torch.tensor([[0, 6]])), ValueError, r"cu_seqlens must be 1-D.*\(1, 2\)"),
    ("cu_single_entry", "both", dict(cu_seqlens=torch.tensor([0])), ValueError, r"at least 2 entries"),
    ("state_shape", "both", dict(initial_state=torch.zeros(B, HV, V, K)), ValueError,
     r"initial_state must have shape \(1, 4, 4, 3\).*\(1, 4, 3, 4\)"),
    ("state_count_packed", "both", dict(cu_seqlens=torch.tensor([0, 2, 6]), initial_state=torch.zeros(1, HV, K, V)),
     ValueError, r"initial_state must have shape \(2, 4, 4, 3\).*\(1, 4, 4, 3\)"),
    ("state_dtype", "both", dict(initial_state=torch.zeros(B, HV, K, V, dtype=torch.int32)), TypeError,
     r"initial_state .*int32"),
    ("backend_name", "both", dict(backend="cuda"), ValueError, r"backend must be one of .*eager.*'cuda'"),
    ("backend_type", "both", dict(backend=None), ValueError, r"backend must be one of .*None"),
    ("cp_with_initial_state", "both", dict(cp_context=object(), initial_state=torch.zeros(B, HV, K, V)), ValueError,
     r"cp_context does not take initial_state.*initial_state=True"),
    ("cp_with_final_state", "both", dict(cp_context=object(), output_final_state=True), ValueError,
     r"cp_context does not take .*output_final_state=True"),
]
PARAMS = [pytest.param(kind, over, exc, msg, id=f"{kind}-{name}")
          for name, kinds, over, exc, msg in BAD for kind in (("gdn", "kda") if kinds == "both" else (kinds,))]


@pytest.mark.parametrize("kind,over,exc,msg", PARAMS)
def test_rejects_bad_input(kind, over, exc, msg):
    over = dict(over)
    if over.get("g", 0) is None:   # head-count case: g and beta follow the (bad) v head count
        hv = over["v"].shape[2]
        over["g"] = -torch.rand((B, T, hv) if kind == "gdn" else (B, T, hv, K))
        over["beta"] = torch.rand(B, T, hv)
    with pytest.raises(exc, match=msg):
        _call(kind, **over)


def test_packed_requires_batch_one():
    q = torch.randn(2, T, H, K)
    with pytest.raises(ValueError, match=r"batch size 1, got B=2"):
        chunk_gated_delta_rule(q, q.clone(), torch.randn(2, T, HV, V), -torch.rand(2, T, HV), torch.rand(2, T, HV),
                               cu_seqlens=torch.tensor([0, 2, 6]))


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_valid_baseline_runs(kind):
    """The base inputs of the cases above are valid: each error comes from the one override."""
    o, S = _call(kind, cu_seqlens=torch.tensor([0, 2, 6], dtype=torch.int32), initial_state=torch.zeros(2, HV, K, V),
                 output_final_state=True)
    assert o.shape == (B, T, HV, V) and S.shape == (2, HV, K, V)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="flash-linear-attention is installed")
def test_triton_backend_missing_package(kind):
    with pytest.raises(RuntimeError, match="flash-linear-attention"):
        _call(kind, backend="triton")


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.skipif(importlib.util.find_spec("fla_npu") is not None, reason="fla-npu is installed")
def test_ascendc_backend_missing_package(kind, monkeypatch):
    from layers.ops.ascendc import runtime

    # whatever an earlier test left loaded (tests/backends install the fla-npu stand-in), fla-npu is missing here
    for name in [n for n in sys.modules if n == "fla_npu" or n.startswith("fla_npu.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "fla_npu", None)
    runtime.load_ops.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="fla-npu"):
            _call(kind, backend="ascendc")
    finally:
        runtime.load_ops.cache_clear()
