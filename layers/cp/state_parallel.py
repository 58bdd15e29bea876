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

import torch

from layers.cp.chain import ChainScan
from layers.cp.ulysses import heads_to_seq, seq_to_heads


def _final_states(kind, impl, k, v, g, beta, cu_seqlens, flags):
    """Per-piece [E | M] final states through the backend (fp32 [N, HV, K, V+K])."""
    HV, V, K = v.shape[2], v.shape[3], k.shape[3]
    N = cu_seqlens.numel() - 1
    v_aug = torch.cat([v.float(), v.new_zeros(*v.shape[:3], K, dtype=torch.float32)], dim=-1)
    S0 = torch.zeros(N, HV, K, V + K, device=v.device, dtype=torch.float32)
    S0[..., V:] = torch.eye(K, device=v.device)
    if hasattr(impl, "delta_rule_final_state"):
        return impl.delta_rule_final_state(kind, k, v_aug, g, beta, initial_state=S0, cu_seqlens=cu_seqlens, **flags)
    fn = impl.chunk_gated_delta_rule if kind == "gdn" else impl.chunk_kda
    _, final = fn(k, k, v_aug.to(v.dtype), g, beta, scale=1.0, initial_state=S0, output_final_state=True,
                  cu_seqlens=cu_seqlens, **flags)
    return final


def _state_passing(kind, impl, ctx, q, k, v, g, beta, scale, flags):
    """Run on [B, T_local, ...] shards laid out as ``ctx``'s state-group plan describes."""
    B, T_loc = q.shape[:2]
    HV, V, K = v.shape[2], v.shape[3], k.shape[3]
    plan = ctx.state_plan(B, T_loc)
    flat = lambda x: x.reshape(1, B * T_loc, *x.shape[2:])   # noqa: E731  pieces index flattened tokens
    q1, k1, v1, g1, b1 = map(flat, (q, k, v, g, beta))
    cu = plan.local_cu_seqlens
    final = _final_states(kind, impl, k1, v1, g1, b1, cu, flags)                 # [n_pieces, HV, K, V+K]
    exit_piece = plan.exit_piece.to(q.device)
    summary = final.index_select(0, exit_piece.reshape(-1)).view(*exit_piece.shape, HV, K, V + K)
    keep_link = plan.link_mask[:, list(plan.own_positions)].to(q.device, torch.float32)      # [D, n_own]
    keep_m = keep_link * plan.exit_has_transition.to(q.device, torch.float32)
    E = summary[..., :V] * keep_link[..., None, None, None]
    M = summary[..., V:] * keep_m[..., None, None, None]
    S_in = ChainScan.apply(M, E, ctx, plan)                                        # [D, n_own, HV, K, V]
    init = S_in.new_zeros(plan.num_pieces, HV, K, V).index_copy(
        0, plan.entry_piece.to(q.device).reshape(-1), S_in.reshape(-1, HV, K, V))
    fn = impl.chunk_gated_delta_rule if kind == "gdn" else impl.chunk_kda
    o, _ = fn(q1, k1, v1, g1, b1, scale=scale, initial_state=init, output_final_state=False, cu_seqlens=cu,
              **flags)
    return o.view(B, T_loc, HV, V)


def delta_rule_with_cp(kind, impl, ctx, q, k, v, g, beta, *, cu_seqlens, scale, initial_state, output_final_state,
                       **flags):
    """GDN/KDA on this rank's shard of a context-parallel sequence (see module docstring)."""
    if ctx.ulysses_degree > 1:
        H, HV = q.shape[2], v.shape[2]
        U = ctx.ulysses_degree
        if H % U or HV % U:
            raise ValueError(f"Ulysses needs heads divisible by its degree {U}: H={H}, HV={HV}")
        head_slice = ctx.ulysses_head_slice(HV)
        if flags.get("A_log") is not None:
            flags["A_log"] = flags["A_log"][head_slice]
        if flags.get("dt_bias") is not None:
            db = flags["dt_bias"]
            flags["dt_bias"] = db[head_slice] if kind == "gdn" else db.view(HV, -1)[head_slice].reshape(-1)
        B, T_loc = q.shape[:2]
        q, k, v, g, beta = (seq_to_heads(x, ctx, B, T_loc) for x in (q, k, v, g, beta))
    if ctx.state_world_size > 1:
        o = _state_passing(kind, impl, ctx, q, k, v, g, beta, scale, flags)
    else:   # pure Ulysses: every rank now holds whole sequences for its heads
        fn = impl.chunk_gated_delta_rule if kind == "gdn" else impl.chunk_kda
        o, _ = fn(q, k, v, g, beta, scale=scale, initial_state=None, output_final_state=False,
                  cu_seqlens=ctx.cu_seqlens, **flags)
    if ctx.ulysses_degree > 1:
        o = heads_to_seq(o, ctx, B, T_loc)
    return o
