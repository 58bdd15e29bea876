"""backend="ascendc" training on Ascend 910B (A2) and 910_93 (A3) through the fla-npu stand-in declared as those SoCs.

The stand-in refuses every operator whose op-def does not register the declared SoC (``REGISTERED_SOCS``, each
entry naming the revision and file read), so these cases run only what an A2 / A3 build has: GDN's backward on
fla-npu's building blocks (``layers/ops/ascendc/gdn_staged.py``) instead of the Ascend-950-only composite backward,
and GDN CP with w / u from ``recompute_w_u_fwd`` instead of the 950-only ``chunk_gated_delta_rule_fwd_prepare``.
Each case checks the forward and every input gradient against the eager backend (fp32 stand-in, the tolerances of
tests/backends/test_backend_ascendc.py) and which operators ran; the CP cases on these SoCs share that file's gloo
spawn (``A2A3_CP_CASES`` there). KDA's backward stays refused there (its backward
stages register Ascend 950 only): one error naming the op and the alternative, before any kernel runs. Not run on
Ascend hardware.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from layers.ops import chunk_kda
from layers.ops.ascendc import runtime
from tests.support.ascendc_standin import (A5_ONLY_OPS, KNOBS, OUT_TOL, REAL, STAGED_GDN_BWD_OPS, STANDIN,
                                           assert_close, compare, forget_fla_npu, install_standin)
from tests.support.reference import make_problem, rel_err

pytestmark = pytest.mark.skipif(REAL, reason="HP_ASCEND_REAL=1: these cases declare the SoC to the stand-in")

A2, A3 = "Ascend910B3", "Ascend910_9392"
K128 = dict(K=128, V=128)


@pytest.fixture
def on_soc(monkeypatch):
    monkeypatch.setattr(runtime, "DEVICE", runtime.DEVICE)
    monkeypatch.setattr(runtime, "KERNEL_DTYPES", runtime.KERNEL_DTYPES)
    yield lambda soc: install_standin(soc=soc)
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


@pytest.mark.parametrize("soc", [A2, A3])
def test_kda_backward_refused_on_a2_a3(on_soc, soc):
    """KDA's backward stages register Ascend 950 only: one RuntimeError naming them and the alternatives, raised
    before the forward runs; packed KDA inference still runs there and equals eager."""
    standin = on_soc(soc)
    tensors, flags = make_problem("kda", B=1, T=100, H=1, HV=2, cu_seqlens=[0, 30, 100], **K128)
    leaves = {n: x.detach().clone().requires_grad_() for n, x in tensors.items()}
    standin.CALLS.clear()
    with pytest.raises(RuntimeError, match=rf"on {soc}: KDA backward .*Ascend950 only.*backend='eager'"):
        chunk_kda(**leaves, **flags, backend="ascendc")
    assert standin.CALLS == []
    with torch.no_grad():
        o, S = chunk_kda(**tensors, **flags, output_final_state=True, backend="ascendc")
        o_ref, S_ref = chunk_kda(**tensors, **flags, output_final_state=True, backend="eager")
    assert rel_err(o, o_ref) <= OUT_TOL and rel_err(S, S_ref) <= OUT_TOL
    assert {"npu_chunk_kda_fwd_prepare", "npu_chunk_kda_fwd_finalize"} <= set(standin.CALLS)
