"""What a backend cannot run on this device and installed build, asked before any kernel runs.

Each answer is a reason (the backend's own message) or None. The self-check prints those paths as ``n/a`` with the
reason instead of running them, so an exception during a run is always reported as an ERROR, never mistaken for a
missing feature. Sources: ascendc, ``layers/ops/ascendc/runtime.py`` (SoC policy, exported fla-npu features) and
``layers/cp/ascendc.py`` (its native CP methods); triton, FLA's GDN backward on Hopper with an old triton
(``layers/ops/triton/runtime.py``); decode steps, the backend module's ``delta_rule_step`` / ``causal_conv1d_step``
and, on ascendc, whether the installed fla-npu exports the recurrent kernels.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from layers.base.choices import CP_METHODS
from layers.ops.backends import get_backend


@dataclass
class Limits:
    backward: dict = field(default_factory=dict)     # kind ("gdn" | "kda") -> reason
    state_cp: dict = field(default_factory=dict)     # kind -> reason the state-passing CP methods cannot run
    state_cp_backward: dict = field(default_factory=dict)  # kind -> reason their backward cannot run
    # kind -> reason a backward takes no initial state / final-state gradient and needs the safe (bounded) gate
    state_grad: dict = field(default_factory=dict)
    cp_methods: dict = field(default_factory=dict)   # CP method -> reason
    decode: dict = field(default_factory=dict)       # decode rows "gdn" | "kda" | "conv" -> reason


def _raised(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except RuntimeError as error:
        return str(error)
    return None


def _decode(impl, backend):
    """Reasons the decode rows ("gdn", "kda", "conv") cannot run: the backend module lacks the step function."""
    missing = f"backend={backend!r} has no decode-step kernels"
    return {"gdn": None if getattr(impl, "delta_rule_step", None) else missing,
            "kda": None if getattr(impl, "delta_rule_step", None) else missing,
            "conv": None if getattr(impl, "causal_conv1d_step", None) else missing}


def probe(backend: str, device) -> Limits:
    """The limits of ``backend`` for tensors on ``device`` (the backend must be available: ``get_backend`` passed)."""
    impl = get_backend(backend)
    limits = Limits(decode=_decode(impl, backend))
    if backend == "triton":
        from layers.ops.triton.runtime import gdn_backward_blocker

        limits.backward["gdn"] = gdn_backward_blocker(device)
    elif backend == "ascendc":
        from layers.cp.ascendc import SUPPORTED_METHODS
        from layers.ops.ascendc import runtime

        from layers.ops.ascendc.gdn import staged_gdn_backward

        soc = runtime.soc(device)
        staged = staged_gdn_backward(soc)     # Ascend 910B / 910_93: GDN's backward and CP on the building blocks
        gdn_parts = _raised(runtime.require_api, "gdn_staged_bwd") if staged else None
        limits.backward["gdn"] = _raised(runtime.check_soc_features, soc, gdn_backward=True) or gdn_parts
        if staged:   # Ascend 910B / 910_93: KDA's backward is the monolithic ChunkKdaBwd (kda_fused.py)
            limits.backward["kda"] = _raised(runtime.require_api, "kda_fused_bwd")
            limits.state_grad["kda"] = (f"backend='ascendc' on {soc}: KDA backward is fla-npu's monolithic "
                                        "ChunkKdaBwd, which takes no initial_state / dht and safe_gate=True only "
                                        "(layers/ops/ascendc/kda_fused.py)")
            limits.state_cp_backward["kda"] = _raised(runtime.check_soc_features, soc, kda_backward=True)
        else:
            limits.backward["kda"] = (_raised(runtime.check_soc_features, soc, kda_backward=True)
                                      or _raised(runtime.require_api, "kda_bwd"))
        cp_api = _raised(runtime.require_api, "cp")
        limits.state_cp["kda"] = cp_api
        limits.state_cp["gdn"] = cp_api or (gdn_parts if staged else _raised(runtime.require_api, "cp_gdn"))
        for kind in ("gdn", "kda"):   # the recurrent kernels: exported by later fla-npu builds only
            limits.decode[kind] = limits.decode[kind] or _raised(runtime.require_api, f"decode_{kind}")
        for method in CP_METHODS:
            if method != "ulysses" and method not in SUPPORTED_METHODS:
                limits.cp_methods[method] = (f"backend='ascendc' has no native {method} path (layers/cp/ascendc.py "
                                             f"runs {', '.join(SUPPORTED_METHODS)} and Ulysses)")
    return limits
