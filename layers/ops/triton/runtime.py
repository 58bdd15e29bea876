"""Lazy loading and capability checks for flash-linear-attention (FLA) 0.6 on NVIDIA GPUs.

Nothing here imports ``fla`` or ``triton`` at module import time; :func:`load_fla` does it once, checks
versions and the keyword signatures this backend relies on, and raises ``RuntimeError`` naming what is
missing. FLA's own constraints that matter to callers (checked in the FLA 0.6.0 wheel source):

- q, k, v, g, beta token-major ``[B, T, heads, dim]``; head dim K <= 256; V any width (tiled by the kernels);
- KDA ``initial_state`` must be float32 (asserted by FLA); GDN accepts any float state;
- ``cu_seqlens`` must live on the GPU (the kernels index it); a CPU copy avoids host syncs;
- GDN backward on Hopper (sm90) with triton 3.4 <= version < 3.7.1 gives wrong gradients (FLA issue #640) and
  FLA raises inside backward unless the tilelang backend is installed; we raise before the forward instead.

FLA's backend dispatch (``fla/backends.py``): FLA 0.6 wraps its public ops and many inner kernels in ``@dispatch``,
which runs another kernel package's implementation (FlashQLA for GDN, TileLang / FlashKDA for KDA, triton-ascend on
NPUs) when it is installed and accepts the call. The ``triton`` backend means FLA's Triton kernels: :func:`load_fla`
sets ``FLA_DISABLE_BACKEND_DISPATCH=1`` (FLA's own switch, read when ``fla.backends`` is imported) unless the user set
it; ``FLA_DISABLE_BACKEND_DISPATCH=0`` is the user's choice of FLA's dispatch (the self-check then names the
candidates). When FLA was imported earlier with its dispatch on and the variable unset, a RuntimeError names every
candidate available here (none: FLA's Triton kernels run anyway). Calling the undecorated public functions would not
do: their inner kernels are dispatched by name too. :func:`kernels_in_use` says which kernels run.

With Triton's interpreter on (``TRITON_INTERPRET=1`` before FLA is imported) the same FLA kernels run on CPU
tensors through numpy, slowly; the backend then accepts CPU tensors. This is how CPU CI runs FLA's kernels
(tests/support/triton_interpreter.py, which also patches three gaps of triton 3.7's interpreter).
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch

from layers.base.compat import tensor_version
# MIN_TRITON is FLA 0.6's own floor, 3.7.1 is required for GDN backward on Hopper (see module doc)
from layers.ops.triton.versions import INSTALL_HINT, MIN_FLA, MIN_TRITON, PACKAGES, SAFE_TRITON_HOPPER_GDN_BWD

DISPATCH_ENV = "FLA_DISABLE_BACKEND_DISPATCH"   # FLA's switch: "1" bypasses its backend dispatch (read at import)
# the fla.ops packages whose kernels this backend and the CP engine call (layers/cp/triton_engine_exchange.py)
_OUR_FLA_OPS = ("gated_delta_rule", "kda", "gla", "common", "cp")


# Keywords this backend passes; a renamed/removed one in a future FLA must fail loudly, not silently.
_REQUIRED_KEYWORDS = {
    "chunk_gated_delta_rule": ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
                               "use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "cu_seqlens",
                               "cu_seqlens_cpu"),
    "chunk_kda": ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
                  "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "safe_gate",
                  "lower_bound", "cu_seqlens", "cu_seqlens_cpu"),
    "causal_conv1d": ("x", "weight", "bias", "initial_state", "output_final_state", "activation", "backend",
                      "cu_seqlens", "cu_seqlens_cpu"),
}
# Passed through **kwargs in FLA 0.6 (not visible in the signature): use_gate_in_kernel/A_log/dt_bias for
# GDN, A_log/dt_bias for KDA. Both functions must therefore accept **kwargs.
_NEEDS_VAR_KEYWORD = ("chunk_gated_delta_rule", "chunk_kda")


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (3 - len(parts)))


def _fmt(version: tuple[int, ...]) -> str:
    return ".".join(str(x) for x in version)


@dataclass(frozen=True)
class FLA:
    """The FLA entry points this backend calls, plus the versions found."""
    chunk_gated_delta_rule: Callable
    chunk_kda: Callable
    causal_conv1d: Callable
    l2norm: Callable   # fla.modules.norm.l2norm.l2norm: the l2norm_fwd / l2norm_bwd kernels the two ops run in-kernel
    fla_version: tuple[int, ...]
    triton_version: tuple[int, ...]
    interpreted: bool  # Triton's interpreter was on when FLA's kernels were loaded (they then take CPU tensors)
    dispatch: bool = False   # FLA's backend dispatch is on (FLA_DISABLE_BACKEND_DISPATCH=0: the user's choice)
    dispatch_candidates: tuple = ()   # "registry: backend" FLA's dispatch may run instead of its Triton kernels


def _check_signature(name: str, fn: Callable) -> None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as error:
        raise RuntimeError(f"backend='triton': flash-linear-attention's {name} has no inspectable signature; "
                           f"need {PACKAGES}") from error
    missing = [p for p in _REQUIRED_KEYWORDS[name] if p not in params]
    if missing:
        raise RuntimeError(f"backend='triton': flash-linear-attention's {name} lacks keyword(s) {missing}; "
                           f"need {PACKAGES}")
    if name in _NEEDS_VAR_KEYWORD and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        raise RuntimeError(f"backend='triton': flash-linear-attention's {name} no longer takes **kwargs "
                           f"(A_log/dt_bias/use_gate_in_kernel); need {PACKAGES}")


def import_fla_functions(who: str, *paths: str) -> tuple[Callable, ...]:
    """FLA functions named ``"module:attribute"``, in order; a RuntimeError naming them (and ``who`` needs them)."""
    try:
        return tuple(getattr(importlib.import_module(module), name)
                     for module, name in (path.split(":") for path in paths))
    except (ImportError, AttributeError) as error:
        names = ", ".join(path.split(":")[1] for path in paths)
        raise RuntimeError(f"backend='triton': {who} needs flash-linear-attention's {names} ({error}); "
                           f"need {PACKAGES}. Install: {INSTALL_HINT}") from error


@lru_cache(maxsize=1)
def load_fla() -> FLA:
    """Import FLA's public ops once; RuntimeError naming the missing package or version otherwise."""
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError(f"backend='triton' requires triton, which is not installed; need {PACKAGES}. "
                           f"Install: {INSTALL_HINT}")
    import triton

    triton_version = _version_tuple(triton.__version__)
    if triton_version < MIN_TRITON:
        raise RuntimeError(f"backend='triton' found triton {triton.__version__}, too old; need {PACKAGES}. "
                           f"Install: {INSTALL_HINT}")
    default_dispatch_off()
    try:
        fla = importlib.import_module("fla")
    except ImportError as error:
        raise RuntimeError(f"backend='triton' requires flash-linear-attention (package 'fla'), which is not "
                           f"importable ({error}); need {PACKAGES}. Install: {INSTALL_HINT}") from error
    fla_version = _version_tuple(getattr(fla, "__version__", "0"))
    if fla_version < MIN_FLA:
        raise RuntimeError(f"backend='triton' found flash-linear-attention {getattr(fla, '__version__', '?')}, "
                           f"too old; need {PACKAGES}. Install: {INSTALL_HINT}")
    gdn, kda, conv, l2norm = import_fla_functions(
        f"training (flash-linear-attention {_fmt(fla_version)} found)",
        "fla.ops.gated_delta_rule:chunk_gated_delta_rule", "fla.ops.kda:chunk_kda",
        "fla.modules.causal_conv1d:causal_conv1d", "fla.modules.norm.l2norm:l2norm")
    for name, fn in (("chunk_gated_delta_rule", gdn), ("chunk_kda", kda), ("causal_conv1d", conv)):
        _check_signature(name, fn)
    dispatch, candidates = dispatch_state(importlib.import_module("fla.backends"), os.environ.get(DISPATCH_ENV))
    return FLA(gdn, kda, conv, l2norm, fla_version, triton_version, interpreted=_interpreter_env(),
               dispatch=dispatch, dispatch_candidates=candidates)


def default_dispatch_off(modules=sys.modules, environ=os.environ) -> bool:
    """Before FLA is imported: ``FLA_DISABLE_BACKEND_DISPATCH=1`` (FLA's Triton kernels, not another package's)
    unless ``fla.backends`` is imported already or the user set the variable. True when it was set here."""
    if "fla.backends" in modules or DISPATCH_ENV in environ:
        return False
    environ[DISPATCH_ENV] = "1"
    return True


def dispatch_candidates(fla_backends) -> tuple[str, ...]:
    """``"registry: backend"`` for every backend registered with FLA's dispatch (``fla_backends``: the
    ``fla.backends`` module) for a kernel we call that is available and enabled here, sorted."""
    registries = list(fla_backends._operation_registries.items())
    registries += [(r.operation_name, r) for r in fla_backends._function_registries.values()]
    found = set()
    for name, registry in registries:
        package = name.removeprefix("fla.ops.").split(".")[0]
        if package not in _OUR_FLA_OPS and not name.startswith("fla.modules"):
            continue
        for backend in registry._get_sorted_backends():
            if backend.is_available() and backend.is_enabled():
                found.add(f"{name}: {backend.backend_type}")
    return tuple(sorted(found))


def dispatch_state(fla_backends, setting: str | None) -> tuple[bool, tuple]:
    """``(dispatch on, candidates)`` of the imported ``fla.backends``; ``setting``: FLA_DISABLE_BACKEND_DISPATCH.
    RuntimeError when the dispatch is on without the user's "0" and a candidate would replace a Triton kernel."""
    try:
        if fla_backends._DISPATCH_DISABLED:
            return False, ()
        candidates = dispatch_candidates(fla_backends)
    except AttributeError as error:
        raise RuntimeError(f"backend='triton': flash-linear-attention's backend dispatch (fla.backends) is not the "
                           f"one of FLA 0.6 ({error}); need {PACKAGES}") from error
    if candidates and setting != "0":
        raise RuntimeError(
            f"backend='triton' runs flash-linear-attention's Triton kernels, but fla was imported before it with "
            f"its backend dispatch on, which would run {', '.join(candidates)} instead: set "
            f"{DISPATCH_ENV}=1 before anything imports fla, or {DISPATCH_ENV}=0 to let FLA's dispatch choose")
    return True, candidates


def kernels_in_use() -> str:
    """Which kernels the backend runs, in one line (the self-check prints it)."""
    fla = load_fla()
    where = "Triton's interpreter" if fla.interpreted else "the GPU"
    head = (f"flash-linear-attention {_fmt(fla.fla_version)}'s Triton kernels (triton {_fmt(fla.triton_version)}, "
            f"{where})")
    if not fla.dispatch:
        return f"{head}; FLA's backend dispatch off ({DISPATCH_ENV}=1)"
    others = ", ".join(fla.dispatch_candidates) or "none available here"
    setting = os.environ.get(DISPATCH_ENV, "unset")
    return f"{head}, or what FLA's backend dispatch picks ({DISPATCH_ENV}={setting}): {others}"


def _interpreter_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")


def interpreter_enabled() -> bool:
    """True when FLA's kernels were loaded under Triton's interpreter (``TRITON_INTERPRET=1`` at first use)."""
    return load_fla().interpreted


def check_device_available() -> None:
    """RuntimeError unless an NVIDIA GPU is visible or Triton's interpreter is on (FLA has no other CPU path)."""
    if interpreter_enabled():
        return
    if not torch.cuda.is_available() or torch.version.cuda is None:
        raise RuntimeError("backend='triton' runs flash-linear-attention's Triton kernels and needs an NVIDIA "
                           "GPU (torch.cuda.is_available() is False or this is not a CUDA build of torch); "
                           "with TRITON_INTERPRET=1 set before FLA is imported they run on CPU in Triton's "
                           "interpreter (slow; FLA 0.6 on triton 3.7 needs the interpreter patches of "
                           "tests/support/triton_interpreter.py, see docs/backends.md)")


_READY = False


def check_available() -> None:
    """RuntimeError naming flash-linear-attention / triton / the GPU when the backend cannot run here.

    Only success is remembered (packages and visible GPUs do not change within a process), so the per-call
    cost after the first success is one global read; a failure is re-checked and re-raised on every call."""
    global _READY
    if _READY:
        return
    load_fla()
    check_device_available()
    _READY = True


def check_tensor_device(name: str, x: torch.Tensor) -> None:
    """CUDA tensors (CPU ones too under Triton's interpreter) in a float dtype FLA supports."""
    if x.device.type != "cuda" and not (x.device.type == "cpu" and interpreter_enabled()):
        raise ValueError(f"backend='triton' needs CUDA tensors (CPU tensors only with TRITON_INTERPRET=1); "
                         f"{name} is on {x.device}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"backend='triton' supports float32/float16/bfloat16 inputs; {name} has {x.dtype}")


def check_inputs(q, k, v, g, beta) -> None:
    """Device and dtype of the op inputs, and FLA's head-dim limit K <= 256."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_tensor_device(name, x)
    if q.shape[-1] > 256:
        raise ValueError(f"backend='triton': flash-linear-attention supports head dim K <= 256, got K={q.shape[-1]}")


@lru_cache(maxsize=1)
def _tilelang_installed() -> bool:
    return importlib.util.find_spec("tilelang") is not None


_GDN_BWD_BLOCKERS: dict = {}


def gdn_backward_blocker(device: torch.device) -> str | None:
    """Why FLA cannot differentiate GDN on ``device`` with this triton, or None when it can.

    FLA 0.6 raises in ``chunk_bwd_dqkwg`` on Hopper with 3.4.0 <= triton < 3.7.1 (wrong gradients, FLA #640)
    unless its tilelang backend is installed. The answer is cached per device index (it depends only on the
    installed packages and the device's compute capability). Interpreted kernels (CPU) are not affected."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _GDN_BWD_BLOCKERS:
        return _GDN_BWD_BLOCKERS[index]
    reason = None
    version = load_fla().triton_version
    if (SAFE_TRITON_HOPPER_GDN_BWD > version >= (3, 4, 0) and not _tilelang_installed()
            and torch.cuda.get_device_capability(index)[0] == 9):
        reason = (f"backend='triton': GDN backward on Hopper ({torch.cuda.get_device_name(index)}) needs "
                  f"triton>=3.7.1, found triton {_fmt(version)} (flash-linear-attention issue #640: wrong "
                  f"gradients with triton 3.4-3.7.0). Install triton>=3.7.1 (or tilelang), or run GDN forward "
                  f"without grad")
    _GDN_BWD_BLOCKERS[index] = reason
    return reason


class DeviceCuSeqlens:
    """``cache(cu_seqlens, device)`` -> ``(cu on device, cu on CPU)`` for FLA. The CPU copy lets FLA build chunk
    indices without a sync.

    Device copies are cached per CPU buffer: (data pointer, offset, shape, stride, version counter, device). The
    public ops hand over a fresh ``detach()`` of the caller's tensor on every call; it shares the buffer and
    the version counter, so a plan's boundaries are uploaded once, and an in-place change of the caller's
    tensor bumps the version and uploads again. The cache holds the CPU tensor, so its buffer cannot be
    freed and reused by another tensor while the entry lives.
    """

    def __init__(self, size: int = 32):
        self.size = size
        self._entries: dict = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __call__(self, cu_seqlens: torch.Tensor | None, device: torch.device):
        if cu_seqlens is None:
            return None, None
        key = (cu_seqlens.data_ptr(), cu_seqlens.storage_offset(), cu_seqlens.shape, cu_seqlens.stride(),
               tensor_version(cu_seqlens), device)
        hit = self._entries.get(key)
        if hit is not None:
            return hit[1], cu_seqlens
        on_device = cu_seqlens.to(device=device, dtype=torch.int64, non_blocking=True)
        if len(self._entries) >= self.size:
            self._entries.clear()
        self._entries[key] = (cu_seqlens, on_device)
        return on_device, cu_seqlens


device_cu_seqlens = DeviceCuSeqlens()  # the one cache of this process, used by the ops


def history_to_fla_cache(history: torch.Tensor) -> torch.Tensor:
    """``[N, W-1, D]`` (oldest token first) -> FLA's conv cache ``[N, D, W]``: slot 0 unused, slots 1..W-1 hold
    the W-1 previous tokens in order (FLA reads token t-j, j=1..W-1, from slot W-j). Differentiable."""
    N, _, D = history.shape
    padded = torch.cat([history.new_zeros(N, 1, D), history], dim=1)
    return padded.transpose(1, 2).contiguous()
