"""The eager (pure PyTorch) backend: any device, the reference every other backend is checked against."""
from __future__ import annotations

from layers.ops.eager.chunk import chunked_delta_rule
from layers.ops.eager.conv import causal_conv1d  # noqa: F401  (backend interface)


def chunk_gated_delta_rule(q, k, v, g, beta, **kw):
    return chunked_delta_rule("gdn", q, k, v, g, beta, **kw)


def chunk_kda(q, k, v, g, beta, *, safe_gate=False, **kw):
    # safe_gate selects a tensor-core path in FLA; the eager math is exact either way.
    return chunked_delta_rule("kda", q, k, v, g, beta, **kw)


def delta_rule_final_state(kind, k, v, g, beta, *, initial_state, cu_seqlens, safe_gate=False, **kw):
    """Final states only (no output pass): what the CP engine needs for segment summaries."""
    _, final = chunked_delta_rule(kind, k, k, v, g, beta, scale=1.0, initial_state=initial_state,
                                  output_final_state=True, cu_seqlens=cu_seqlens, with_output=False, **kw)
    return final
