"""State passing for backends whose kernels write CP summaries natively (Ascend C, FLA): the KCP decomposition.

Forward: the backend writes ``[E | M]`` of every local piece (fp32, from the WY factors of its local pass);
:func:`initial_states` selects the own positions' summaries (masked as in ``ChainPlan.own_summaries``), folds the
earlier positions in chain order and returns the initial state of every local piece. Backward: the backend writes
the reverse summary ``dS_loc`` (gradient of the rank's own outputs w.r.t. the state entering each own position);
:func:`terminal_gradients` folds ``(M^T, dS_loc)`` of the later positions into the gradient of the state leaving
each exit piece, which the backend's local backward takes as ``dht``. No state gradient is sent back otherwise.
An ``exchange(ctx, plan, A, B, forward)`` returns the exclusive fold over own positions (``[D, n_own, HV, K, W]``);
:func:`scan_exchange` is the engine's, for every method.
"""
from __future__ import annotations

from layers.cp.chain import exclusive_scan


def scan_exchange(ctx, plan, A, B, forward: bool):
    """Exclusive fold of (A, B) over own positions in chain order (forward) or reversed (backward)."""
    order = range(plan.chain_length) if forward else reversed(range(plan.chain_length))
    return exclusive_scan(ctx.state_method, A, B, plan, order, ctx.stats, comm=ctx.chain_comm,
                          phase="forward" if forward else "backward")


def initial_states(ctx, plan, hm, exchange=scan_exchange):
    """hm ``[n_pieces, HV, K, V+K]`` -> (masked M ``[D, n_own, HV, K, K]``, initial states ``[n_pieces, HV, K, V]``)."""
    M, E = plan.own_summaries(hm)
    return M, plan.entry_states(exchange(ctx, plan, M, E, True))


def terminal_gradients(ctx, plan, M, dS_loc, n_pieces, device, exchange=scan_exchange):
    """dht ``[n_pieces, HV, K, V]``: gradient of the state leaving each exit piece (zero elsewhere), from the
    forward's masked M and the entry pieces' ``dS_loc`` ``[D, n_own, HV, K, V]``."""
    lam = exchange(ctx, plan, M.transpose(-1, -2).contiguous(), dS_loc, False)
    HV, K, V = dS_loc.shape[2:]
    lam = lam * plan.link_keep(lam.device, lam.dtype)
    return lam.new_zeros(n_pieces, HV, K, V).index_copy(0, plan.exit_piece.reshape(-1).to(device),
                                                        lam.reshape(-1, HV, K, V))


def entry_windows(plan):
    """``[start, end)`` token windows of the entry pieces, in ``entry_piece`` order (host ints)."""
    cu = plan.local_cu_seqlens.tolist()
    return [[cu[p], cu[p + 1]] for p in plan.entry_piece.reshape(-1).tolist()]
