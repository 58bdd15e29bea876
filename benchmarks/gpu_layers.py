"""GPU benchmark for the triton backend: fwd+bwd tokens/s and peak memory on one NVIDIA GPU.

Sections (bf16, H=16 heads, K=V=128; shapes B1 T16384 and B8 T4096 unless --shapes says otherwise):
  a  flash-linear-attention's bare ops (chunk_gated_delta_rule, chunk_kda), layer-like flags
  b  our ops (layers.ops, backend="triton") with the same flags
  c  our GDN / KDA layers (hp_megatron specs, backend="triton") at hidden 2048
  d  FLA's GatedDeltaNet / KimiDeltaAttention layers and megatron-core's GatedDeltaNet at hidden 2048
  e  per-rank cost of each CP method, P = 2, 4, 8 ranks simulated on one GPU: one process plays rank r of a
     P-rank "fake" process group (torch's fake backend: collectives move no data), so the time is the
     rank's real compute (local pass, summaries, scan folds, Ulysses re-layouts) without communication;
     the bytes each rank would send come from the CP engine's CommStats.
Every measurement is wrapped in try/except: an error is recorded in its row, never aborts the run. Each row is
the median of three timed windows (``ms``; ``ms_min`` the fastest) plus ``host_ms``, the CPU time per call spent
enqueueing work: ``host_ms`` close to ``ms`` means the call is bound by Python/launch overhead, not the GPU.
``--warm gdn|kda|cp`` only compiles and autotunes the benchmark and test shapes (no timing), so later
processes sharing TRITON_CACHE_DIR load Triton's autotune results from disk.

Outputs: ``--out DIR`` gets ``gpu_layers.json`` and ``gpu_layers.md``; ``--docs FILE`` replaces the section
between ``<!-- gpu:begin -->`` and ``<!-- gpu:end -->`` (appended when absent). Re-render on any machine with
``python benchmarks/gpu_layers.py --render DIR/gpu_layers.json --docs docs/benchmarks.md``.
Run on the GPU through ``benchmarks/gpu_check.sh`` (installs the carried wheels, warms one shape set).
``--device cpu --dims 4,16,16,64`` runs every section on CPU in fp32 with tiny dimensions, for a process whose
FLA kernels run in Triton's interpreter (tests/backends/test_gpu_layers_smoke.py): it checks that every row builds and
runs; its times mean nothing.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # before benchmarks/, whose layers.py would shadow the package

from benchmarks._common import marked_section  # noqa: E402
from benchmarks._common import write_docs_section as write_docs  # noqa: E402,F401 (gpu_check.sh calls it)
H, K, V, HIDDEN = 16, 128, 128, 2048  # --dims overrides (smoke runs)
DEVICE, DTYPE = "cuda", torch.bfloat16  # --device cpu: fp32 (Triton's interpreter)
KDA_LOWER_BOUND = -5.0
SECTIONS = {
    "a": "FLA bare ops",
    "b": "our ops (backend='triton')",
    "c": "our layers (backend='triton', hidden 2048)",
    "d": "reference layers (FLA, megatron-core; hidden 2048)",
    "e": "CP per-rank cost, P ranks simulated on one GPU (compute only)",
}
CP_METHODS = (("p2p", {}), ("allgather", {}), ("grouped_allgather_p2p", {"group_size": 2}),
              ("recursive_doubling", {}), ("ulysses", {}))


# ------------------------------------------------------------------------------------------ measuring
class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def _short_error(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".replace("\n", " ").replace("|", "/")
    return text[:300]


def measure(build, tokens: int, iters: int, warmup: int = 1, repeats: int = 3, min_window_s: float = 0.05) -> dict:
    """``build()`` returns ``step()`` doing one fwd+bwd. After ``warmup`` steps (the first includes Triton
    autotuning) times ``repeats`` windows of at least ``iters`` steps (more for short steps, so a window lasts
    ``min_window_s``, sized by one probe step; with ``warmup`` 0 no probe: windows of ``iters`` steps) with CUDA
    events; ``ms`` is the median window's mean. ``host_ms`` is the CPU time per step spent enqueueing work
    (before the final synchronize): when it is close to ``ms`` the step is bound by Python/launch overhead, not
    by the GPU. Peak memory is measured above what existed before build.
    Off CUDA (smoke runs) windows are host-timed and peak memory is not measured."""
    cuda = DEVICE == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.monotonic()
    step = build()
    for _ in range(warmup):
        step()
    sync()
    warm_s = time.monotonic() - t0
    n = iters
    if warmup:  # one probe step sizes the windows; --warmup 0 (smoke runs) times exactly ``iters`` steps
        t1 = time.perf_counter()
        step()
        sync()
        n = max(iters, min(200, int(min_window_s / max(time.perf_counter() - t1, 1e-6)) + 1))
    windows, host = [], []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        h0 = time.perf_counter()
        for _ in range(n):
            step()
        host.append((time.perf_counter() - h0) * 1e3 / n)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            windows.append(start.elapsed_time(end) / n)
        else:
            windows.append(host[-1])
    windows.sort()
    ms = windows[len(windows) // 2]
    peak = round((torch.cuda.max_memory_allocated() - base) / 2 ** 20, 1) if cuda else None
    del step
    return {"ms": round(ms, 3), "tokens_per_s": round(tokens / ms * 1e3), "peak_mib": peak,
            "ms_min": round(windows[0], 3), "host_ms": round(sorted(host)[len(host) // 2], 3), "iters": n,
            "warmup_s": round(warm_s, 1)}


TIMING = {"warmup": 1, "repeats": 3}  # --warmup / --repeats (smoke runs: 0 / 1)


def run_row(rows, budget, section, name, shape, build, tokens, iters, **info):
    row = {"section": section, "name": name, "shape": shape, **info}
    if budget.left() <= 0:
        row["error"] = "not run: time budget exhausted"
    else:
        try:
            row.update(measure(build, tokens, iters, **TIMING))
        except Exception as error:  # noqa: BLE001 - recorded in the table
            row["error"] = _short_error(error)
            row["traceback"] = traceback.format_exc()[-2000:]
        finally:
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    rows.append(row)
    status = row.get("error") or f"{row['ms']} ms, {row['tokens_per_s'] / 1e6:.2f} M tok/s, {row['peak_mib']} MiB"
    print(f"[{section}] {name} {info.get('mode', '')} {shape}: {status}", flush=True)
    return row


# --------------------------------------------------------------------------------------------- inputs
def op_inputs(kind: str, B: int, T: int, heads: int | None = None, device: str | None = None):
    """Layer-like op inputs (raw gate and beta; gate, beta sigmoid and q/k l2norm inside the kernel)."""
    heads, device = heads or H, device or DEVICE
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dtype=DTYPE):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype).requires_grad_()

    t = {"q": randn(B, T, heads, K), "k": randn(B, T, heads, K), "v": randn(B, T, heads, V),
         "beta": randn(B, T, heads)}
    if kind == "gdn":
        t["g"] = randn(B, T, heads)
        t["A_log"] = torch.log(torch.linspace(1, 16, heads, device=device)).requires_grad_()
        t["dt_bias"] = torch.zeros(heads, device=device).requires_grad_()
    else:
        t["g"] = randn(B, T, heads, K)
        t["A_log"] = torch.zeros(heads, device=device).requires_grad_()
        t["dt_bias"] = torch.zeros(heads * K, device=device).requires_grad_()
    flags = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True)
    if kind == "kda":
        flags.update(safe_gate=True, lower_bound=KDA_LOWER_BOUND)
    return t, flags


def _op_step(fn, tensors, flags, mode="fwd+bwd"):
    leaves = list(tensors.values())
    do = torch.randn_like(tensors["v"])

    def step():
        if mode == "fwd":
            with torch.no_grad():
                fn(**tensors, **flags)
            return
        o, _ = fn(**tensors, **flags)
        torch.autograd.grad(o, leaves, do)
    return step


# ------------------------------------------------------------------------------------------ sections
def _op_fn(kind: str, which: str):
    if which == "a":
        if kind == "gdn":
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
        else:
            from fla.ops.kda import chunk_kda as fn
        return fn
    from layers.ops import chunk_gated_delta_rule, chunk_kda

    fn = chunk_gated_delta_rule if kind == "gdn" else chunk_kda
    return lambda **kw: fn(**kw, backend="triton")


def measure_pair(builds: dict, tokens: int, iters: int, repeats: int, warmup: int = 1,
                 min_window_s: float = 0.05) -> dict:
    """Time two or more steps in alternating windows (ABBA order over ``2 * repeats`` rounds) after ``warmup``
    untimed steps each, so clock and thermal drift hit every side alike; per side the :func:`measure` fields
    (median window). Measuring rows
    one after another instead showed +-20% between identical kernel sequences on the H200 (docs/benchmarks.md,
    "our triton ops against bare FLA")."""
    cuda = DEVICE == "cuda"
    steps, peaks, warm = {}, {}, {}
    for name, build in builds.items():
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.monotonic()
        steps[name] = build()
        for _ in range(warmup):  # the first call may autotune
            steps[name]()
        if cuda:
            torch.cuda.synchronize()
            peaks[name] = round((torch.cuda.max_memory_allocated() - base) / 2 ** 20, 1)
        warm[name] = round(time.monotonic() - t0, 1)
    n = iters
    if warmup:  # one probe step per side sizes the windows, as in :func:`measure`
        probe = []
        for step in steps.values():
            t1 = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            probe.append(time.perf_counter() - t1)
        n = max(iters, min(200, int(min_window_s / max(max(probe), 1e-6)) + 1))
    device = {name: [] for name in steps}
    host = {name: [] for name in steps}
    for r in range(2 * repeats):
        for name in (list(steps) if r % 2 == 0 else list(reversed(steps))):
            if cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            h0 = time.perf_counter()
            for _ in range(n):
                steps[name]()
            host[name].append((time.perf_counter() - h0) * 1e3 / n)
            if cuda:
                end.record()
                torch.cuda.synchronize()
                device[name].append(start.elapsed_time(end) / n)
            else:
                device[name].append(host[name][-1])
    out = {}
    for name in steps:
        windows = sorted(device[name])
        ms = windows[len(windows) // 2]
        out[name] = {"ms": round(ms, 3), "tokens_per_s": round(tokens / ms * 1e3), "peak_mib": peaks.get(name),
                     "ms_min": round(windows[0], 3), "host_ms": round(sorted(host[name])[len(host[name]) // 2], 3),
                     "iters": n, "warmup_s": warm[name], "interleaved": True}
    return out


def section_ops(rows, budget, shapes, iters, which):
    """FLA's op (a) and ours (b) on the same inputs: with both sections, each pair is timed in alternating windows
    (:func:`measure_pair`); forward-only rows first (GDN backward is refused on Hopper with triton < 3.7.1), then
    fwd+bwd."""
    for mode in ("fwd", "fwd+bwd"):
        for kind in ("gdn", "kda"):
            op = "chunk_gated_delta_rule" if kind == "gdn" else "chunk_kda"
            for B, T in shapes:
                if len(which) > 1:
                    _ops_pair(rows, budget, kind, op, B, T, mode, iters)
                    continue
                for section in which:
                    def build(kind=kind, B=B, T=T, mode=mode, section=section):
                        tensors, flags = op_inputs(kind, B, T)
                        return _op_step(_op_fn(kind, section), tensors, flags, mode)
                    name = ("fla." if section == "a" else "layers.ops.") + op
                    run_row(rows, budget, section, name, f"B{B} T{T}", build, B * T, iters, kind=kind, mode=mode)


def _ops_pair(rows, budget, kind, op, B, T, mode, iters):
    """Rows a and b of one (kind, shape, mode), measured together by :func:`measure_pair`."""
    names = {"a": "fla." + op, "b": "layers.ops." + op}
    base = {s: {"section": s, "name": names[s], "shape": f"B{B} T{T}", "kind": kind, "mode": mode} for s in "ab"}
    if budget.left() <= 0:
        measured = {s: {"error": "not run: time budget exhausted"} for s in "ab"}
    else:
        try:
            tensors, flags = op_inputs(kind, B, T)
            measured = measure_pair({s: (lambda s=s: _op_step(_op_fn(kind, s), tensors, flags, mode)) for s in "ab"},
                                     B * T, iters, **TIMING)
        except Exception as error:  # noqa: BLE001 - recorded in the table
            measured = {s: {"error": _short_error(error), "traceback": traceback.format_exc()[-2000:]} for s in "ab"}
        finally:
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    for s in "ab":
        row = {**base[s], **measured[s]}
        rows.append(row)
        status = row.get("error") or f"{row['ms']} ms, {row['tokens_per_s'] / 1e6:.2f} M tok/s, {row['peak_mib']} MiB"
        print(f"[{s}] {row['name']} {mode} B{B} T{T}: {status}", flush=True)


_MEGATRON_READY = False


def _init_megatron():
    """Single-rank torch.distributed + megatron-core model parallel state (TP = PP = CP = 1)."""
    global _MEGATRON_READY
    if _MEGATRON_READY:
        return
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    if DEVICE == "cuda":
        model_parallel_cuda_manual_seed(0)
    else:
        from hp_megatron.platform import apply_cpu_shims

        apply_cpu_shims(0)
    _MEGATRON_READY = True


def _megatron_config(kind: str):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=H, ffn_hidden_size=4 * HIDDEN,
        params_dtype=DTYPE, bf16=DTYPE == torch.bfloat16, normalization="RMSNorm", layernorm_epsilon=1e-5,
        activation_func=F.silu, linear_conv_kernel_dim=4, linear_key_head_dim=K, linear_value_head_dim=V,
        linear_num_key_heads=H, linear_num_value_heads=H, add_bias_linear=False,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=DEVICE != "cuda", perform_initialization=True,
    )


def _layer_step(layer, B, T, seq_first: bool, returns_tuple: bool, mode: str = "fwd+bwd"):
    x = torch.randn(*((T, B) if seq_first else (B, T)), HIDDEN, device=DEVICE, dtype=DTYPE, requires_grad=True)
    params = [p for p in layer.parameters() if p.requires_grad]
    dy = torch.randn_like(x)

    def forward():
        out = layer(x, None) if seq_first else layer(x)
        return out[0] if returns_tuple else out

    def step():
        if mode == "fwd":
            with torch.no_grad():
                forward()
            return
        torch.autograd.grad(forward(), [x, *params], dy)
    return step


def build_our_layer(kind: str):
    """Our GDN / KDA mixer from the hp_megatron spec for backend='triton' (self_attention of the layer spec)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from hp_megatron.specs.gpt_layer_specs import get_mixer_spec

    _init_megatron()
    spec = get_mixer_spec(kind, "triton")
    if kind == "kda":  # the same gate as FLA's KimiDeltaAttention below (safe_gate, lower_bound -5)
        spec.params = {**(spec.params or {}), "safe_gate": True, "lower_bound": KDA_LOWER_BOUND}
    config = _megatron_config(kind)
    return build_module(spec, config=config, layer_number=1,
                        pg_collection=ProcessGroupCollection.use_mpu_process_groups()).to(DEVICE)


def _import_fla_layer(kind: str):
    """FLA's layer class. ``fla.layers`` imports transformers (for unrelated layers); without it, load only the
    two layer files through a bare ``fla.layers`` package so the comparison still runs."""
    import importlib
    import types

    try:
        importlib.import_module("fla.layers")
    except ImportError:
        import fla

        if "fla.layers" not in sys.modules or not hasattr(sys.modules["fla.layers"], "__path__"):
            package = types.ModuleType("fla.layers")
            package.__path__ = [os.path.join(os.path.dirname(fla.__file__), "layers")]
            sys.modules["fla.layers"] = package
    module = importlib.import_module("fla.layers.gated_deltanet" if kind == "gdn" else "fla.layers.kda")
    return module.GatedDeltaNet if kind == "gdn" else module.KimiDeltaAttention


def build_fla_layer(kind: str):
    cls = _import_fla_layer(kind)
    if kind == "gdn":
        layer = cls(hidden_size=HIDDEN, expand_v=1, head_dim=K, num_heads=H, mode="chunk", use_gate=True,
                    use_short_conv=True, conv_size=4)
    else:
        layer = cls(hidden_size=HIDDEN, expand_v=1, head_dim=K, num_heads=H, use_short_conv=True, conv_size=4,
                    safe_gate=True, lower_bound=KDA_LOWER_BOUND)
    return layer.to(device=DEVICE, dtype=DTYPE)


def build_megatron_gdn():
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    _init_megatron()
    submodules = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm,
                                         out_proj=RowParallelLinear)
    return GatedDeltaNet(_megatron_config("gdn"), submodules, layer_number=1,
                         pg_collection=ProcessGroupCollection.use_mpu_process_groups()).to(DEVICE)


def section_layers(rows, budget, shapes, iters, which):
    if which == "c":
        candidates = [("gdn", "hp layers.mixers.delta.gdn.GatedDeltaNet", lambda: build_our_layer("gdn"), True, True),
                      ("kda", "hp layers.mixers.delta.kda.KimiDeltaAttention", lambda: build_our_layer("kda"), True,
                       True)]
    else:
        candidates = [("gdn", "fla.layers.GatedDeltaNet", lambda: build_fla_layer("gdn"), False, True),
                      ("kda", "fla.layers.KimiDeltaAttention", lambda: build_fla_layer("kda"), False, True),
                      ("gdn", "megatron.core GatedDeltaNet", build_megatron_gdn, True, True)]
    for mode in ("fwd", "fwd+bwd"):
        for kind, name, make, seq_first, returns_tuple in candidates:
            for B, T in shapes:
                def build(make=make, B=B, T=T, seq_first=seq_first, returns_tuple=returns_tuple, mode=mode):
                    return _layer_step(make(), B, T, seq_first, returns_tuple, mode)
                run_row(rows, budget, which, name, f"B{B} T{T}", build, B * T, iters, kind=kind, mode=mode)


def _fake_group(rank: int, world: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())


def cp_step_builder(kind, method, opts, P, B, T, backend="triton", device=None, heads=None, layout="zigzag",
                    cu_seqlens=None):
    """``build()`` for rank 0 of a P-rank fake group: one fwd+bwd of the op on the rank's T/P tokens.
    ``cu_seqlens``: GLOBAL packed boundaries (B == 1), as given to ``build_cp_context``."""
    from layers.cp import build_cp_context
    from layers.ops import chunk_gated_delta_rule, chunk_kda

    fn = chunk_gated_delta_rule if kind == "gdn" else chunk_kda
    info = {}

    def build():
        _fake_group(0, P)
        cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int64)
        ctx = build_cp_context(None, method=method, layout=layout, cu_seqlens=cu, **opts)
        tensors, flags = op_inputs(kind, B, T // P, heads=heads, device=device)  # the T/P tokens a rank holds
        leaves = list(tensors.values())
        do = torch.randn_like(tensors["v"])

        def step():
            o, _ = fn(**tensors, **flags, cp_context=ctx, backend=backend)
            torch.autograd.grad(o, leaves, do)
        ctx.stats.reset()
        step()  # one recorded step: the per-rank traffic of a fwd+bwd
        info["comm"] = _stats_summary(ctx.stats)
        ctx.stats.enabled = False
        return step
    return build, info


def section_cp(rows, budget, shape, iters, worlds):
    """Per-rank fwd+bwd time of rank 0 of P (zigzag BSHD), compute only; ratio = time / (single-rank / P)."""
    import torch.distributed as dist

    B, T = shape
    for kind in ("gdn", "kda"):
        for P in worlds:
            for method, opts in CP_METHODS:
                if method == "grouped_allgather_p2p" and P <= 2:
                    continue
                build, info = cp_step_builder(kind, method, opts, P, B, T)
                row = run_row(rows, budget, "e", f"{kind} {method}", f"B{B} T{T} P{P}", build, B * T // P, iters,
                              kind=kind, P=P, method=method)
                if info.get("comm"):
                    row["comm"] = info["comm"]
    if dist.is_initialized():
        dist.destroy_process_group()


def _stats_summary(stats) -> str:
    """Bytes this rank sends and sequential steps, forward and backward, of the recorded step(s)."""
    parts = []
    for phase in ("forward", "backward"):
        t = stats.totals(phase=phase)
        parts.append(f"{phase[:3]} {t['bytes_sent'] / 2 ** 20:.2f} MiB sent / {t['steps']} steps")
    return "; ".join(parts)


# ------------------------------------------------------------------------------------------- warming
# The shapes of tests/backends/test_backend_triton.py (single rank: SINGLE_CASES "layer_flags"; CP: CP_LAYOUTS with
# CP_PROBLEM); tests/backends/test_backend_triton.py::test_warm_shapes_match_tests keeps the two files in sync.
WARM_SINGLE_SHAPE = (2, 200)
WARM_CP_LAYOUTS = (("zigzag", 2, 512, None), ("zigzag", 1, 512, [0, 128, 384, 512]),
                   ("contiguous", 1, 512, [0, 100, 420, 512]))
WARM_CP_METHODS = (("p2p", {}), ("allgather", {}))


def _timed(label, fn):
    t0 = time.monotonic()
    try:
        fn()
        status = "ok"
    except Exception as error:  # noqa: BLE001 - warming records and goes on
        status = _short_error(error)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    print(f"[warm] {label}: {time.monotonic() - t0:.1f}s {status}", flush=True)


def warm_ops(kind, shapes):
    """Compile and autotune ``kind``'s kernels (our op, layer flags) at the benchmark and single-rank test shapes:
    Triton caches the autotune results on disk (TRITON_CACHE_DIR), so later processes only load them."""
    from layers.ops.triton.runtime import gdn_backward_blocker

    grads = not (kind == "gdn" and gdn_backward_blocker(torch.device("cuda", torch.cuda.current_device())))
    for B, T in [*shapes, WARM_SINGLE_SHAPE]:
        tensors, flags = op_inputs(kind, B, T)
        step = _op_step(_op_fn(kind, "b"), tensors, flags, "fwd+bwd" if grads else "fwd")
        _timed(f"{kind} B{B} T{T} {'fwd+bwd' if grads else 'fwd (GDN backward blocked)'}", step)
        del tensors, step
        torch.cuda.empty_cache()


def warm_cp(worlds):
    """One fwd+bwd of rank 0 of a P-rank fake group for each CP test layout and the methods the CP tests run
    first: compiles the CP-only kernel variants (varlen pieces, the V+K wide summary pass) once."""
    from layers.ops.triton.runtime import gdn_backward_blocker

    blocked = gdn_backward_blocker(torch.device("cuda", torch.cuda.current_device()))
    for P in worlds:
        for kind in ("gdn", "kda"):
            if kind == "gdn" and blocked:
                print(f"[warm] cp gdn skipped: {blocked}", flush=True)
                continue
            for layout, B, T, cu in WARM_CP_LAYOUTS:
                for method, opts in WARM_CP_METHODS:
                    build, _ = cp_step_builder(kind, method, opts, P, B, T, layout=layout, cu_seqlens=cu)
                    _timed(f"cp {kind} {layout} B{B} T{T} {'THD' if cu else 'BSHD'} {method} P{P}",
                           lambda build=build: build())
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- reporting
def _fmt_row(row, columns):
    cells = []
    for col in columns:
        value = row.get(col, "")
        if col == "tokens_per_s" and value != "":
            value = f"{value / 1e6:.2f} M"
        cells.append(str(value))
    return "| " + " | ".join(cells) + " |"


def render_markdown(report: dict) -> str:
    meta = report["meta"]
    lines = ["## GPU: triton backend (benchmarks/gpu_layers.py)", "",
             f"Measured {meta.get('date', '?')} on {meta.get('gpu', '?')}; torch {meta.get('torch', '?')}, "
             f"triton {meta.get('triton', '?')}, flash-linear-attention {meta.get('fla', '?')}, "
             f"megatron-core {meta.get('megatron_core', '?')}. Command: `{meta.get('command', '?')}`.",
             f"{meta.get('dtype', 'bf16')}, {meta.get('dims', 'H=16, K=V=128')}, fwd+bwd, gate/beta/l2norm in kernel "
             "(KDA: safe_gate, lower_bound -5). "
             "Peak memory is above the inputs. Errors are recorded, not hidden.", ""]
    rows = report["rows"]
    for key, title in SECTIONS.items():
        section_rows = [r for r in rows if r["section"] == key]
        if not section_rows:
            continue
        lines += [f"### ({key}) {title}", ""]
        columns = ["name", "mode", "shape", "ms", "host_ms", "tokens_per_s", "peak_mib", "error"]
        if key == "e":
            columns = ["name", "shape", "ms", "ratio_to_ideal", "comm", "error"]
        lines.append("| " + " | ".join(columns) + " |")
        lines.append("|" + "---|" * len(columns))
        lines += [_fmt_row(r, columns) for r in section_rows]
        lines.append("")
    goals = report.get("goals")
    if goals:
        lines += ["### Goals (issue 7)", ""] + [f"- {g}" for g in goals] + [""]
    return marked_section("gpu", "\n".join(lines))


def fill_ratios(rows) -> None:
    """ratio_to_ideal = per-rank ms / (single-rank ms of our op at the same global shape / P), section e rows."""
    single = {(r["kind"], r["shape"]): r["ms"] for r in rows
              if r["section"] == "b" and r.get("mode") == "fwd+bwd" and "ms" in r}
    for r in rows:
        if r["section"] == "e" and "ms" in r:
            base = single.get((r.get("kind"), r["shape"].rsplit(" P", 1)[0]))
            if base:
                r["ratio_to_ideal"] = round(r["ms"] / (base / r["P"]), 3)


def evaluate_goals(rows) -> list[str]:
    def find(section, name_part, shape, mode="fwd+bwd"):
        for r in rows:
            if (r["section"] == section and name_part in r["name"] and r["shape"] == shape and "ms" in r
                    and r.get("mode", "fwd+bwd") == mode):
                return r
        return None

    goals = []
    for kind, op in (("gdn", "chunk_gated_delta_rule"), ("kda", "chunk_kda")):
        for shape in sorted({r["shape"] for r in rows if r["section"] == "a"}):
            for mode in ("fwd+bwd", "fwd"):  # the goal holds for both modes
                a, b = find("a", op, shape, mode), find("b", op, shape, mode)
                if a and b:
                    goals.append(f"{kind} ops {shape} {mode}: ours {b['ms']} ms vs FLA {a['ms']} ms "
                                 f"({(b['ms'] / a['ms'] - 1) * 100:+.1f}%, goal <= +3%)")
                else:
                    goals.append(f"{kind} ops {shape} {mode}: not measured (see errors above)")
    for shape in sorted({r["shape"] for r in rows if r["section"] == "c"}):
        for mode in ("fwd+bwd", "fwd"):
            ours, mcore = find("c", "GatedDeltaNet", shape, mode), find("d", "megatron", shape, mode)
            if ours and mcore:
                goals.append(f"GDN layer {shape} {mode}: ours {ours['ms']} ms vs megatron-core {mcore['ms']} ms "
                             "(goal: <=)")
                break
        else:
            goals.append(f"GDN layer {shape}: not measured (see errors above)")
    for r in rows:
        if r["section"] == "e" and r.get("P") == 8 and "ratio_to_ideal" in r:
            goals.append(f"CP=8 {r['name']}: {r['ratio_to_ideal']} x ideal (goal <= 1.15)")
    return goals


def _versions() -> dict:
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "python": platform.python_version(),
            "device": DEVICE, "dtype": str(DTYPE).replace("torch.", ""), "dims": f"H={H}, K={K}, V={V}"}
    if DEVICE == "cuda" and torch.cuda.is_available():
        meta["gpu"] = torch.cuda.get_device_name(0)
    for name, module in (("triton", "triton"), ("fla", "fla"), ("megatron_core", "megatron.core")):
        try:
            mod = __import__(module, fromlist=["__version__"])
            meta[name] = getattr(mod, "__version__", "?")
        except Exception as error:  # noqa: BLE001
            meta[name] = f"unavailable ({type(error).__name__})"
    return meta


def parse_shapes(text: str):
    shapes = []
    for item in text.split(","):
        b, t = item.strip().upper().lstrip("B").split("T")
        shapes.append((int(b), int(t)))
    return shapes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="abcde")
    parser.add_argument("--shapes", default="B1T16384,B8T4096")
    parser.add_argument("--cp-shape", default="B1T16384")
    parser.add_argument("--cp-worlds", default="2,4,8")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting measurements after this")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--docs", type=Path, default=None)
    parser.add_argument("--render", type=Path, default=None, help="re-render a saved JSON into --docs; no GPU")
    parser.add_argument("--warm", default=None, help="comma list of gdn,kda,cp: only compile/autotune the "
                        "benchmark and test shapes (no timing); --cp-worlds gives P for cp")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: fp32 smoke run; FLA's kernels must run in Triton's interpreter in this process")
    parser.add_argument("--dims", default=None, help="H,K,V,HIDDEN instead of 16,128,128,2048 (smoke runs)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per row (the first autotunes)")
    parser.add_argument("--repeats", type=int, default=3, help="timed windows per row (the median is reported)")
    args = parser.parse_args(argv)

    if args.render is not None:
        report = json.loads(args.render.read_text(encoding="utf-8"))
        markdown = render_markdown(report)
        if args.docs:
            write_docs(markdown, args.docs)
        print(markdown)
        return 0
    global H, K, V, HIDDEN, DEVICE, DTYPE
    if args.dims:
        try:
            H, K, V, HIDDEN = (int(x) for x in args.dims.split(","))
        except ValueError:
            parser.error(f"--dims takes four integers H,K,V,HIDDEN; got {args.dims!r}")
    DEVICE, DTYPE = args.device, (torch.bfloat16 if args.device == "cuda" else torch.float32)
    if args.warmup < 0 or args.repeats < 1:
        parser.error(f"--warmup must be >= 0 and --repeats >= 1; got {args.warmup}, {args.repeats}")
    TIMING.update(warmup=args.warmup, repeats=args.repeats)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("gpu_layers.py needs a CUDA GPU (use --render to re-render saved results)", file=sys.stderr)
        return 2
    if DEVICE == "cpu" and args.warm:
        parser.error("--warm compiles GPU kernels; it has no CPU mode")

    shapes = parse_shapes(args.shapes)
    if args.warm:
        for item in args.warm.split(","):
            if item == "cp":
                warm_cp([int(p) for p in args.cp_worlds.split(",")])
            elif item in ("gdn", "kda"):
                warm_ops(item, shapes)
            else:
                parser.error(f"--warm takes gdn, kda, cp; got {item!r}")
        return 0
    budget = Budget(args.budget_s)
    rows: list[dict] = []
    command = "python benchmarks/gpu_layers.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report = {"meta": {**_versions(), "command": command.strip()}, "rows": rows}

    def save():
        fill_ratios(rows)
        report["goals"] = evaluate_goals(rows)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "gpu_layers.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
            (args.out / "gpu_layers.md").write_text(render_markdown(report), encoding="utf-8")
        if args.docs:
            write_docs(render_markdown(report), args.docs)

    groups = []
    ops_sections = "".join(c for c in args.sections if c in "ab")
    for section in args.sections:
        if section in "ab":
            if ops_sections and ops_sections not in groups:
                groups.append(ops_sections)
        else:
            groups.append(section)
    for section in groups:
        try:
            if section[0] in "ab":
                section_ops(rows, budget, shapes, args.iters, section)
            elif section in "cd":
                section_layers(rows, budget, shapes, args.iters, section)
            elif section == "e":
                section_cp(rows, budget, parse_shapes(args.cp_shape)[0], args.iters,
                           [int(p) for p in args.cp_worlds.split(",")])
        except Exception as error:  # noqa: BLE001 - a whole section failed to set up
            rows.append({"section": section[0], "name": f"section {section}", "shape": "-",
                         "error": _short_error(error), "traceback": traceback.format_exc()[-2000:]})
            print(f"[{section}] section failed: {_short_error(error)}", flush=True)
        save()
    print(render_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
