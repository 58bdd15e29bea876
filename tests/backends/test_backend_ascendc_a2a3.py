"""backend="ascendc" training on Ascend 910B (A2) and 910_93 (A3) through the fla-npu stand-in declared as those SoCs.

The stand-in refuses every operator whose op-def does not register the declared SoC (``REGISTERED_SOCS``, each
entry naming the revision and file read), so these cases run only what an A2 / A3 build has: GDN's backward on
fla-npu's building blocks (``layers/ops/ascendc/gdn_staged.py``) instead of the Ascend-950-only composite backward,
and GDN CP with w / u from ``recompute_w_u_fwd`` instead of the 950-only ``chunk_gated_delta_rule_fwd_prepare``.
Each case checks the forward and every input gradient against the eager backend (fp32 stand-in, the tolerances of
tests/backends/test_backend_ascendc.py) and which operators ran; the CP cases on these SoCs share that file's gloo
spawn (``A2A3_CP_CASES`` there). KDA trains there on fla-npu's monolithic ``chunk_kda_bwd``
(``layers/ops/ascendc/kda_fused.py``), without initial states or final-state gradients and with ``safe_gate`` only;
what it cannot take is one error naming the op and the alternative, before any kernel runs. Not run on Ascend
hardware.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from layers.ops import chunk_kda
from layers.ops.ascendc import runtime
from tests.support.ascendc_standin import (A5_ONLY_OPS, FUSED_KDA_BWD_OPS, KNOBS, OUT_TOL, REAL, STAGED_GDN_BWD_OPS,
                                           STANDIN, assert_close, compare, forget_fla_npu, install_standin)
from tests.support.reference import make_problem, rel_err

pytestmark = pytest.mark.skipif(REAL, reason="HP_ASCEND_REAL=1: these cases declare the SoC to the stand-in")

A2, A3 = "Ascend910B3", "Ascend910_9392"
K128 = dict(K=128, V=128)


@pytest.fixture
def on_soc(monkeypatch):
    monkeypatch.setattr(runtime, "DEVICE", runtime.DEVICE)
    monkeypatch.setattr(runtime, "KERNEL_DTYPES", runtime.KERNEL_DTYPES)
    yield lambda soc, **knobs: install_standin(soc=soc, **knobs)
    if STANDIN in sys.path:
        sys.path.remove(STANDIN)
    forget_fla_npu()
    for name in KNOBS:
        os.environ.pop(name, None)


SINGLE = [(A2, "dense_h0", dict(B=2, T=70, H=2, HV=2, initial_state=True, **K128)),
          (A3, "packed_gva_in_kernel", dict(B=1, T=100, H=1, HV=2, cu_seqlens=[0, 5, 70, 100], initial_state=True,
                                            l2norm_in_kernel=True, beta_sigmoid=True, gate_in_kernel=True, **K128))]


@pytest.mark.parametrize("soc,name,problem", SINGLE, ids=[f"{s}-{n}" for s, n, _ in SINGLE])
def test_gdn_trains_on_a2_a3(on_soc, soc, name, problem):
    """Forward, final state and every input gradient (incl. the initial state's, and a final-state cotangent
    through the dummy tokens) equal eager; the backward ran on the building blocks, no Ascend-950-only op."""
    standin = on_soc(soc)
    standin.CALLS.clear()
    errs, _ = compare("gdn", problem)
    assert_close(errs, kind="gdn")
    calls = set(standin.CALLS)
    assert STAGED_GDN_BWD_OPS <= calls and not calls & A5_ONLY_OPS, sorted(calls)


def test_a5_only_op_is_refused_on_a2(on_soc):
    """The stand-in plays the SoC's op set: the composite backward (registered for Ascend950 only) raises
    naming the op, the SoC and the source it was read from."""
    standin = on_soc(A2)
    x = torch.zeros(1, 64, 1, 128)
    with pytest.raises(RuntimeError, match=r"npu_chunk_gated_delta_rule_bwd: no kernel registered for Ascend910B3 "
                                           r"\(op-def registers Ascend950; 2a1b0ce9"):
        standin.chunk_gated_delta_rule_bwd(x, x, x, x[..., 0], x[..., 0], x, x, 1.0)


KDA_SINGLE = [(A2, "dense_in_kernel", dict(B=2, T=70, H=2, HV=2, l2norm_in_kernel=True, beta_sigmoid=True,
                                            gate_in_kernel=True, lower_bound=-5.0, **K128)),
              (A3, "packed_gva", dict(B=1, T=100, H=1, HV=2, cu_seqlens=[0, 5, 70, 100], gate_in_kernel=True,
                                      lower_bound=-4.0, **K128))]


@pytest.mark.parametrize("soc,name,problem", KDA_SINGLE, ids=[f"{s}-{n}" for s, n, _ in KDA_SINGLE])
def test_kda_trains_on_a2_a3(on_soc, soc, name, problem):
    """Forward and every input gradient (q, k, v, g, beta, A_log, dt_bias) equal eager; the backward ran on the
    monolithic chunk_kda_bwd, no Ascend-950-only op (dense with the in-kernel transforms; packed GVA)."""
    standin = on_soc(soc)
    standin.CALLS.clear()
    errs, _ = compare("kda", problem, safe_gate=True, final_state=False)
    assert_close(errs)
    assert set(errs) >= {"o", "dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias"}, errs
    calls = set(standin.CALLS)
    assert FUSED_KDA_BWD_OPS <= calls and not calls & A5_ONLY_OPS, sorted(calls)


def _kda_leaves(**extra):
    tensors, flags = make_problem("kda", B=1, T=100, H=1, HV=2, cu_seqlens=[0, 30, 100], gate_in_kernel=True,
                                  lower_bound=-5.0, **K128, **extra)
    return tensors, flags, {n: x.detach().clone().requires_grad_() for n, x in tensors.items()}


@pytest.mark.parametrize("soc", [A2, A3])
def test_kda_backward_limits_on_a2_a3(on_soc, soc):
    """What the monolithic backward cannot take is refused before any kernel runs, naming the op and the
    alternatives: an initial state, safe_gate=False, a final-state gradient (in the backward); a build without the
    export names it. Packed KDA inference with an initial state still runs there and equals eager."""
    standin = on_soc(soc)
    tensors, flags, leaves = _kda_leaves(initial_state=True)
    standin.CALLS.clear()
    with pytest.raises(RuntimeError, match=rf"on {soc}: KDA backward .*ChunkKdaBwd.*an initial_state.*'ulysses'"):
        chunk_kda(**leaves, **flags, safe_gate=True, backend="ascendc")
    _, flags2, leaves2 = _kda_leaves()
    with pytest.raises(RuntimeError, match=r"safe_gate=False.*backend='eager'"):
        chunk_kda(**leaves2, **flags2, backend="ascendc")
    assert standin.CALLS == []
    o, S = chunk_kda(**leaves2, **flags2, safe_gate=True, output_final_state=True, backend="ascendc")
    with pytest.raises(RuntimeError, match="final-state gradient arrived.*takes no dht"):
        torch.autograd.grad((o.sum() + S.sum()), [leaves2["q"]])
    assert torch.autograd.grad(o.sum(), [leaves2["q"]])[0].abs().sum() > 0  # an unused final state is fine
    with torch.no_grad():
        o, S = chunk_kda(**tensors, **flags, safe_gate=True, output_final_state=True, backend="ascendc")
        o_ref, S_ref = chunk_kda(**tensors, **flags, safe_gate=True, output_final_state=True, backend="eager")
    assert rel_err(o, o_ref) <= OUT_TOL and rel_err(S, S_ref) <= OUT_TOL
    on_soc(soc, kda_fused_bwd_exported=False)
    with pytest.raises(RuntimeError, match=r"kda_fused_bwd.*chunk_kda_bwd \(missing\).*7a8a59a3"):
        chunk_kda(**leaves2, **flags2, safe_gate=True, backend="ascendc")


def test_fused_kda_bwd_contract(on_soc):
    """The stand-in's chunk_kda_bwd refuses what the real wrapper refuses (initial_state / dht, safe_gate=False,
    GVA-shaped v, head-first h) and registers A2 (op-def ChunkKdaBwd at 7a8a59a3)."""
    standin = on_soc(A2)
    B, T, H = 1, 64, 1
    x, xv = torch.zeros(B, H, T, 128), torch.zeros(B, H, T, 128)
    a, b, h = torch.zeros(B, H, T, 64), torch.zeros(B, H, T), torch.zeros(B, 1, H, 128, 128)
    args = (x, x, xv, b, x, a, a, x, x, x, xv, h, xv, 1.0)
    for kwargs, message in (({"initial_state": h[:, 0]}, "initial_state and dht"), ({"safe_gate": False},
                            "safe_gate=False"), ({"disable_recompute": False}, "disable_recompute")):
        with pytest.raises(RuntimeError, match=message):
            standin.chunk_kda_bwd(*args, **kwargs)
    with pytest.raises(RuntimeError, match="v must share q's"):
        standin.chunk_kda_bwd(x, x, torch.zeros(B, 2, T, 128), *args[3:])
    with pytest.raises(RuntimeError, match="h must have shape"):
        standin.chunk_kda_bwd(*args[:11], torch.zeros(B, H, 2, 128, 128), *args[12:])
    out = standin.chunk_kda_bwd(*args)
    assert len(out) == 8 and out[5] is None and out[0].dtype == torch.float32


@pytest.mark.parametrize("soc", [A2, A3])
def test_kda_layer_trains_on_a2_a3(single_rank, on_soc, soc):
    """The KimiDeltaAttention layer (safe gate, lower bound -5, GVA) with backend="ascendc" on a declared 910B /
    910_93: output, input gradient and every parameter gradient equal the eager layer's; the backward ran on
    chunk_kda_bwd."""
    from megatron.core.transformer import TransformerConfig

    from layers import KimiDeltaAttention

    standin = on_soc(soc)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               params_dtype=torch.float32, gradient_accumulation_fusion=False,
                               bias_dropout_fusion=False)
    layers = []
    for backend in ("ascendc", "eager"):
        torch.manual_seed(11)
        layers.append(KimiDeltaAttention(config, None, layer_number=1, backend=backend, num_key_heads=1,
                                         num_value_heads=2, key_head_dim=128, value_head_dim=128, lower_bound=-5.0,
                                         safe_gate=True))
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(70, 2, 32, generator=torch.Generator().manual_seed(7))
    dy = torch.randn(70, 2, 32, generator=torch.Generator().manual_seed(8))
    standin.CALLS.clear()
    results = []
    for layer in layers:
        xi = x.clone().requires_grad_()
        y, _ = layer(xi)
        params = [p for _, p in sorted(layer.named_parameters())]
        grads = torch.autograd.grad((y * dy).sum(), [xi, *params])
        results.append((y.detach(), grads))
    (y, g), (y_ref, g_ref) = results
    assert rel_err(y, y_ref) <= OUT_TOL
    assert max(rel_err(a, b) for a, b in zip(g, g_ref)) <= 1e-4
    assert "npu_chunk_kda_bwd" in standin.CALLS and not set(standin.CALLS) & A5_ONLY_OPS
