"""The fla-npu stand-in (tests/fla_npu_standin) installed for the ascendc backend, and the ascendc-vs-eager comparison
shared by tests/backends' equality and contract tests."""
from __future__ import annotations

import os
import sys

import torch

from layers.ops import chunk_gated_delta_rule, chunk_kda
from layers.ops.ascendc import runtime
from tests.support.reference import make_problem, rel_err

STANDIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fla_npu_standin")
REAL = os.environ.get("HP_ASCEND_REAL") == "1"
OPS = {"gdn": chunk_gated_delta_rule, "kda": chunk_kda}
OUT_TOL, GRAD_TOL, BF16_TOL = 1e-5, 1e-4, 2e-2
# The composite GDN backward takes initial_state in bf16 only, even in an fp32 model (the terminal gradient enters
# as d_o of dummy tokens, in the model's dtype). Single-rank cases use bf16-representable values (exact
# conversion, fp32 tolerances); in GDN CP the entry states are computed inside, so the backward recomputes the
# forward from states rounded by at most u = 2^-9 (relative); gradients are smooth in h0, so their relative L2
# error is O(u): bound 4u = 7.8e-3 (measured 2.4e-3). Outputs keep OUT_TOL. KDA CP rounds only the summary's gk to
# bf16 and keeps GRAD_TOL (measured <= 6.5e-6).
BF16_STATE_TOL = 4 * 2.0 ** -9
# The composite GDN backward also returns dh0 in bf16 ("initial_state and dh0 must use the main BF16 dtype"):
# one rounding of the initial-state gradient, so GDN's d(initial_state) gets BF16_STATE_TOL too.


# The fla-npu building blocks GDN's backward runs on off Ascend 950 (layers/ops/ascendc/gdn_staged.py), as the
# stand-in records them, and the operators only Ascend 950 registers (the stand-in's REGISTERED_SOCS).
STAGED_GDN_BWD_OPS = {"npu_recompute_w_u_fwd", "npu_chunk_gated_delta_rule_fwd_h", "npu_chunk_bwd_dv_local",
                      "npu_chunk_gated_delta_rule_bwd_dhu", "npu_chunk_bwd_dqkwg", "npu_prepare_wy_repr_bwd_da",
                      "npu_prepare_wy_repr_bwd_full", "npu_chunk_local_cumsum"}
# KDA training off Ascend 950 (layers/ops/ascendc/kda_fused.py): the staged forward, the monolithic backward
FUSED_KDA_BWD_OPS = {"npu_chunk_kda_fwd_prepare", "npu_chunk_gated_delta_rule_fwd_h", "npu_chunk_kda_fwd_finalize",
                     "npu_chunk_kda_bwd"}
A5_ONLY_OPS = {"npu_chunk_gated_delta_rule_bwd", "npu_chunk_gated_delta_rule_fwd_prepare", "npu_chunk_kda_bwd_prepare",
               "npu_chunk_kda_bwd_finalize"}


class StandinDevice:
    """Answers the adapter's device questions for CPU tensors as if they lived on ``soc``."""

    def __init__(self, soc: str):
        self.soc = soc
        os.environ["FLA_NPU_STANDIN_SOC"] = soc  # the stand-in's operators check the same declared SoC

    def check_runtime(self) -> None:
        return None

    def name(self, device) -> str:
        return self.soc


def forget_fla_npu():
    for name in [n for n in sys.modules if n == "fla_npu" or n.startswith("fla_npu.")]:
        del sys.modules[name]
    runtime.load_ops.cache_clear()
    runtime.require_api.cache_clear()


KNOBS = ("FLA_NPU_STANDIN_SOC", "FLA_NPU_STANDIN_KDA_BWD_EXPORTED", "FLA_NPU_STANDIN_KDA_FUSED_BWD_EXPORTED",
         "FLA_NPU_STANDIN_DHU_USES_DHT", "FLA_NPU_STANDIN_H_LAYOUT", "FLA_NPU_STANDIN_RAW_WRAPPER")


def install_standin(soc: str = "Ascend950PR", fp32: bool = True, kda_bwd_exported: bool = True, *,
                    dht_honoured: bool = False, h_layout: str = "chunk_first", raw_wrapper: bool = False,
                    kda_fused_bwd_exported: bool = True):
    """Put the stand-in on sys.path and point the adapter at it (also used inside spawned workers), playing the
    fla-npu build the knobs describe (the stand-in's docstring): ``kda_bwd_exported`` a revision that exports
    the KDA backward stages (the pinned one does not), ``kda_fused_bwd_exported`` one that exports the monolithic
    ``chunk_kda_bwd`` (the KDA backward off Ascend 950), ``dht_honoured`` one whose reverse state pass honours
    ``dht`` (none read does), ``h_layout`` chunk-first or head-first chunk states, ``raw_wrapper`` exports whose
    signature reads ``(name: str)``. tests/backends/test_backend_ascendc_contract.py covers each."""
    if STANDIN not in sys.path:
        sys.path.insert(0, STANDIN)
    forget_fla_npu()
    os.environ["FLA_NPU_STANDIN_KDA_BWD_EXPORTED"] = "1" if kda_bwd_exported else "0"
    os.environ["FLA_NPU_STANDIN_KDA_FUSED_BWD_EXPORTED"] = "1" if kda_fused_bwd_exported else "0"
    os.environ["FLA_NPU_STANDIN_DHU_USES_DHT"] = "1" if dht_honoured else "0"
    os.environ["FLA_NPU_STANDIN_H_LAYOUT"] = h_layout
    os.environ["FLA_NPU_STANDIN_RAW_WRAPPER"] = "1" if raw_wrapper else "0"
    import fla_npu.ops.ascendc as standin

    standin.ALLOW_FP32 = fp32
    runtime.KERNEL_DTYPES = {k: runtime.KERNEL_DTYPES_REAL[k] + ((torch.float32,) if fp32 else ())
                             for k in ("gdn", "kda")}
    runtime.DEVICE = StandinDevice(soc)
    return standin


def default_device():
    return "npu" if REAL else "cpu"


def compare(kind, problem, *, soc_dtype=torch.float32, safe_gate=False, device=None, final_state=True):
    """Errors of ascendc (inputs in soc_dtype) vs eager (fp32 copies of the same values): o, final, grads.
    ``final_state=False``: no final state and no final-state cotangent (KDA's backward off Ascend 950 takes no
    ``dht``)."""
    device = device or default_device()
    tensors, flags = make_problem(kind, **problem)
    extra = {"safe_gate": safe_gate} if kind == "kda" else {}
    # initial_state and the final-state cotangent are bf16-representable: fla-npu's GDN backward takes them in
    # bf16, and with these values that conversion is exact, so fp32 runs keep the fp32 tolerances
    tensors = {n: x.bfloat16().float() if n == "initial_state" else x for n, x in tensors.items()}
    low = {n: x.detach().to(device, torch.float32 if n in ("initial_state", "A_log", "dt_bias") else soc_dtype)
           .requires_grad_() for n, x in tensors.items()}
    ref = {n: x.detach().float().requires_grad_() for n, x in low.items()}
    gen = torch.Generator().manual_seed(3)
    B, T, HV, V = tensors["v"].shape
    N = B if flags.get("cu_seqlens") is None else flags["cu_seqlens"].numel() - 1
    do = torch.randn(B, T, HV, V, generator=gen).to(device)
    dS = torch.randn(N, HV, tensors["q"].shape[-1], V, generator=gen).bfloat16().float().to(device)
    out, out_dtype = {}, None
    for name, backend, leaves in (("ascendc", "ascendc", low), ("eager", "eager", ref)):
        o, S = OPS[kind](**leaves, **flags, output_final_state=final_state, backend=backend, **extra)
        out_dtype = out_dtype or o.dtype
        loss = (o.float() * do).sum() + ((S * dS).sum() if final_state else 0.0)
        grads = torch.autograd.grad(loss, list(leaves.values()))
        out[name] = (o.float(), S, dict(zip(leaves, grads)))
    (o, S, g), (o_ref, S_ref, g_ref) = out["ascendc"], out["eager"]
    errs = {"o": rel_err(o, o_ref)}
    if final_state:
        errs["final_state"] = rel_err(S, S_ref)
    errs.update({f"d{n}": rel_err(g[n], g_ref[n]) for n in g})
    return errs, out_dtype


def assert_close(errs, out_tol=OUT_TOL, grad_tol=GRAD_TOL, kind=None):
    """Every error within its tolerance (GDN's d(initial_state): at least BF16_STATE_TOL, see above)."""
    def tol(name):
        if name in ("o", "final_state"):
            return out_tol
        return max(grad_tol, BF16_STATE_TOL) if kind == "gdn" and name == "dinitial_state" else grad_tol
    bad = {k: v for k, v in errs.items() if v > tol(k)}
    assert not bad, errs
