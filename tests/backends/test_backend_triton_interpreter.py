"""backend="triton" on CPU: flash-linear-attention's real kernels run by Triton's interpreter, against eager.

Each rank of one gloo spawn turns the interpreter on (tests/support/triton_interpreter.py) before FLA is imported, then
runs single-rank cases (split over the ranks) and every CP method on P=4 ranks, in fp32: outputs, final states
and every input gradient must match the eager op on the same values to fp32 round-off. This checks our mapping
onto FLA's API (GVA, packed documents, in-kernel gates, states, the conv cache layout) and both CP paths of the
triton backend (FLA's own KCP for allgather on its partitions; FLA's summary kernels with our exchange otherwise)
on every CI run; the GPU tests in
tests/backends/test_backend_triton.py check the same on compiled kernels in bf16. Skips when triton or FLA is missing.
"""
from __future__ import annotations


import pytest
import torch

from hp_megatron.selfcheck.gloo import accept_stacked_all_gather_on_gloo
from tests.support import triton_interpreter
from tests.support.delta_layer_cases import HALF_HEADS
from tests.support.dist import run_case, run_distributed_cases
from tests.support.triton_cases import compare_conv_single_rank, compare_single_rank, cp_case, cp_conv_case

WORLD = 4
TOL = 1e-4  # fp32 kernels vs fp32 eager (observed ~1e-6)
REASON = triton_interpreter.available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"triton interpreter tests: {REASON or ''}")

SINGLE_CASES = {
    "gdn-layer_flags": ("gdn", dict(B=2, T=100, H=2, HV=2, K=32, V=32, l2norm_in_kernel=True, beta_sigmoid=True,
                                    gate_in_kernel=True)),
    "gdn-variants": ("gdn", dict(B=1, T=150, H=2, HV=4, K=16, V=24, cu_seqlens=[0, 1, 70, 130, 150],
                                 initial_state=True)),
    "kda-layer_flags": ("kda", dict(B=2, T=100, H=2, HV=2, K=32, V=32, l2norm_in_kernel=True, beta_sigmoid=True,
                                    gate_in_kernel=True, lower_bound=-5.0)),
    "kda-variants": ("kda", dict(B=1, T=80, H=2, HV=4, K=16, V=24, cu_seqlens=[0, 1, 40, 70, 80],
                                 initial_state=True)),
}
CONV_CASES = ("conv-silu_batch", "conv-packed_history_bias")

# (name, layout, B, T, global cu_seqlens); zigzag THD documents are multiples of 2P = 8 tokens.
CP_LAYOUTS = [
    ("zigzag_bshd", "zigzag", 2, 64, None),
    ("zigzag_bshd1", "zigzag", 1, 64, None),
    ("zigzag_thd", "zigzag", 1, 64, [0, 16, 48, 64]),
    ("contiguous_thd", "contiguous", 1, 64, [0, 13, 50, 64]),
]
# allgather on one row with FLA's partition (contiguous, or zigzag of one sequence) runs FLA's own KCP path
FLA_CP_LAYOUTS = ("zigzag_bshd1", "contiguous_thd")
# Two heads (the interpreter's cost grows with the heads in each kernel's grid); four where full Ulysses spreads
# them over the P = 4 ranks.
CP_PROBLEM = dict(H=2, HV=2, K=16, V=16, l2norm_in_kernel=True, beta_sigmoid=True, gate_in_kernel=True)
ULYSSES_CP_PROBLEM = dict(CP_PROBLEM, H=4, HV=4)
CP_CASES = ([(kind, layout, method, {}) for kind in ("gdn", "kda") for method in ("p2p", "allgather")
             for layout, *_ in CP_LAYOUTS]
            + [(kind, "zigzag_bshd", method, opts) for kind in ("gdn", "kda")
               for method, opts in (("grouped_allgather_p2p", {"group_size": 2}), ("recursive_doubling", {}),
                                    ("ulysses", {}), ("hybrid_ulysses2_p2p", {"ulysses_degree": 2}))]
            + [(kind, "zigzag_bshd1", "hybrid_ulysses2_allgather", {"ulysses_degree": 2}) for kind in ("gdn", "kda")])
# GVA (HV = 2H) on packed zigzag, and GDN with the gate, beta and q/k normalisation applied outside the kernel
CP_VARIANTS = {
    "gdn-zigzag_thd-p2p-gva_outside_gate": ("gdn", dict(H=2, HV=4, K=16, V=16)),
    "kda-zigzag_thd-p2p-gva": ("kda", dict(CP_PROBLEM, H=2, HV=4)),
}
CONV_CP_CASES = [(layout, method) for layout, *_ in CP_LAYOUTS for method in ("p2p", "allgather", "ulysses")]
# GDN / KDA layers with backend="triton" on megatron TP x CP groups against the single-rank eager layer with the
# same initialisation (tests/support/delta_layer_cases.py builds and compares; only the backend differs). Half the
# heads of tests/layers' cases: GDN keeps GVA (one key and two value heads per TP rank), KDA one head per Ulysses rank.
LAYER_CASES = [
    ("layer-gdn-tp2-cp2-sp-thd-contiguous-allgather", dict(  # FLA's own KCP path
        kind="gdn", tp=2, cp=2, sp=True, thd=True, packed_cp_group=False, dims=HALF_HEADS["gdn"],
        options={"backend": "triton", "cp_method": "allgather", "cp_layout": "contiguous"})),
    ("layer-kda-tp1-cp4-bshd-ulysses2_p2p", dict(kind="kda", tp=1, cp=4, sp=False, thd=False, packed_cp_group=False,
                                                 dims=HALF_HEADS["kda"],
                                                 options={"backend": "triton", "cp_method": "p2p",
                                                          "cp_ulysses_degree": 2})),
]


def conv_single_case(case):
    """FLA's causal_conv1d vs eager (fp32): y and the gradients of x, weight and (packed case) bias and history."""
    if case == "conv-silu_batch":
        return compare_conv_single_rank(2, 40, 32, None, False, False, "cpu", torch.float32)
    return compare_conv_single_rank(1, 60, 32, torch.tensor([0, 2, 30, 60]), True, True, "cpu", torch.float32)


def worker(rank, world):
    """Every case of this file on one rank; per case a dict of errors or {"error": traceback}."""
    triton_interpreter.enable()
    accept_stacked_all_gather_on_gloo()
    results = {}

    def attempt(key, fn, *args, collective=False):
        run_case(results, key, fn, *args, collective=collective)

    single = list(SINGLE_CASES) + list(CONV_CASES)
    for index, key in enumerate(single):
        if index % world != rank:
            continue
        if key in SINGLE_CASES:
            kind, problem = SINGLE_CASES[key]
            attempt(key, compare_single_rank, kind, problem, "cpu", "triton", torch.float32,
                    problem.get("lower_bound") is not None)
        else:
            attempt(key, conv_single_case, key)
    for kind, layout, method, opts in CP_CASES:
        problem = ULYSSES_CP_PROBLEM if method == "ulysses" else CP_PROBLEM
        attempt(f"{kind}-{layout}-{method}", cp_case, kind, CP_LAYOUTS, layout, problem, method, opts,
                "triton", "cpu", torch.float32, 11, _fla_cp_taken, collective=True)
    for key, (kind, problem) in CP_VARIANTS.items():
        attempt(key, cp_case, kind, CP_LAYOUTS, "zigzag_thd", problem, "p2p", {}, "triton", "cpu", torch.float32,
                11, _fla_cp_taken, collective=True)
    for layout, method in CONV_CP_CASES:
        attempt(f"conv-{layout}-{method}", cp_conv_case, CP_LAYOUTS, layout, method, {}, "triton", "cpu",
                torch.float32, 16, collective=True)
    _layer_cases(attempt)
    attempt("fla_dispatch", fla_dispatch_case)
    return results


def fla_dispatch_case():
    """What the backend loaded with FLA's dispatch (fla was first imported by load_fla in these ranks: off), and
    :func:`dispatch_state` on FLA's own registry classes with a backend that would take over KDA."""
    import os
    from types import SimpleNamespace

    from layers.ops.triton.runtime import DISPATCH_ENV, dispatch_candidates, dispatch_state, kernels_in_use, load_fla

    loaded = load_fla()   # in these ranks the ops above imported fla first, through load_fla
    import fla.backends as fb

    class OtherKernels(fb.BaseBackend):
        backend_type = "other_kernels"

    registry = fb.BackendRegistry("kda")
    registry.register(OtherKernels())
    fake = SimpleNamespace(_DISPATCH_DISABLED=False, _operation_registries={"kda": registry},
                           _function_registries={})
    try:
        dispatch_state(fake, None)
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    return {"loaded": (loaded.dispatch, os.environ.get(DISPATCH_ENV), fb._DISPATCH_DISABLED),
            "kernels": kernels_in_use(), "installed_candidates": dispatch_candidates(fb), "refused": refused,
            "chosen": dispatch_state(fake, "0"), "off": dispatch_state(dict_off(fake), None)}


def dict_off(namespace):
    from types import SimpleNamespace

    return SimpleNamespace(**{**vars(namespace), "_DISPATCH_DISABLED": True})


def _layer_cases(attempt):
    from megatron.core import parallel_state

    from hp_megatron.platform import apply_cpu_shims
    from tests.support.delta_layer_cases import groups, run_case

    parallel_state.initialize_model_parallel(1, 1)
    for layout in sorted({(1, 1)} | {(case["tp"], case["cp"]) for _, case in LAYER_CASES}):
        groups(*layout)  # collective, same order on every rank
    for key, case in LAYER_CASES:
        apply_cpu_shims(2024)  # same default init seed for both layers
        attempt(key, run_case, case, collective=True)
    parallel_state.destroy_model_parallel()


def _fla_cp_taken(ctx):
    return {"fla_cp": any(r.name == "fla_cp_all_gather" for r in ctx.stats.records)}


def _check(errs):
    assert "error" not in errs, errs["error"]
    assert errs and all(e <= TOL for e in errs.values()), errs


@pytest.mark.parametrize("key", [key for key, _ in LAYER_CASES])
def test_layer_matches_single_rank_eager_layer(key):
    for errs in run_distributed_cases(worker, WORLD, key):
        assert "error" not in errs, errs["error"]
        flat = {"out": errs["out"], "x_grad": errs["x_grad"], **errs["param_grads"]}
        assert all(e <= TOL for e in flat.values()), flat


@pytest.mark.parametrize("key", list(SINGLE_CASES) + list(CONV_CASES))
def test_single_rank_matches_eager(key):
    (errs,) = run_distributed_cases(worker, WORLD, key)
    _check(errs)


@pytest.mark.parametrize("key", [f"{k}-{lay}-{m}" for k, lay, m, _ in CP_CASES] + list(CP_VARIANTS)
                         + [f"conv-{lay}-{m}" for lay, m in CONV_CP_CASES])
def test_cp_matches_single_rank_eager(key):
    """Every method; allgather on FLA's partitions must take FLA's own KCP path (layers/cp/triton.py), the rest
    FLA's kernels with our exchange (layers/cp/triton_engine_exchange.py)."""
    fla_path = key.endswith("allgather") and any(f"-{layout}-" in key for layout in FLA_CP_LAYOUTS)
    for errs in run_distributed_cases(worker, WORLD, key):
        errs = dict(errs)
        assert "error" not in errs, errs["error"]
        if not key.startswith("conv-"):
            assert errs.pop("fla_cp", None) is fla_path, (key, fla_path)
        _check(errs)


def test_fla_dispatch_is_off_or_refused():
    """The triton backend runs FLA's Triton kernels: FLA's backend dispatch is turned off when load_fla imports
    fla; a dispatch left on with another kernel package available is refused, naming it, unless the user chose it
    (FLA_DISABLE_BACKEND_DISPATCH=0); the self-check's kernels line says which."""
    got = run_distributed_cases(worker, WORLD, "fla_dispatch")[0]
    assert "error" not in got, got["error"]
    assert got["loaded"] == (False, "1", True), got
    assert got["kernels"].endswith("FLA's backend dispatch off (FLA_DISABLE_BACKEND_DISPATCH=1)"), got
    assert got["installed_candidates"] == (), got   # no FlashQLA / TileLang / FlashKDA / NPU on this machine
    assert "would run kda: other_kernels instead" in got["refused"], got
    assert got["chosen"] == (True, ("kda: other_kernels",)) and got["off"] == (False, ()), got
