"""Context parallelism for GDN/KDA ops: Ulysses head exchange and/or state passing on affine summaries.

For a rank's shard (in the layout's local order) the state methods run three steps, all differentiable:
1. summaries: the backend op over the local pieces with values [v | 0_K] and initial state [0 | I_K]
   gives, per piece, the final state [E | M] (S_out = M S_in + E); the exit piece of each own chain
   position supplies that position's summary (M := 0 where a document starts inside the segment, and both
   are zeroed where the chain link to the next position is cut);
2. exchange: ``ChainScan`` folds the summaries of all earlier positions (any method) into S_in per own
   position; its backward sends (M^T, dS_in) the other way;
3. the local op with initial_state = S_in at each entry piece (zero elsewhere).
Ulysses (alone or as the outer level of the hybrid) exchanges sequence for heads first and back after.
"""
from __future__ import annotations

import importlib

from layers.cp.chain import chain_scan
from layers.cp.ulysses import heads_to_seq, seq_to_heads
from layers.ops.backends import get_backend
from layers.ops.summary import augmented_final_states

# backends whose kernels write CP summaries natively run their own decomposition (module, function ``state_passing_cp``)
NATIVE_CP = {"triton": "layers.cp.triton", "ascendc": "layers.cp.ascendc"}


def native_cp_hook(backend: str):
    """The native state-passing function of ``backend`` (see ``NATIVE_CP``), or None for the generic path."""
    module = NATIVE_CP.get(backend)
    return None if module is None else importlib.import_module(module).state_passing_cp


def _state_passing(kind, backend, ctx, plan, q, k, v, g, beta, scale, flags):
    """Run on [B, T, ...] tensors laid out as the state-group ``plan`` describes."""
    hook = native_cp_hook(backend)
    if hook is not None:
        return hook(kind, ctx, plan, q, k, v, g, beta, scale=scale, flags=flags)
    impl = get_backend(backend)
    B, T = q.shape[:2]
    HV, V = v.shape[2], v.shape[3]
    flat = lambda x: x.reshape(1, B * T, *x.shape[2:])   # noqa: E731  pieces index flattened tokens
    q1, k1, v1, g1, b1 = map(flat, (q, k, v, g, beta))
    cu = plan.local_cu_seqlens
    final = augmented_final_states(kind, impl, k1, v1, g1, b1, cu, flags)                 # [n_pieces, HV, K, V+K]
    M, E = plan.own_summaries(final)
    init = plan.entry_states(chain_scan(M, E, ctx, plan))
    fn = impl.chunk_gated_delta_rule if kind == "gdn" else impl.chunk_kda
    o, _ = fn(q1, k1, v1, g1, b1, scale=scale, initial_state=init, output_final_state=False, cu_seqlens=cu,
              **flags)
    return o.view(B, T, HV, V)


def delta_rule_with_cp(kind, backend, ctx, q, k, v, g, beta, *, scale, **flags):
    """GDN/KDA (``backend`` by name) on this rank's shard of a context-parallel sequence -> (o [B,T_local,HV,V], None)."""
    B, T_loc = q.shape[:2]
    U = ctx.ulysses_degree
    if U > 1:
        HV = v.shape[2]
        ctx.check_heads(H=q.shape[2], HV=HV)
        heads = slice(ctx.ulysses_rank * HV // U, (ctx.ulysses_rank + 1) * HV // U)
        if flags.get("A_log") is not None:
            flags["A_log"] = flags["A_log"][heads]
        if flags.get("dt_bias") is not None:
            db = flags["dt_bias"]
            flags["dt_bias"] = db[heads] if kind == "gdn" else db.view(HV, -1)[heads].reshape(-1)
        q, k, v, g, beta = (seq_to_heads(x, ctx, head_dim=2) for x in (q, k, v, g, beta))
    if ctx.state_world_size > 1:
        o = _state_passing(kind, backend, ctx, ctx.state_plan_for(B, T_loc), q, k, v, g, beta, scale, flags)
    else:   # pure Ulysses: every rank now holds whole sequences (natural order) for its heads
        impl = get_backend(backend)
        fn = impl.chunk_gated_delta_rule if kind == "gdn" else impl.chunk_kda
        o, _ = fn(q, k, v, g, beta, scale=scale, initial_state=None, output_final_state=False,
                  cu_seqlens=ctx.cu_seqlens, **flags)
    return (heads_to_seq(o, ctx, head_dim=2) if U > 1 else o), None
