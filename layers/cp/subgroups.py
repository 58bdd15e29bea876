"""The sub-groups of a CP group (Ulysses, state, all-gather groups), created so that no layout can hang.

torch names a group that every rank of the world creates (``dist.new_group``) from a world-wide counter that
advances alike on every rank, so such a group meets whatever else each rank created before. A group made by its
members alone (``use_local_synchronization=True``) is named from its ranks and the number of groups the process
already holds, so members with different histories (a per-batch ``PackedSeqParams.cp_group``, a layout some
ranks built and others not, another library's local groups) name it differently and wait for each other forever.
Hence every sub-group of two or more ranks here is made by every rank of the world, in one order:

* :func:`register_cp_subgroups` (collective over the WHOLE world, every rank at the same point, e.g. after
  megatron's ``initialize_model_parallel`` or in the model provider) creates them for every CP group any rank
  names, for the configurations it may run (``method="auto"``: all of them);
* :func:`cp_subgroups` (``build_cp_context``) hands out the registered ones. On a CP group that is the whole
  world it creates missing ones itself (every rank builds the context, so that is collective); on a smaller CP
  group a missing one raises RuntimeError naming :func:`register_cp_subgroups` instead of hanging.

One-rank sub-groups (the state groups of U = P) have nothing to agree on: each rank makes its own, locally.
"""
from __future__ import annotations

import torch.distributed as dist

from layers.base.choices import CP_METHOD_CHOICES, CP_METHODS
from layers.base.compat import process_group_alive


def hybrid_degrees(P: int, method: str, group_size: int | None, ulysses_degree: int | None) -> int:
    """The Ulysses degree U of ``method`` on a P-rank CP group, after checking ``group_size`` (only for
    ``grouped_allgather_p2p``, dividing P / U) and ``ulysses_degree`` (dividing P; None or P for
    ``"ulysses"``). Raises ValueError naming the constraint and the values."""
    if method not in CP_METHODS:
        raise ValueError(f"method must be one of {CP_METHODS}, got {method!r}")
    for name, val in (("group_size", group_size), ("ulysses_degree", ulysses_degree)):
        if val is not None and (not isinstance(val, int) or isinstance(val, bool) or val < 1):
            raise ValueError(f"{name} must be a positive int or None, got {val!r}")
    if method == "ulysses":
        if ulysses_degree not in (None, P):
            raise ValueError(f"method='ulysses' uses all P={P} ranks for Ulysses; ulysses_degree must be None "
                             f"or {P}, got {ulysses_degree}")
        U = P
    else:
        U = ulysses_degree or 1
        if P % U != 0:
            raise ValueError(f"ulysses_degree U={U} must divide the CP size P={P}")
    Q = P // U
    if method == "grouped_allgather_p2p":
        if group_size is None:
            raise ValueError("method='grouped_allgather_p2p' needs group_size (ranks per all-gather group)")
        if Q % group_size != 0:
            raise ValueError(f"group_size={group_size} must divide the number of state ranks P/U={Q} "
                             f"(P={P}, U={U})")
    elif group_size is not None:
        raise ValueError(f"group_size is only used by method='grouped_allgather_p2p', got it with {method!r}")
    return U


def check_auto_leaves_free(group_size, ulysses_degree, *, flags: tuple | None = None) -> None:
    """ValueError unless ``group_size`` and ``ulysses_degree`` are both None: the CP method ``auto`` chooses them
    itself. The one check of that rule, for the mixers' options, ``register_cp_subgroups`` and the command line
    (``flags``: the two flags' names, then the message names them)."""
    if group_size is None and ulysses_degree is None:
        return
    if flags is None:
        raise ValueError(f"method='auto' chooses group_size and ulysses_degree itself; got group_size={group_size}"
                         f", ulysses_degree={ulysses_degree}")
    raise ValueError(f"--hp-cp-method auto chooses the group size and Ulysses degree itself; drop "
                     f"{flags[0]} {group_size} / {flags[1]} {ulysses_degree}")


def partition(ranks: tuple, U: int, group_size: int | None) -> list:
    """Every sub-group (sorted global ranks) the layout needs, for ALL members of the CP group ``ranks`` (sorted
    global ranks), in one order: the Ulysses groups (1 < U < P), the state groups (U > 1), the all-gather
    groups (1 < g < P/U; ``group_size`` None when the method is not grouped)."""
    P = len(ranks)
    Q = P // U
    out = []
    if 1 < U < P:
        out += [tuple(ranks[q * U:(q + 1) * U]) for q in range(Q)]
    states = [tuple(ranks[q * U + u] for q in range(Q)) for u in range(U)] if U > 1 else [ranks]
    if U > 1:
        out += [tuple(sorted(s)) for s in states]
    if group_size is not None and 1 < group_size < Q:
        out += [tuple(sorted(s[lo:lo + group_size])) for s in states for lo in range(0, Q, group_size)]
    return out


def _configurations(P: int, method: str, ulysses_degree: int | None, group_size: int | None) -> list:
    """``[(U, g or None)]`` that contexts of ``method`` on P ranks may build; ``"auto"``: every candidate of the
    cost model for any head count (U | P; the heads are checked when the context is built)."""
    if method not in CP_METHOD_CHOICES:
        raise ValueError(f"method must be one of {CP_METHOD_CHOICES}, got {method!r}")
    if method != "auto":
        U = hybrid_degrees(P, method, group_size, ulysses_degree)
        return [(U, group_size if method == "grouped_allgather_p2p" else None)]
    check_auto_leaves_free(group_size, ulysses_degree)
    from layers.cp.cost_model import delta_candidates

    return [(P if c.method == "ulysses" else c.ulysses_degree or 1, c.group_size)
            for c in delta_candidates(P, P, P)]


class _Registry:
    """This process's sub-groups, valid for one world (emptied when the world is re-initialized).

    ``shared`` maps sorted global ranks to the group (``NON_GROUP_MEMBER`` where this rank is not in it); its
    keys are the same on every rank, because every entry was made by every rank. ``solo`` is this rank's
    one-rank group."""

    def __init__(self):
        self.world, self.shared, self.solo = None, {}, None

    def current(self) -> "_Registry":
        world = dist.GroupMember.WORLD
        if self.world is not world or not process_group_alive(world):
            self.world, self.shared, self.solo = world, {}, None   # the old world's groups are gone
        return self

    def create(self, ranks_list) -> list:
        """``dist.new_group`` on EVERY rank for each missing rank tuple, in the given order; the created ones."""
        created = []
        for ranks in ranks_list:
            if ranks not in self.shared:
                self.shared[ranks] = dist.new_group(list(ranks))
                created.append(ranks)
        return created

    def solo_group(self):
        if self.solo is None:
            self.solo = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        return self.solo


_REGISTRY = _Registry()


def solo_group():
    """This rank's one-rank process group of the current world (made by this rank alone, once per world)."""
    return _REGISTRY.current().solo_group()


def cp_group_ranks(group) -> tuple:
    """The global ranks of ``group`` (None = WORLD); ValueError unless they increase."""
    group = dist.GroupMember.WORLD if group is None else group
    ranks = tuple(dist.get_process_group_ranks(group))
    if list(ranks) != sorted(ranks):
        # sub-groups order their members by global rank; the rank arithmetic assumes the group does too
        raise ValueError(f"the CP group must order its global ranks increasingly, got {list(ranks)}")
    return ranks


def register_cp_subgroups(groups=None, *, method: str, ulysses_degree: int | None = None,
                          group_size: int | None = None) -> list:
    """Create the sub-groups of CP groups before any context needs them. COLLECTIVE over the whole world: every
    rank calls it at the same point (after ``initialize_model_parallel``, at model build), also ranks whose CP
    group needs none.

    groups: the CP group(s) this rank may run contexts on (a process group or a list of them, e.g. megatron's CP
    group and the per-batch ``PackedSeqParams.cp_group`` candidates; None = WORLD; one-rank groups are skipped).
    method, ulysses_degree,
    group_size: as ``build_cp_context``; ``method="auto"`` registers every configuration auto may choose.
    Ranks may name different groups and configurations: one ``all_gather_object`` over the world joins them and
    every rank creates the sub-groups of all of them (sorted, so in one order). Already registered ones are
    skipped, so calling it again (e.g. once per virtual pipeline stage) creates nothing new. A configuration
    that is invalid on any rank (ValueError/TypeError) raises on every rank, naming that rank.
    Returns the member ranks of the sub-groups created by this call (the same list on every rank).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("register_cp_subgroups needs an initialized torch.distributed process group")
    groups = groups if isinstance(groups, (list, tuple)) else [groups]
    try:
        mine = set()
        for group in groups:
            ranks = cp_group_ranks(group)
            if len(ranks) == 1:                  # a one-rank CP group runs no CP context: nothing to create
                continue
            # g = 0 for "not grouped": the requests are sorted, and None does not order against ints
            mine.update((ranks, U, g or 0)
                        for U, g in _configurations(len(ranks), method, ulysses_degree, group_size))
        request = sorted(mine)
    except (TypeError, ValueError) as err:      # sent too: every rank raises, none waits in a later collective
        request = err
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, request)
    if isinstance(request, Exception):
        raise request
    failed = [(r, e) for r, e in enumerate(everyone) if isinstance(e, Exception)]
    if failed:
        raise ValueError(f"register_cp_subgroups failed on rank {failed[0][0]}: {failed[0][1]}")
    wanted = {}                                  # ordered set of rank tuples, first use first
    for ranks, U, g in sorted(set().union(*map(set, everyone))):
        wanted.update((r, None) for r in partition(ranks, U, g or None) if len(r) > 1)
    return _REGISTRY.current().create(wanted)


def cp_subgroups(ranks: tuple, U: int, group_size: int | None) -> dict:
    """{sorted global ranks: process group} of the sub-groups of ``partition(ranks, U, group_size)`` that this
    rank belongs to. Registered ones are reused; on a CP group that is the whole world missing ones are created
    by every rank (one order); on a smaller CP group a missing one raises RuntimeError (every member sees the
    same registry, so all of them raise: no rank is left waiting)."""
    registry = _REGISTRY.current()
    wanted = partition(ranks, U, group_size)
    missing = [r for r in wanted if len(r) > 1 and r not in registry.shared]
    if missing and ranks == tuple(range(dist.get_world_size())):
        registry.create(missing)
    elif missing:
        raise RuntimeError(
            f"the sub-groups {missing} of the CP group {list(ranks)} (ulysses_degree={U}, group_size={group_size}) "
            "were not registered: a CP group smaller than the world needs its sub-groups created by every rank of "
            "the world at the same point; call layers.cp.register_cp_subgroups(cp_group, method=..., "
            "ulysses_degree=..., group_size=...) on every rank (hp_megatron.register_cp_subgroups_from_args(args) "
            "with Megatron's args) after initialize_model_parallel, before the first forward")
    me = dist.get_rank()
    return {r: registry.shared[r] if len(r) > 1 else registry.solo_group() for r in wanted if me in r}
