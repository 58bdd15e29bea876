"""The ascendc backend: fla-npu's Ascend C kernels behind the ``layers.ops`` contract (Ascend NPUs).

GDN: composite forward/backward (``gdn.py``; the backward on the building blocks off Ascend 950,
``gdn_staged.py``). KDA: staged prepare / state pass / finalize and their backward stages (``kda.py``; backward
stages Ascend 950 only), the monolithic backward on 910B / 910_93 (``kda_fused.py``: no initial state or
final-state gradient, safe gate only). Decode steps: fla-npu's recurrent
kernels (``step.py``). CP on fla-npu's native summary and merge kernels lives with the CP engine
(``layers/cp/ascendc.py``). Short convolution: fla-npu's ``causal_conv1d`` is an inference cache operator (no
history gradient), so this backend's conv (and conv decode step) is the eager backend's PyTorch depthwise
convolution run on the NPU tensors (aten kernels through torch_npu) -- stated here and in docs/backends.md.
"""
from __future__ import annotations

from layers.ops.ascendc import runtime
from layers.ops.ascendc.gdn import chunk_gated_delta_rule
from layers.ops.ascendc.kda import chunk_kda
from layers.ops.ascendc.step import causal_conv1d_step, delta_rule_step

__all__ = ["check_available", "chunk_gated_delta_rule", "chunk_kda", "causal_conv1d", "delta_rule_step",
           "causal_conv1d_step"]


def check_available() -> None:
    """RuntimeError naming fla-npu / torch_npu / the NPU when the backend cannot run here."""
    runtime.load_ops()
    runtime.DEVICE.check_runtime()


def causal_conv1d(x, weight, *, bias, activation, cu_seqlens, history):
    """PyTorch depthwise causal conv on the NPU tensors (see module doc); same contract as every backend."""
    from layers.ops.backends import get_backend

    return get_backend("eager").causal_conv1d(x, weight, bias=bias, activation=activation, cu_seqlens=cu_seqlens,
                                              history=history)
