"""Lazy loading of fla-npu's Ascend C operators, API signature checks and device capability policy.

Nothing imports ``fla_npu`` or ``torch_npu`` at module import. :func:`load_ops` imports
``fla_npu.ops.ascendc`` once; :func:`require_api` checks, per feature, that every operator the adapter calls
exists and takes the keywords it passes (fla-npu's API moved between releases: keyword spellings, default
layouts), raising ``RuntimeError`` that names the package, operator and missing parameters.

Contract: flashserve/flash-linear-attention-npu at ``PINNED_REVISION`` (docs/backends.md, "ascendc"). Exports
move between revisions: the KDA backward stages are exported only by later revisions (checked separately, at
the first KDA call that needs gradients), and the backward CP summary is ``chunk_delta_h_bwd_preprocess`` in
the pinned revision and ``pre_process_bwd_kernel_merged`` later (:data:`ALIASES`, either is accepted).

Builds that wrap every export in ``_make_raw_wrapper`` (04097f56, main 17e24fdd) carry
``functools.wraps(_get_direct_op)``, so ``inspect.signature`` reads ``(name: str)`` for every operator; the check
then reads the signature of the wrapped implementation from the module's ``ASCENDC_CTYPES_OPS`` table, and skips
the keyword check of an operator whose implementation it cannot reach (the call itself then names a bad keyword).

Device policy: fla-npu ships kernels for Atlas A2 (Ascend910B), A3 (Ascend910_93 / 910C) and A5 (Ascend950). Ascend
950 only: the composite GDN backward (A2/A3 run GDN's backward on the building blocks instead, feature
``gdn_staged_bwd``, ``layers/ops/ascendc/gdn_staged.py``), ``chunk_gated_delta_rule_fwd_prepare`` (A2/A3 GDN CP gets w
/ u from the composite forward's A through ``recompute_w_u_fwd``), the KDA backward stages (the ChunkKdaBwdPrepare /
ChunkKdaBwdFinalize op-defs register ascend950 only; A2/A3 run KDA's backward on the monolithic ``chunk_kda_bwd``,
feature ``kda_fused_bwd``, ``layers/ops/ascendc/kda_fused.py``, without initial states or terminal gradients, so KDA's
state-passing CP trains on Ascend 950 only), the composite forward's in-kernel L2 norm / sigmoid (run in PyTorch
elsewhere). A3 rejects the BSND/TND layouts (BNSD is used there). The recurrent (decode) kernels and the CP summary /
merge kernels register all three. Devices are asked through :data:`DEVICE` (``torch.npu`` via ``torch_npu``), which
tests replace.
"""
from __future__ import annotations

import importlib
import inspect
from functools import lru_cache

import torch

PACKAGE = "fla-npu (module fla_npu.ops.ascendc; source CANN's set_env.sh first)"
PINNED_REVISION = "d05824feb13e20c620931b9eceafea88ae745890"
SUPPORTED_SOCS = ("Ascend910B", "Ascend910_93", "Ascend910C", "Ascend950")
A5_SOCS = ("Ascend950",)
A3_SOCS = ("Ascend910_93", "Ascend910C")
GDN_BACKWARD_SOCS = SUPPORTED_SOCS  # composite on A5, the building blocks (gdn_staged_bwd) on A2/A3
KDA_BACKWARD_SOCS = A5_SOCS
CHUNK = 64
# Tensor dtypes the kernels take (q/k/v): the composite GDN kernels are bf16-only, and so is KDA (its prepare
# takes fp16 too, but chunk_fwd_h, chunk_kda_fwd_finalize and the backward stages are bf16-only), and so are the
# recurrent (decode) kernels; tests add float32 together with the stand-in's ALLOW_FP32. Keyed by the API group of
# a kind's kernels (its ``layers.ops.kinds`` descriptor's ``kernels["ascendc"]["api"]``).
KERNEL_DTYPES_REAL = {"gdn": (torch.bfloat16,), "kda": (torch.bfloat16,)}
KERNEL_DTYPES = dict(KERNEL_DTYPES_REAL)
# Inputs the real operators demand in bf16 whatever the model dtype (composite backward initial_state, CP gk).
STATE_DTYPE = torch.bfloat16

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
        "chunk_fwd_h": ("gk", "initial_state", "output_final_state", "chunk_size", "cu_seqlens", "chunk_indices",
                        "use_exp2"),
        "chunk_kda_fwd_finalize": ("output_layout", "cu_seqlens"),
    },
    "kda_bwd": {
        "chunk_kda_bwd_prepare": ("scale", "chunk_size", "layout", "cu_seqlens"),
        "chunk_gated_delta_rule_bwd_dhu": ("gK", "h0", "dht", "cu_seqlens", "chunk_indices", "use_exp2"),
        "chunk_kda_bwd_finalize": ("q_rstd", "k_rstd", "scale", "chunk_size", "use_exp2", "use_qk_l2norm_in_kernel",
                                   "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "safe_gate", "lower_bound",
                                   "output_layout", "cu_seqlens"),
    },
    "kda_fused_bwd": {  # KDA backward off Ascend 950 (kda_fused.py; undated _stable.py 8-slot signature)
        "chunk_kda_bwd": ("raw_g", "A_log", "dt_bias", "initial_state", "dht", "cu_seqlens", "chunk_indices",
                          "chunk_size", "safe_gate", "lower_bound", "use_gate_in_kernel", "disable_recompute",
                          "use_exp2", "state_v_first"),
    },
    "gdn_staged_bwd": {  # GDN backward off Ascend 950 (gdn_staged.py; main 17e24fdd _aclnn_ctypes.py signatures)
        "recompute_w_u_fwd": ("g", "cu_seqlens", "chunk_indices"),
        "chunk_fwd_h": ("initial_state", "output_final_state", "chunk_size", "cu_seqlens", "chunk_indices",
                        "use_exp2"),
        "chunk_bwd_dv_local": ("cu_seqlens", "chunk_indices"),
        "chunk_gated_delta_rule_bwd_dhu": ("g", "h0", "dht", "cu_seqlens", "chunk_indices", "use_exp2"),
        "chunk_bwd_dqkwg": ("cu_seqlens", "chunk_indices", "scale", "use_exp2"),
        "prepare_wy_repr_bwd_da": ("chunk_size", "cu_seqlens", "chunk_indices"),
        "prepare_wy_repr_bwd_full": ("cu_seqlens", "chunk_indices"),
        "chunk_local_cumsum": ("cu_seqlens", "reverse", "head_first"),
    },
    "cp": {
        "pre_process_fwd_kernel_merged": ("g", "gk", "cu_seqlens", "chunk_size"),
        "pre_process_bwd_kernel_merged": ("g", "gk", "cu_seqlens"),
        "merge_fwd_bwd_kernel": ("forward",),
    },
    "cp_gdn": {
        "chunk_gated_delta_rule_fwd_prepare": ("use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "use_exp2",
                                               "cu_seqlens", "output_a"),
        "chunk_bwd_dv_local": ("cu_seqlens", "chunk_indices"),
    },
    "decode_gdn": {
        "recurrent_gated_delta_rule": ("beta", "scale", "actual_seq_lengths", "ssm_state_indices", "g"),
    },
    "decode_kda": {
        "recurrent_kda": ("cu_seqlens", "A_log", "dt_bias", "layout", "scale", "output_final_state",
                          "inplace_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                          "use_beta_sigmoid_in_kernel", "safe_gate", "lower_bound", "state_v_first"),
    },
}
ALIASES = {"pre_process_bwd_kernel_merged": ("pre_process_bwd_kernel_merged", "chunk_delta_h_bwd_preprocess")}
# The fla-npu build that has each feature, for the errors.
FEATURE_SOURCE = {"kda_bwd": "fla-npu revisions that export npu_chunk_kda_bwd_prepare / npu_chunk_kda_bwd_finalize "
                             f"(after {PINNED_REVISION[:8]}, whose export table lacks them)",
                  "kda_fused_bwd": "an fla-npu build exporting npu_chunk_kda_bwd (the head of PR #334, 7a8a59a3, "
                                   "2026-08-20, and later _stable.py versions; main 17e24fdd's export table lacks "
                                   "it), the KDA backward on Ascend 910B / 910_93; or train with backend='eager'",
                  "gdn_staged_bwd": "an fla-npu build exporting the GDN building blocks (main 17e24fdd's export table "
                                    "has them; d05824fe examples/chunk_gdn_cp.py imports them), the GDN backward on "
                                    "Ascend 910B / 910_93; or train with backend='eager'",
                  "decode_gdn": "fla-npu from 8a63cf3e (2026-08-13) on, which exports npu_recurrent_gated_delta_rule "
                                "(tag v26.6.0 does not); or generate with backend='eager'",
                  "decode_kda": "fla-npu from 5eabe875 (2026-07-20) on, which exports npu_recurrent_kda (tag v26.6.0 "
                                "does not); or generate with backend='eager'"}


@lru_cache(maxsize=1)
def load_ops():
    """``fla_npu.ops.ascendc`` (imported once) or RuntimeError naming fla-npu."""
    try:
        return importlib.import_module("fla_npu.ops.ascendc")
    except ImportError as error:
        raise RuntimeError(f"backend='ascendc' requires {PACKAGE}, which is not importable: {error}") from error
    except (RuntimeError, OSError) as error:  # CANN op_api libraries / OPP paths missing (FileNotFoundError)
        raise RuntimeError(f"backend='ascendc': {PACKAGE} failed to initialise "
                           f"({type(error).__name__}: {error})") from error


def version() -> str:
    """The installed fla-npu version (``fla_npu.__version__``; the ops module has none)."""
    return str(getattr(importlib.import_module("fla_npu"), "__version__", "unknown"))


def op(ops, name: str):
    """Operator ``name`` of ``ops``, under any of its spellings (:data:`ALIASES`)."""
    for spelling in ALIASES.get(name, (name,)):
        fn = getattr(ops, spelling, None)
        if fn is not None:
            return fn
    return None


def _is_raw_wrapper(fn, params) -> bool:
    """fla-npu's ``_make_raw_wrapper`` export: ``functools.wraps(_get_direct_op)`` makes its signature ``(name)``."""
    return list(params) == ["name"] or getattr(getattr(fn, "__wrapped__", None), "__name__", "") == "_get_direct_op"


def implementation(ops, name: str, fn):
    """The function behind export ``fn`` whose signature tells its keywords: ``fn`` itself, or for a raw
    wrapper its entry in the module's ``ASCENDC_CTYPES_OPS`` table (None when that cannot be reached)."""
    params = inspect.signature(fn).parameters
    if not _is_raw_wrapper(fn, params):
        return fn
    table = getattr(ops, "ASCENDC_CTYPES_OPS", None)
    if not isinstance(table, dict):
        return None
    for key in (getattr(fn, "__name__", ""), f"npu_{name}", name):
        if key in table:
            return table[key]
    return None


@lru_cache(maxsize=None)
def require_api(feature: str):
    """The ops module after checking every operator of ``feature`` (a key of :data:`API`)."""
    ops = load_ops()
    problems = []
    for name, keywords in API[feature].items():
        fn = op(ops, name)
        if fn is None:
            problems.append(f"{' / '.join(ALIASES.get(name, (name,)))} (missing)")
            continue
        try:
            impl = implementation(ops, name, fn)
            if impl is None:  # a raw wrapper whose implementation is out of reach: keywords not checkable
                continue
            params = inspect.signature(impl).parameters
        except (TypeError, ValueError):
            problems.append(f"{name} (signature not inspectable)")
            continue
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            continue
        missing = [kw for kw in keywords if kw not in params]
        if missing:
            problems.append(f"{name} lacks parameters {missing}")
    if problems:
        needs = f"; this feature needs {FEATURE_SOURCE[feature]}" if feature in FEATURE_SOURCE else ""
        raise RuntimeError(f"backend='ascendc' ({feature}): the installed fla-npu {version()} API is "
                           f"incompatible (contract: revision {PINNED_REVISION[:8]}): " + "; ".join(problems) + needs)
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


DTYPE_REASON = {"gdn": "the composite GDN and recurrent kernels are bf16-only",
                "kda": "chunk_fwd_h, chunk_kda_fwd_finalize, the KDA backward stages and recurrent_kda are "
                       "bf16-only"}


def check_dtype(kind: str, **tensors) -> None:
    """TypeError unless every tensor has a dtype the kernels of API group ``kind`` ("gdn", "kda") take."""
    allowed = KERNEL_DTYPES[kind]
    for name, x in tensors.items():
        if x.dtype not in allowed:
            raise TypeError(f"backend='ascendc' {kind.upper()} kernels take {[str(d) for d in allowed]} "
                            f"({DTYPE_REASON[kind]}); {name} has {x.dtype}")


def check_soc_features(device_name: str, **needs: bool) -> None:
    """One RuntimeError listing every feature this SoC lacks; ``needs``: gdn_backward, kda_backward."""
    missing = []
    if needs.get("kda_backward") and not device_name.startswith(KDA_BACKWARD_SOCS):
        missing.append("KDA backward with initial states / terminal gradients (KDA CP state passing) uses fla-npu's "
                       "ChunkKdaBwdPrepare / ChunkKdaBwdFinalize, whose op-defs register Ascend950 only; on this SoC "
                       "KDA trains through the monolithic ChunkKdaBwd without them (single rank, packed, CP method "
                       "'ulysses'): use that, run forward without grad, or use backend='eager'")
    if needs.get("gdn_backward") and not device_name.startswith(GDN_BACKWARD_SOCS):
        missing.append(f"GDN backward runs on {GDN_BACKWARD_SOCS} only: run forward without grad or use "
                       "backend='eager'")
    if missing:
        raise RuntimeError(f"backend='ascendc' on {device_name}: " + "; ".join(missing))


def chunk_indices(cu: list[int] | None, chunk: int = CHUNK) -> list[int] | None:
    """fla-npu's canonical chunk index array for host offsets ``cu``: (sequence, chunk) pairs, flattened."""
    if cu is None:
        return None
    return [v for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])) for c in range(-(-(e - s) // chunk)) for v in (n, c)]


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
