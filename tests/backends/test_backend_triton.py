"""backend="triton" (flash-linear-attention kernels) against backend="eager", on an NVIDIA GPU.

GPU-only tests skip cleanly without CUDA or FLA (two CPU tests check the error and the conv-cache layout).
Each case runs the triton op on bf16 inputs and the eager op on fp32 copies of the same values (on the same
GPU), and compares outputs, final states and every input gradient by relative L2 error <= 2e-2 (DESIGN.md
section 4, bf16 kernels). CP: every method of the CP engine with P=4 gloo processes sharing the one GPU;
each rank compares its CP run (triton) with the single-rank eager run of the same global problem.

Shapes keep FLA's compile-time constants (H, K, V and the feature flags) to a few sets, because the first
call with new constants autotunes for minutes; see benchmarks/gpu_check.sh.
"""
from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist

from hp_megatron.selfcheck.gloo import STAGED, accept_stacked_all_gather_on_gloo, install_gloo_device_staging
from layers.ops import chunk_gated_delta_rule
from layers.ops.backends import get_backend
from tests.support.dist import run_distributed
from tests.support.reference import make_problem, rel_err
from tests.support.triton_cases import compare_conv_single_rank, compare_single_rank, cp_case, cp_conv_case, to_leaves

TOL = 2e-2
# P of the CP tests (benchmarks/gpu_check.sh runs P=2 first, then P=4 when time is left) and an optional comma
# list of substrings selecting CP cases by key (e.g. "p2p,allgather"); unselected cases skip with the reason.
CP_WORLD = int(os.environ.get("HP_GPU_CP_WORLD", "4"))
CP_SELECT = [s for s in os.environ.get("HP_GPU_CP_CASES", "").split(",") if s]


def _unavailable_reason():
    try:
        get_backend("triton")
    except RuntimeError as error:
        return str(error)
    return None


REASON = _unavailable_reason()
needs_gpu = pytest.mark.skipif(REASON is not None, reason=f"triton backend unavailable: {REASON}")


def _gdn_grad_blocker():
    if REASON is not None:
        return None
    from layers.ops.triton.runtime import gdn_backward_blocker

    return gdn_backward_blocker(torch.device("cuda", torch.cuda.current_device()))


# Layer-like flags (FLA's GatedDeltaNet / KimiDeltaAttention) at the benchmark's H, K, V: shares compiled kernels
# with benchmarks/gpu_layers.py. "variants" covers GVA, packed documents, h0/final-state gradients, outside gates.
SINGLE_CASES = {
    "gdn": {
        "layer_flags": dict(B=2, T=200, H=16, HV=16, K=128, V=128, l2norm_in_kernel=True, beta_sigmoid=True,
                            gate_in_kernel=True),
        "variants": dict(B=1, T=300, H=4, HV=8, K=64, V=64, cu_seqlens=[0, 1, 130, 260, 300],
                         initial_state=True),
    },
    "kda": {
        "layer_flags": dict(B=2, T=200, H=16, HV=16, K=128, V=128, l2norm_in_kernel=True, beta_sigmoid=True,
                            gate_in_kernel=True, lower_bound=-5.0),
        "variants": dict(B=1, T=300, H=4, HV=8, K=64, V=64, cu_seqlens=[0, 1, 130, 260, 300],
                         initial_state=True),
    },
}
SINGLE_PARAMS = [pytest.param(kind, name, id=f"{kind}-{name}") for kind in SINGLE_CASES for name in SINGLE_CASES[kind]]


# ------------------------------------------------------------------------------------------- CPU checks
@pytest.mark.skipif(REASON is None, reason="flash-linear-attention and a GPU are present")
def test_missing_backend_names_packages():
    with pytest.raises(RuntimeError) as info:
        chunk_gated_delta_rule(*(torch.zeros(1, 4, 1, 8) for _ in range(3)), torch.zeros(1, 4, 1),
                               torch.ones(1, 4, 1), backend="triton")
    message = str(info.value)
    assert "triton" in message and ("flash-linear-attention" in message or "GPU" in message)


def test_history_to_fla_cache_layout():
    """FLA reads token t-j (j = 1..W-1) of the history from cache slot W-j; slot 0 is unused."""
    from layers.ops.triton.backend import history_to_fla_cache

    N, W, D = 2, 4, 3
    history = torch.arange(N * (W - 1) * D, dtype=torch.float32).reshape(N, W - 1, D)  # oldest token first
    cache = history_to_fla_cache(history)
    assert cache.shape == (N, D, W) and cache.is_contiguous()
    assert torch.equal(cache[:, :, 0], torch.zeros(N, D))
    for j in range(1, W):  # token t-j is history[:, W-1-j]
        assert torch.equal(cache[:, :, W - j], history[:, W - 1 - j])


def test_device_cu_seqlens_uploads_once_per_buffer_version():
    """The public ops pass a fresh detach() of the caller's boundaries each call: one upload per buffer until
    the caller changes it in place (the version counter is shared), never a stale copy."""
    from layers.ops.triton import runtime
    from layers.ops.validation import normalize_cu_seqlens

    cache = runtime.DeviceCuSeqlens()
    cu = torch.tensor([0, 10, 40, 64])
    cpu = torch.device("cpu")
    first = [cache(normalize_cu_seqlens(cu, 1, 64), cpu) for _ in range(3)]
    assert len(cache) == 1 and all(d is first[0][0] for d, _ in first)
    cu[1] = 11
    on_device, host = cache(normalize_cu_seqlens(cu, 1, 64), cpu)
    assert len(cache) == 2 and on_device.tolist() == [0, 11, 40, 64] == host.tolist()
    other = torch.tensor([0, 10, 40, 64])  # equal values, other buffer: its own entry
    assert cache(other, cpu)[0].tolist() == [0, 10, 40, 64]
    assert cache(None, cpu) == (None, None)


def test_warm_shapes_match_tests():
    """benchmarks/gpu_layers.py --warm compiles exactly the shapes these tests use (no autotuning in the tests)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_layers.py"
    spec = importlib.util.spec_from_file_location("gpu_layers_for_test", path)
    gpu_layers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_layers)
    for kind in ("gdn", "kda"):
        case = SINGLE_CASES[kind]["layer_flags"]
        assert (case["B"], case["T"]) == gpu_layers.WARM_SINGLE_SHAPE
        assert (case["H"], case["HV"], case["K"], case["V"]) == (gpu_layers.H, gpu_layers.H, gpu_layers.K,
                                                                 gpu_layers.V)
        assert case.get("lower_bound") == (gpu_layers.KDA_LOWER_BOUND if kind == "kda" else None)
    assert [tuple(c[1:]) for c in CP_LAYOUTS] == [tuple(c) for c in gpu_layers.WARM_CP_LAYOUTS]
    assert (CP_PROBLEM["H"], CP_PROBLEM["K"], CP_PROBLEM["V"]) == (gpu_layers.H, gpu_layers.K, gpu_layers.V)
    assert [m for m, _ in gpu_layers.WARM_CP_METHODS] == ["p2p", "allgather"]


# ------------------------------------------------------------------------------------------ single rank
@needs_gpu
def test_gdn_backward_guard_on_old_triton_hopper():
    """Where FLA would give wrong GDN gradients (Hopper, triton < 3.7.1), the op refuses up front."""
    reason = _gdn_grad_blocker()
    if reason is None:
        pytest.skip("this GPU/triton combination supports GDN backward")
    tensors, flags = make_problem("gdn", **SINGLE_CASES["gdn"]["layer_flags"])
    low = to_leaves(tensors, "cuda", torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"triton>=3\.7\.1"):
        chunk_gated_delta_rule(**low, **flags, backend="triton")
    with torch.no_grad():  # forward alone is fine and matches eager
        o, _ = chunk_gated_delta_rule(**low, **flags, backend="triton")
        o_ref, _ = chunk_gated_delta_rule(**{n: x.float() for n, x in low.items()}, **flags, backend="eager")
    assert rel_err(o.float(), o_ref) <= TOL


@needs_gpu
@pytest.mark.parametrize("kind,case", SINGLE_PARAMS)
def test_single_rank_matches_eager(kind, case):
    if kind == "gdn" and _gdn_grad_blocker():
        pytest.skip(_gdn_grad_blocker())
    problem = SINGLE_CASES[kind][case]
    safe_gate = problem.get("lower_bound") is not None  # FLA's tensor-core path for bounded gates
    errs = compare_single_rank(kind, problem, "cuda", safe_gate=safe_gate)
    assert all(e <= TOL for e in errs.values()), errs


@needs_gpu
@pytest.mark.parametrize("case", ["silu_batch", "packed_history_bias"])
def test_conv_matches_eager(case):
    if case == "silu_batch":
        errs = compare_conv_single_rank(2, 200, 256, None, False, False, "cuda", torch.bfloat16)
    else:
        errs = compare_conv_single_rank(1, 300, 256, torch.tensor([0, 2, 130, 300]), True, True, "cuda",
                                        torch.bfloat16)
    assert all(e <= TOL for e in errs.values()), errs


# ------------------------------------------------------------------------------------------- CP (gloo)
# Methods of the CP engine; hybrid = Ulysses(2) x p2p. P=4; the benchmark's H=16, K=V=128, so the kernels compiled
# here (local pass, V+K wide summaries, Ulysses head slices) are reused by benchmarks/gpu_layers.py section (e).
CP_METHODS = [
    ("p2p", {}), ("allgather", {}), ("grouped_allgather_p2p", {"group_size": 2}), ("recursive_doubling", {}),
    ("ulysses", {}), ("hybrid_ulysses2_p2p", {"ulysses_degree": 2}),
]
# (name, layout, B, T, global cu_seqlens); zigzag THD documents are multiples of 2P = 8 tokens.
CP_LAYOUTS = [
    ("zigzag_bshd", "zigzag", 2, 512, None),
    ("zigzag_thd", "zigzag", 1, 512, [0, 128, 384, 512]),
    ("contiguous_thd", "contiguous", 1, 512, [0, 100, 420, 512]),
]
CP_PROBLEM = dict(H=16, HV=16, K=128, V=128, l2norm_in_kernel=True, beta_sigmoid=True, gate_in_kernel=True)


def _cp_cases():
    """Cheapest first, so a time-limited run still covers the most: p2p and allgather on every layout (the
    kernels benchmarks/gpu_layers.py --warm cp compiled), then the other methods, Ulysses (new head counts,
    hence new Triton autotuning) last."""
    cases = []
    for kind in ("gdn", "kda"):
        for method in ("p2p", "allgather"):
            for layout_name, *_ in CP_LAYOUTS:
                cases.append((kind, layout_name, method, {}))
    for method, opts in CP_METHODS:
        if method not in ("p2p", "allgather"):
            for kind in ("gdn", "kda"):
                cases.append((kind, "zigzag_bshd", method, opts))
    return cases


def _cp_case_skip(key, method, world):
    if CP_SELECT and not any(part in key for part in CP_SELECT):
        return f"not selected by HP_GPU_CP_CASES={','.join(CP_SELECT)}"
    if world < 4 and method in ("grouped_allgather_p2p", "hybrid_ulysses2_p2p"):
        return f"{method} needs P >= 4 (two groups of 2), this run has P={world}"
    return None


def cp_worker(rank, world, backend="triton", device="cuda", dtype=torch.bfloat16):
    """All CP cases in one spawn; per case a dict of errors, {"skipped": why} or {"error": traceback}."""
    if device == "cuda":
        torch.cuda.set_device(0)  # P processes share the one GPU
        accept_stacked_all_gather_on_gloo()  # FLA's KCP all-gather (allgather cases), staged below
        install_gloo_device_staging()
    gdn_blocker = None
    if backend == "triton":
        from layers.ops.triton.runtime import gdn_backward_blocker

        gdn_blocker = gdn_backward_blocker(torch.device(device, 0))
    results = {}
    log = os.environ.get("HP_GPU_CP_LOG") if rank == 0 else None  # per-case lines survive a timeout

    def record(key, value):
        results[key] = value
        if log:
            import json
            import time

            with open(log, "a", encoding="utf-8") as f:
                f.write(json.dumps({"case": key, "t": round(time.monotonic(), 1), **value}) + "\n")

    for kind, layout_name, method, opts in _cp_cases():
        key = f"{kind}-{layout_name}-{method}"
        skip = _cp_case_skip(key, method, world) or (gdn_blocker if kind == "gdn" else None)
        if skip:
            record(key, {"skipped": skip})
            continue
        try:
            record(key, cp_case(kind, CP_LAYOUTS, layout_name, CP_PROBLEM, method, opts, backend, device, dtype))
        except Exception:  # noqa: BLE001 - reported per case; ranks stay in lockstep (same cases, same order)
            record(key, {"error": traceback.format_exc()})
            dist.barrier()
    for layout_name, *_ in CP_LAYOUTS:
        for method, opts in (("p2p", {}), ("allgather", {}), ("ulysses", {})):
            key = f"conv-{layout_name}-{method}"
            skip = _cp_case_skip(key, method, world)
            if skip:
                record(key, {"skipped": skip})
                continue
            try:
                record(key, cp_conv_case(CP_LAYOUTS, layout_name, method, opts, backend, device, dtype))
            except Exception:  # noqa: BLE001
                record(key, {"error": traceback.format_exc()})
                dist.barrier()
    return results


CP_KEYS = ([f"{k}-{lay}-{m}" for k, lay, m, _ in _cp_cases()]
           + [f"conv-{lay}-{m}" for lay, *_ in CP_LAYOUTS for m in ("p2p", "allgather", "ulysses")])


@pytest.fixture(scope="module")
def cp_results():
    if torch.cuda.device_count() < 1:
        pytest.skip("needs one CUDA device")
    timeout = float(os.environ.get("HP_GPU_CP_TIMEOUT", "900"))
    return run_distributed(cp_worker, CP_WORLD, timeout=timeout)


@needs_gpu
@pytest.mark.parametrize("key", CP_KEYS)
def test_cp_matches_single_rank_eager(cp_results, key):
    per_rank = [r[key] for r in cp_results]
    first = per_rank[0]
    if "skipped" in first:
        pytest.skip(first["skipped"])
    errors = [r["error"] for r in per_rank if "error" in r]
    assert not errors, errors[0]
    assert all(e <= TOL for e in first.values()), first


def test_gloo_cuda_staging_rebinds_functions_bound_at_import(monkeypatch):
    """The GPU CP tests stage CUDA collectives through host memory; layers.cp binds some collectives at import,
    and spawned ranks import it before staging is installed (seen on the H200: every CP case failed)."""
    import sys

    import layers.cp.collectives  # noqa: F401 - binds its aliases now
    names = STAGED
    present = [name for name in names if hasattr(dist, name)]
    originals = [getattr(dist, name) for name in present]
    for name in names:
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, getattr(dist, name))  # restored after the test

    def bound_originals():
        return [(module_name, attr) for module_name, module in list(sys.modules.items())
                if module_name.startswith("layers.") for attr, value in vars(module).items()
                if any(value is original for original in originals)]

    before = bound_originals()
    assert before, "layers no longer binds a collective at import; this test is moot"
    for (module_name, attr) in before:
        monkeypatch.setattr(sys.modules[module_name], attr, getattr(sys.modules[module_name], attr))
    install_gloo_device_staging()
    assert not bound_originals()
    assert all(getattr(dist, name) is not original for name, original in zip(present, originals))
