"""Context parallelism for GDN/KDA ops: Ulysses head exchange and/or state passing on affine summaries.

For a rank's shard (in the layout's local order) the state methods run three steps, all differentiable:
1. one pass of the backend op over the local pieces with values [v | 0_K] and initial state [0 | I_K] gives,
   per piece, the final state [E | M] (S_out = M S_in + E) and the outputs o_aug = [o_0 | o_M]; the exit piece
   of each own chain position supplies that position's summary (M := 0 where a document starts inside the
   segment, and both are zeroed where the chain link to the next position is cut);
2. exchange: ``ChainScan`` folds the summaries of all earlier positions (any method) into S_in per own
   position; its backward sends (M^T, dS_in) the other way;
3. outputs are linear in the initial state: o = o_0 + o_M S_in on the tokens of each entry piece (o_0
   elsewhere), in fp32 (``apply_entry_states``).
Ulysses (alone or as the outer level of the hybrid) exchanges sequence for heads first and back after.
"""
from __future__ import annotations

import importlib

import torch

from layers.cp.chain import chain_scan
from layers.cp.ulysses import heads_to_seq, seq_to_heads_packed
from layers.ops.backends import get_backend
from layers.ops.kinds import delta_kind
from layers.ops.summary import augmented_pass

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
    o_aug, final = augmented_pass(kind, impl, q1, k1, v1, g1, b1, plan.local_cu_seqlens, scale, flags)
    M, E = plan.own_summaries(final)                                   # final [n_pieces, HV, K, V+K]
    o = apply_entry_states(o_aug[0], chain_scan(M, E, ctx, plan), plan)
    return o.view(B, T, HV, V)


def apply_entry_states(o_aug: torch.Tensor, S_in: torch.Tensor, plan) -> torch.Tensor:
    """o [n_tok, HV, V] = o_aug[..., :V] + o_aug[..., V:] @ S_in of the token's segment on the tokens of the entry
    pieces (``plan.entry_tokens``), o_aug[..., :V] elsewhere; summed in S_in's dtype, returned in o_aug's.

    o_aug: [n_tok, HV, V+K] from ``augmented_pass``; S_in: [D, n_own, HV, K, V] from the chain scan.
    """
    n_tok, HV, _ = o_aug.shape
    K, V = S_in.shape[-2:]
    tokens = plan.entry_tokens.to(o_aug.device)
    C = tokens.shape[1]
    slots = tokens.reshape(-1)
    o_m = torch.cat([o_aug[:, :, V:], o_aug.new_zeros(1, HV, K)]).index_select(0, slots)
    o_m = o_m.view(-1, C, HV, K).transpose(1, 2).to(S_in.dtype)                        # [n_ch, HV, C, K]
    S = S_in.reshape(-1, HV, K, V).index_select(0, plan.entry_segment.to(S_in.device))  # [n_ch, HV, K, V]
    carried = (o_m @ S).transpose(1, 2).reshape(-1, HV, V)
    if plan.entry_valid is not None:
        valid = plan.entry_valid.to(o_aug.device)
        slots, carried = slots.index_select(0, valid), carried.index_select(0, valid)
    return o_aug[:, :, :V].to(S_in.dtype).index_add(0, slots, carried).to(o_aug.dtype)


def delta_rule_with_cp(kind, backend, ctx, q, k, v, g, beta, *, scale, **flags):
    """The delta rule ``kind`` (name or ``layers.ops.kinds`` descriptor; ``backend`` by name) on this rank's shard of a
    context-parallel sequence -> (o [B,T_local,HV,V], None)."""
    kind = delta_kind(kind)
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
            flags["dt_bias"] = db.view(HV, -1)[heads].reshape(-1)   # [HV] or [HV*K], value heads outermost
        q, k, v, g, beta = seq_to_heads_packed((q, k, v, g, beta), ctx)      # one all-to-all
    if ctx.state_world_size > 1:
        o = _state_passing(kind, backend, ctx, ctx.state_plan_for(B, T_loc), q, k, v, g, beta, scale, flags)
    else:   # pure Ulysses: every rank now holds whole sequences (natural order) for its heads
        impl = get_backend(backend)
        o, _ = kind.backend_op(impl)(q, k, v, g, beta, scale=scale, initial_state=None, output_final_state=False,
                  cu_seqlens=ctx.cu_seqlens, **flags)
    return (heads_to_seq(o, ctx, head_dim=2) if U > 1 else o), None
