"""State exchange across CP ranks: exclusive scans of affine maps along a chain, and their adjoint.

Every chain position j carries an affine map X -> A_j X + B_j (per chain d and value head; A_j is K x K, B_j
K x W, fp32). ``exclusive_scan`` returns, for each position this rank owns, the fold of the maps of all
positions before it in the visiting ``order``, starting from X = 0. In the forward pass (order = chain order,
maps (M, E)) that fold is the state entering the position; in the backward pass (reversed order, maps
(M^T, dL/dS_in)) it is the gradient of the state leaving the position. The methods differ only in how the
maps travel (see docs/cp.md for costs):

* ``p2p``: the running state walks the chain; one message per owner change.
* ``allgather``: one all-gather of [A | B] of every position; every rank folds locally.
* ``grouped_allgather_p2p``: all-gather inside groups of ``group_size`` consecutive ranks, then the running
  state walks between groups, sent pairwise to the rank with the same index in the next group.
* ``recursive_doubling``: Kogge-Stone scan over the positions in ``order``; ceil(log2 L) rounds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from layers.base.choices import STATE_METHODS  # noqa: F401  (re-exported)
from layers.cp.accounting import current_phase
from layers.cp.collectives import all_gather_raw, exchange, group_rank, group_size
from layers.ops.summary import apply_summary


@dataclass(frozen=True, eq=False)
class ChainComm:
    """The process groups a chain scan talks over.

    ``group``: the P ranks of the plan (None = WORLD); ``group_size``: g of ``grouped_allgather_p2p``;
    ``gather_group``: this rank's group of g consecutive ranks (inside ``group``) for that method.
    """

    group: object = None
    group_size: int | None = None
    gather_group: object = None


def _check_inputs(method, A, B, plan, order, comm):
    if method not in STATE_METHODS:
        raise ValueError(f"method must be one of {STATE_METHODS}, got {method!r}")
    if A.dim() != 5 or B.dim() != 5:
        raise ValueError(f"A must be [D, n_own, HV, K, K] and B [D, n_own, HV, K, W], got {tuple(A.shape)} "
                         f"and {tuple(B.shape)}")
    D, n, HV, K, K2 = A.shape
    if K != K2 or tuple(B.shape[:4]) != (D, n, HV, K):
        raise ValueError(f"A [D, n_own, HV, K, K] and B [D, n_own, HV, K, W] disagree: {tuple(A.shape)} vs "
                         f"{tuple(B.shape)}")
    if (D, n) != (plan.num_chains, plan.n_own):
        raise ValueError(f"scan inputs need [D={plan.num_chains}, n_own={plan.n_own}] leading dims "
                         f"(from the plan), got [{D}, {n}]")
    if A.dtype not in (torch.float32, torch.float64) or B.dtype != A.dtype:
        raise TypeError(f"chain maps must be float32 (float64 for fp64 inputs) and share a dtype, got A {A.dtype}, "
                        f"B {B.dtype}")
    P = group_size(comm.group)
    if P != plan.world_size or group_rank(comm.group) != plan.rank:
        raise ValueError(f"plan is for rank {plan.rank} of {plan.world_size}, but the group has this rank as "
                         f"{group_rank(comm.group)} of {P}")
    order = tuple(int(t) for t in order)
    if sorted(order) != list(range(plan.chain_length)):
        raise ValueError(f"order must be a permutation of range(L={plan.chain_length}), got {order}")
    return order


def exclusive_scan(method: str, A: torch.Tensor, B: torch.Tensor, plan, order, stats=None, *,
                   comm: ChainComm | None = None, phase: str | None = None) -> torch.Tensor:
    """Exclusive fold of the affine maps (A_j, B_j) along ``order``, for this rank's own positions.

    A: fp32 [D, n_own, HV, K, K], B: fp32 [D, n_own, HV, K, W] (own positions in ``plan.own_positions``
    order). Returns X [D, n_own, HV, K, W] with X_t = fold over j before t in ``order`` of X <- A_j X + B_j,
    from X = 0. No autograd. Cut links are the caller's job (zero A_j and B_j of a position whose outgoing
    link is cut). Communication is recorded in ``stats`` as one call ``"chain.<method>"``.
    """
    comm = comm or ChainComm()
    order = _check_inputs(method, A, B, plan, order, comm)
    if method == "grouped_allgather_p2p" and (comm.group_size is None or plan.world_size % comm.group_size):
        raise ValueError(f"grouped_allgather_p2p needs group_size dividing P={plan.world_size}, got "
                         f"{comm.group_size}")
    A, B = A.contiguous(), B.contiguous()
    impl = {"p2p": _scan_p2p, "allgather": _scan_allgather, "grouped_allgather_p2p": _scan_grouped,
            "recursive_doubling": _scan_doubling}[method]
    if stats is None or not stats.enabled:
        return impl(A, B, plan, order, comm, None, None)
    with stats.call(f"chain.{method}", phase or current_phase()) as rec:
        return impl(A, B, plan, order, comm, stats, rec)


def _step(rec):
    if rec is not None:
        rec.steps += 1


def _scan_p2p(A, B, plan, order, comm, stats, rec):
    me, owners, slot = plan.rank, plan.owners, plan.owner_slot
    out = torch.zeros_like(B)
    X = torch.zeros_like(B[:, 0])
    pending = []
    for i, t in enumerate(order):
        o = owners[t]
        prev = owners[order[i - 1]] if i > 0 else o
        if o != prev:                       # the running state changes hands: one sequential step
            _step(rec)
            if me == prev:
                pending += exchange([(X, o)], [], comm.group, stats, async_op=True, name="chain.p2p")
            elif me == o:
                X = torch.empty_like(B[:, 0])
                exchange([], [(X, prev)], comm.group, stats, name="chain.p2p")
        if me == o:
            s = slot[t]
            out[:, s] = X
            if i + 1 < len(order):
                X = apply_summary(A[:, s], B[:, s], X)
    for w in pending:
        w.wait()
    return out


def _scan_allgather(A, B, plan, order, comm, stats, rec):
    me, owners, slot = plan.rank, plan.owners, plan.owner_slot
    K = A.shape[-1]
    gathered = all_gather_raw(torch.cat([A, B], dim=-1), comm.group, stats)   # [P, D, n_own, HV, K, K+W]
    if plan.world_size > 1:
        _step(rec)
    out = torch.zeros_like(B)
    X = torch.zeros_like(B[:, 0])
    last_mine = max(i for i, t in enumerate(order) if owners[t] == me)
    for i, t in enumerate(order[:last_mine + 1]):
        o, s = owners[t], slot[t]
        if o == me:
            out[:, s] = X
        if i < last_mine:
            X = apply_summary(gathered[o, :, s, ..., :K], gathered[o, :, s, ..., K:], X)
    return out


def _visits(order, owners, g):
    """Maximal runs of consecutive positions in ``order`` whose owners are in one group of g ranks."""
    runs = []
    for t in order:
        q = owners[t] // g
        if runs and runs[-1][0] == q:
            runs[-1][1].append(t)
        else:
            runs.append((q, [t]))
    return runs


def _scan_grouped(A, B, plan, order, comm, stats, rec):
    me, owners, slot, g = plan.rank, plan.owners, plan.owner_slot, comm.group_size
    K = A.shape[-1]
    my_q, my_idx = me // g, me % g
    packed = torch.cat([A, B], dim=-1)
    if g > 1:
        if comm.gather_group is None:
            raise ValueError("grouped_allgather_p2p needs comm.gather_group (the sub-group of this rank's "
                             f"{g} consecutive ranks); build the context with build_cp_context")
        gathered = all_gather_raw(packed, comm.gather_group, stats)             # [g, D, n_own, HV, K, K+W]
        _step(rec)
    else:
        gathered = packed.unsqueeze(0)
    out = torch.zeros_like(B)
    X = torch.zeros_like(B[:, 0])
    visits = _visits(order, owners, g)
    pending = []
    for v, (q, positions) in enumerate(visits):
        if v > 0:                           # the running state moves to the next group: one step
            prev_q = visits[v - 1][0]
            _step(rec)
            if my_q == prev_q:
                pending += exchange([(X, q * g + my_idx)], [], comm.group, stats, async_op=True,
                                    name="chain.grouped_allgather_p2p")
            if my_q == q:
                X = torch.empty_like(B[:, 0])
                exchange([], [(X, prev_q * g + my_idx)], comm.group, stats, name="chain.grouped_allgather_p2p")
        if my_q != q:
            continue
        # every member of the group folds the whole visit (it holds all the group's maps); it needs the
        # running state after the visit only when another visit follows (to pass it on)
        last_own = max((k for k, t in enumerate(positions) if owners[t] == me), default=-1)
        n_fold = len(positions) if v + 1 < len(visits) else last_own
        for k, t in enumerate(positions):
            o, s = owners[t], slot[t]
            if o == me:
                out[:, s] = X
            if k >= n_fold:
                break
            X = apply_summary(gathered[o - q * g, :, s, ..., :K], gathered[o - q * g, :, s, ..., K:], X)
    for w in pending:
        w.wait()
    return out


def _scan_doubling(A, B, plan, order, comm, stats, rec):
    owners, slot = plan.owners, plan.owner_slot
    L, K, W = len(order), A.shape[-1], B.shape[-1]
    index_of = {t: i for i, t in enumerate(order)}
    mine = sorted((index_of[t], slot[t]) for t in plan.own_positions)       # (order index, own slot)
    incA, incB = A.clone(), B.clone()                                       # inclusive aggregates
    excA = torch.eye(K, dtype=A.dtype, device=A.device).expand_as(A).clone()  # exclusive aggregates
    excB = torch.zeros_like(B)
    buf_shape = (A.shape[0],) + tuple(A.shape[2:4]) + (K + W,)
    d = 1
    while d < L:
        if any(owners[order[i]] != owners[order[i - d]] for i in range(d, L)):
            _step(rec)
        # messages between one pair of ranks are listed in increasing order index on both sides
        sends = [(torch.cat([incA[:, s], incB[:, s]], dim=-1), owners[order[i + d]]) for i, s in mine if i + d < L]
        receivers = [(i, s) for i, s in mine if i - d >= 0]
        bufs = [torch.empty(buf_shape, dtype=A.dtype, device=A.device) for _ in receivers]
        exchange(sends, [(b, owners[order[i - d]]) for b, (i, _) in zip(bufs, receivers)], comm.group, stats,
                 name="chain.recursive_doubling")
        final = 2 * d >= L
        for (_, s), buf in zip(receivers, bufs):
            rA, rB = buf[..., :K], buf[..., K:]
            # compose(later = aggregate at i, earlier = inclusive aggregate of i - d): (A_l A_e, A_l B_e + B_l)
            excB[:, s] = torch.matmul(excA[:, s], rB) + excB[:, s]
            if not final:
                excA[:, s] = torch.matmul(excA[:, s], rA)
                incB[:, s] = torch.matmul(incA[:, s], rB) + incB[:, s]
                incA[:, s] = torch.matmul(incA[:, s], rA)
        d *= 2
    return excB


class ChainScan(torch.autograd.Function):
    """Differentiable state chain: S_in of every own position from the segment summaries (M, E).

    ``ChainScan.apply(M_own, E_own, method, plan, stats, comm)``: M_own fp32 [D, n_own, HV, K, K], E_own fp32
    [D, n_own, HV, K, V] (S_out = M S_in + E of each own segment, cut links already masked). Returns S_in
    [D, n_own, HV, K, V]. Backward: lam = exclusive scan of (M^T, dL/dS_in) in reversed chain order
    (the gradient of each S_out); dE = lam, dM = lam S_in^T.
    """

    @staticmethod
    def forward(ctx, M_own, E_own, method, plan, stats, comm):
        S_in = exclusive_scan(method, M_own, E_own, plan, range(plan.chain_length), stats, comm=comm,
                              phase="forward")
        ctx.save_for_backward(M_own, S_in)
        ctx.method, ctx.plan, ctx.stats, ctx.comm = method, plan, stats, comm
        return S_in

    @staticmethod
    def backward(ctx, g):
        M_own, S_in = ctx.saved_tensors
        lam = exclusive_scan(ctx.method, M_own.transpose(-1, -2), g.to(M_own.dtype), ctx.plan,
                             reversed(range(ctx.plan.chain_length)), ctx.stats, comm=ctx.comm, phase="backward")
        dM = torch.matmul(lam, S_in.transpose(-1, -2))
        return dM, lam, None, None, None, None


def chain_scan(M_own: torch.Tensor, E_own: torch.Tensor, ctx, plan) -> torch.Tensor:
    """``ChainScan`` with the state method, groups and stats of a ``CPContext`` (``plan`` from
    ``ctx.state_plan_for``)."""
    return ChainScan.apply(M_own, E_own, ctx.state_method, plan, ctx.stats, ctx.chain_comm)
