"""The eager (pure PyTorch) backend: any device, the reference every other backend is checked against.

Every entry point runs through :func:`layers.ops.eager.recompute.recompute`: autograd keeps only the op's
inputs, and backward recomputes the chunked intermediates (docs/layers.md, "Activation memory").
"""
from __future__ import annotations

from functools import partial

from layers.ops.eager import conv
from layers.ops.eager.chunk import chunked_delta_rule
from layers.ops.eager.recompute import recompute
from layers.ops.kinds import GDN, KDA
from layers.ops.eager.step import causal_conv1d_step, delta_rule_step  # noqa: F401  decode steps (inference)


def _delta_rule(kind, q, k, v, g, beta, *, A_log=None, dt_bias=None, initial_state=None, **kw):
    fn = partial(_positional, partial(chunked_delta_rule, kind, **kw))
    return recompute(fn, q, k, v, g, beta, A_log, dt_bias, initial_state)


def _positional(run, q, k, v, g, beta, A_log, dt_bias, initial_state):
    return run(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state)


def chunk_gated_delta_rule(q, k, v, g, beta, **kw):
    return _delta_rule(GDN, q, k, v, g, beta, **kw)


def chunk_kda(q, k, v, g, beta, *, safe_gate=False, **kw):
    # safe_gate selects a tensor-core path in FLA; the eager math is exact either way.
    return _delta_rule(KDA, q, k, v, g, beta, **kw)


def causal_conv1d(x, weight, *, bias=None, activation=None, cu_seqlens=None, history=None):
    """Backend interface of :func:`layers.ops.eager.conv.causal_conv1d`, keeping only x, weight, bias, history."""
    def run(x, weight, bias, history):
        return conv.causal_conv1d(x, weight, bias=bias, activation=activation, cu_seqlens=cu_seqlens,
                                  history=history)
    return recompute(run, x, weight, bias, history)


def delta_rule_final_state(kind, k, v, g, beta, *, initial_state, cu_seqlens, safe_gate=False, **kw):
    """Final states only (no output pass): what the CP engine needs for segment summaries."""
    _, final = _delta_rule(kind, k, k, v, g, beta, scale=1.0, initial_state=initial_state,
                           output_final_state=True, cu_seqlens=cu_seqlens, with_output=False, **kw)
    return final
