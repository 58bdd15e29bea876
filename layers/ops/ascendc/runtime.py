"""Lazy loading of fla-npu's Ascend C operators, API signature checks and device capability policy.

Nothing imports ``fla_npu`` or ``torch_npu`` at module import. :func:`load_ops` imports
``fla_npu.ops.ascendc`` once; :func:`require_api` checks, per feature, that every operator the adapter calls
exists and takes the keywords it passes (fla-npu's API moved between releases: keyword spellings, default
layouts), raising ``RuntimeError`` that names the package, operator and missing parameters.

Device policy (research/seed_origin.md section 2): fla-npu ships kernels for Atlas A2 (Ascend910B), A3
(Ascend910_93 / 910C) and A5 (Ascend950). The composite GDN backward is Ascend 950 only; the forward runs on all
three. Devices are asked through :data:`DEVICE` (``torch.npu`` via ``torch_npu``), which tests replace.
"""
from __future__ import annotations

import importlib
import inspect
from functools import lru_cache

import torch

PACKAGE = "fla-npu (module fla_npu.ops.ascendc; source CANN's set_env.sh first)"
SUPPORTED_SOCS = ("Ascend910B", "Ascend910_93", "Ascend910C", "Ascend950")
GDN_BACKWARD_SOCS = ("Ascend950",)
CHUNK = 64
# Tensor dtypes the kernels take (q/k/v); tests add float32 together with the stand-in's ALLOW_FP32.
KERNEL_DTYPES = {"gdn": (torch.bfloat16, torch.float16), "kda": (torch.bfloat16, torch.float16)}

# Operator -> keywords the adapter passes. Grouped by feature so a package without one feature still serves
# the others, and every missing piece is named.
API = {
    "gdn": {
        "chunk_gated_delta_rule_fwd": ("initial_state", "output_final_state", "chunk_size", "cu_seqlens", "scale",
                                       "use_exp2", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                                       "use_beta_sigmoid_in_kernel", "disable_recompute", "layout"),
        "chunk_gated_delta_rule_bwd": ("chunk_size", "cu_seqlens", "initial_state", "dht", "q_rstd", "k_rstd",
                                       "beta_raw", "use_exp2", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                                       "use_beta_sigmoid_in_kernel", "layout"),
    },
    "kda": {
        "chunk_kda_fwd_prepare": ("layout", "cu_seqlens", "safe_gate", "lower_bound", "use_gate_in_kernel", "A_log",
                                  "dt_bias", "use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "use_exp2",
                                  "backward_mode"),
        "chunk_fwd_h": ("gk", "initial_state", "output_final_state", "chunk_size", "cu_seqlens", "use_exp2"),
        "chunk_kda_fwd_finalize": ("output_layout", "cu_seqlens"),
        "chunk_kda_bwd_prepare": ("scale", "chunk_size", "layout", "cu_seqlens"),
        "chunk_gated_delta_rule_bwd_dhu": ("gK", "h0", "dht", "cu_seqlens", "use_exp2"),
        "chunk_kda_bwd_finalize": ("q_rstd", "k_rstd", "scale", "chunk_size", "use_exp2", "use_qk_l2norm_in_kernel",
                                   "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "safe_gate", "lower_bound",
                                   "output_layout", "cu_seqlens"),
    },
    "cp": {
        "pre_process_fwd_kernel_merged": ("g", "gk", "cu_seqlens", "chunk_size"),
        "pre_process_bwd_kernel_merged": ("g", "gk", "cu_seqlens", "scale", "chunk_size"),
        "merge_fwd_bwd_kernel": ("forward",),
    },
    "cp_gdn": {
        "chunk_gated_delta_rule_fwd_prepare": ("use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "use_exp2",
                                               "cu_seqlens", "output_a"),
        "chunk_bwd_dv_local": ("cu_seqlens",),
    },
}


@lru_cache(maxsize=1)
def load_ops():
    """``fla_npu.ops.ascendc`` (imported once) or RuntimeError naming fla-npu."""
    try:
        return importlib.import_module("fla_npu.ops.ascendc")
    except ImportError as error:
        raise RuntimeError(f"backend='ascendc' requires {PACKAGE}, which is not importable: {error}") from error
    except RuntimeError as error:  # fla-npu raises RuntimeError when the CANN op_api libraries cannot load
        raise RuntimeError(f"backend='ascendc': {PACKAGE} failed to initialise: {error}") from error


@lru_cache(maxsize=None)
def require_api(feature: str):
    """The ops module after checking every operator of ``feature`` ("gdn", "kda", "cp", "cp_gdn")."""
    ops = load_ops()
    problems = []
    for name, keywords in API[feature].items():
        fn = getattr(ops, name, None)
        if fn is None:
            problems.append(f"{name} (missing)")
            continue
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            problems.append(f"{name} (signature not inspectable)")
            continue
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            continue
        missing = [kw for kw in keywords if kw not in params]
        if missing:
            problems.append(f"{name} lacks parameters {missing}")
    if problems:
        raise RuntimeError(f"backend='ascendc' ({feature}): the installed fla-npu "
                           f"{getattr(ops, '__version__', '')} API is incompatible: " + "; ".join(problems))
    return ops


class NpuDevice:
    """Ascend devices through ``torch_npu`` (imported lazily)."""

    def check_runtime(self) -> None:
        try:
            importlib.import_module("torch_npu")
        except ImportError as error:
            raise RuntimeError(f"backend='ascendc' requires torch_npu (Ascend PyTorch adapter): {error}") from error
        if not torch.npu.is_available():
            raise RuntimeError("backend='ascendc' needs an Ascend NPU, but torch.npu.is_available() is False")

    def name(self, device: torch.device) -> str:
        if device.type != "npu":
            raise ValueError(f"backend='ascendc' needs tensors on an Ascend NPU, got device {device}")
        self.check_runtime()
        index = device.index if device.index is not None else torch.npu.current_device()
        return str(torch.npu.get_device_name(index))


DEVICE = NpuDevice()


def soc(device: torch.device) -> str:
    """The device's SoC name, checked against the SoCs fla-npu builds for."""
    name = DEVICE.name(device)
    if not name.startswith(SUPPORTED_SOCS):
        raise RuntimeError(f"backend='ascendc': fla-npu supports {SUPPORTED_SOCS}, found {name!r}")
    return name


def check_dtype(kind: str, **tensors) -> None:
    allowed = KERNEL_DTYPES[kind]
    for name, x in tensors.items():
        if x.dtype not in allowed:
            raise TypeError(f"backend='ascendc' {kind.upper()} kernels take {[str(d) for d in allowed]}; "
                            f"{name} has {x.dtype}")


def host_offsets(cu_seqlens: torch.Tensor | None):
    """Packed boundaries as a host list of ints (cu_seqlens is already a validated CPU int64 tensor, so this
    never synchronises a device)."""
    return None if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]


def slots(name: str, result, count: int, required: tuple[int, ...]):
    """Check a fixed-slot ABI result: ``count`` slots with tensors at ``required``."""
    if not isinstance(result, (tuple, list)) or len(result) != count:
        got = len(result) if isinstance(result, (tuple, list)) else type(result).__name__
        raise RuntimeError(f"fla-npu {name} must return {count} slots, got {got}")
    missing = [i for i in required if not isinstance(result[i], torch.Tensor)]
    if missing:
        raise RuntimeError(f"fla-npu {name} left required slots {missing} empty")
    return tuple(result)
