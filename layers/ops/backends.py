"""Kernel backend registry: ``eager`` (pure PyTorch), ``triton`` (flash-linear-attention), ``ascendc`` (fla-npu).

A backend is a module exposing, with already-validated inputs (see ``layers/ops/validation.py``)::

    chunk_gated_delta_rule(q, k, v, g, beta, *, scale, initial_state, output_final_state,
                           use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, use_gate_in_kernel,
                           A_log, dt_bias, cu_seqlens) -> (o, final_state_or_None)
    chunk_kda(..., same keywords ..., lower_bound, safe_gate) -> (o, final_state_or_None)
    causal_conv1d(x, weight, *, bias, activation, cu_seqlens, history) -> y
    delta_rule_final_state(kind, k, v, g, beta, *, initial_state, cu_seqlens, **flags) -> final [N,HV,K,V]
        (final states only, for the CP engine's affine summaries; see layers/ops/summary.py)

Optional: ``qk_l2norm(x) -> x / sqrt(sum x^2 + 1e-6)`` (differentiable) where it is the very kernel the ops run with
``use_qk_l2norm_in_kernel`` (triton: FLA's ``l2norm``); the mixers' ``hp_conv`` recompute part then normalises q/k
itself (layers/mixers/delta/mixer.py).

Backends hold no CP code: native CP decompositions live with the CP engine (``layers/cp/state_parallel.py``'s
``NATIVE_CP``).

``cu_seqlens`` is None or a CPU int64 tensor. Optional backends are imported lazily and raise
``RuntimeError`` naming the missing package; nothing falls back to another backend.
"""
from __future__ import annotations

import importlib

from layers.base.choices import BACKENDS

_MODULES = {
    "eager": "layers.ops.eager.backend",
    "triton": "layers.ops.triton.backend",
    "ascendc": "layers.ops.ascendc.backend",
}


def get_backend(name: str):
    """Return the backend module called ``name`` (validated, lazily imported)."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    module = importlib.import_module(_MODULES[name])
    check = getattr(module, "check_available", None)
    if check is not None:
        check()  # raises RuntimeError naming the missing package / device
    return module
