"""CP contexts: one object that carries the group, method, layout, sub-groups, plans and comm accounting.

``build_cp_context(group, method=..., layout=..., cu_seqlens=None, group_size=None, ulysses_degree=None)``
validates the configuration, takes the sub-groups the method needs (``layers.cp.subgroups``: registered
with ``register_cp_subgroups``, or created by every rank when the CP group is the world) and returns a
``CPContext`` that the ops take as ``cp_context=``. ``shard`` / ``unshard`` map global tensors to this rank's
local order (Megatron's) and back.

Rank arithmetic (P ranks, Ulysses degree U, Q = P / U): rank r is in Ulysses group r // U (ranks
U*(r//U) .. U*(r//U)+U-1) at index r % U, and in the state group of the ranks with the same index
{r % U, U + r % U, ...} at index r // U. After the Ulysses exchange, state rank q holds the tokens of
Ulysses group q, which is exactly the Q-rank layout of the same name (``inner_layout``; ``contiguous`` with
one piece per sequence when Q == 1).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from layers.base.choices import CP_METHODS
from layers.cp.accounting import CommStats
from layers.cp.chain import ChainComm
from layers.cp.collectives import all_gather, group_rank
from layers.cp.collectives import group_size as _pg_size
from layers.cp.halo import causal_conv1d_with_cp
from layers.cp.plan import build_chain_plan, check_divisibility, check_layout, normalize_global_cu_seqlens
from layers.cp.sequence import sequence_plan
from layers.cp.state_parallel import delta_rule_with_cp
from layers.cp.subgroups import cp_group_ranks, cp_subgroups, hybrid_degrees

METHODS = CP_METHODS

@dataclass(eq=False)
class CPContext:
    """Everything a CP op needs. Fields (read-only by convention):

    group, world_size P, rank: the CP group and this rank in it.
    method: as requested; state_method: the scan method used for the state chain (``"p2p"`` when
        method == "ulysses", where the chain has one rank and nothing is sent).
    layout: layout of the local input; inner_layout: layout of the state group after the Ulysses exchange.
    cu_seqlens: global packed boundaries (CPU int64 [N+1]) or None.
    group_size: g of grouped_allgather_p2p (or None).
    ulysses_degree U, ulysses_rank (index in the Ulysses group), ulysses_group (U consecutive ranks).
    state_world_size Q = P / U, state_rank, state_group (ranks with the same Ulysses index).
    gather_group: this rank's g consecutive state ranks (grouped_allgather_p2p), else None.
    chain_comm: the ``ChainComm`` for ``exclusive_scan`` / ``ChainScan``.
    conv_kernel_size: optional, for the short-convolution halo.
    stats: ``CommStats`` recording every collective issued through this context.
    """

    group: object
    world_size: int
    rank: int
    method: str
    state_method: str
    layout: str
    inner_layout: str
    cu_seqlens: torch.Tensor | None
    group_size: int | None
    ulysses_degree: int
    ulysses_rank: int
    ulysses_group: object
    state_world_size: int
    state_rank: int
    state_group: object
    gather_group: object
    chain_comm: ChainComm
    conv_kernel_size: int | None = None
    stats: CommStats = field(default_factory=CommStats)
    _plans: dict = field(default_factory=dict, repr=False)   # memo of ``cached``

    # -- shapes and plans ------------------------------------------------------------------------------
    def global_len(self, local_len: int) -> int:
        """Global T from the local length (T_local * P); checked against cu_seqlens for packed input."""
        T = int(local_len) * self.world_size
        if self.cu_seqlens is not None and T != int(self.cu_seqlens[-1]):
            raise ValueError(f"local length {local_len} x P={self.world_size} = {T} does not match the packed "
                             f"token count cu_seqlens[-1]={int(self.cu_seqlens[-1])}")
        return T

    def cached(self, key, build):
        """``build()`` once per ``key`` for this context: the plans and patterns every layer sharing the
        micro-batch's context needs are validated and keyed once, not per layer and call."""
        if key not in self._plans:
            self._plans[key] = build()
        return self._plans[key]

    def plan_for(self, batch: int, local_len: int):
        """ChainPlan of this rank in the P-rank ``layout`` (the layout of the op's local input); memoized."""
        return self.cached(("outer", batch, local_len), lambda: build_chain_plan(
            self.world_size, self.rank, self.layout, batch=batch, seq_len=self.global_len(local_len),
            cu_seqlens=self.cu_seqlens))

    def state_plan_for(self, batch: int, local_len: int):
        """ChainPlan of this rank's state rank among Q in ``inner_layout`` (after Ulysses; = plan_for when
        U == 1). ``local_len`` is the length of the op's local input (before Ulysses)."""
        if self.ulysses_degree == 1:
            return self.plan_for(batch, local_len)
        return self.cached(("state", batch, local_len), lambda: build_chain_plan(
            self.state_world_size, self.state_rank, self.inner_layout, batch=batch,
            seq_len=self.global_len(local_len), cu_seqlens=self.cu_seqlens))

    # -- what the public ops run under this context (``layers.ops`` calls these; it never imports ``layers.cp``)
    def delta_rule(self, kind, backend: str, q, k, v, g, beta, **kw):
        """The delta rule ``kind`` (a ``layers.ops.kinds`` descriptor or name) on this rank's shard -> ``(o, None)``
        (see ``state_parallel``)."""
        return delta_rule_with_cp(kind, backend, self, q, k, v, g, beta, **kw)

    def causal_conv1d(self, impl, x, weight, *, bias, activation):
        """Depthwise causal conv of this rank's shard with the halo of the preceding tokens (see ``halo``)."""
        return causal_conv1d_with_cp(impl, self, x, weight, bias=bias, activation=activation)

    def check_heads(self, **heads: int) -> None:
        """ValueError unless every head count (e.g. ``H=..., HV=...``) is divisible by the Ulysses degree."""
        U = self.ulysses_degree
        bad = {k: v for k, v in heads.items() if v % U != 0}
        if bad:
            raise ValueError(f"Ulysses needs head counts divisible by the Ulysses degree U={U}; got "
                             + ", ".join(f"{k}={v}" for k, v in bad.items()))


def build_cp_context(group=None, *, method: str, layout: str, cu_seqlens=None, group_size: int | None = None,
                     ulysses_degree: int | None = None, conv_kernel_size: int | None = None,
                     stats: CommStats | None = None) -> CPContext:
    """Validate a CP configuration and build its context. Its sub-groups (Ulysses, state, gather) come from
    ``layers.cp.subgroups``: on a CP group smaller than the world they must have been registered with
    ``register_cp_subgroups`` (RuntimeError otherwise); on the whole world missing ones are created here, by
    every rank (build the context on every rank).

    group: any torch.distributed process group (None = WORLD). method: one of ``METHODS``. layout:
    ``"zigzag" | "contiguous"``. cu_seqlens: GLOBAL packed boundaries when inputs are packed (THD).
    group_size: g for ``grouped_allgather_p2p`` (must divide P / U). ulysses_degree: U for the hybrid
    Ulysses(U) x state(P/U) (must divide P); ``method="ulysses"`` means U = P. ``"auto"`` is a layer's
    choice, not a context's: the layer resolves it to one of ``METHODS`` first (``layers.cp.auto``).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_cp_context needs an initialized torch.distributed process group")
    check_layout(layout)
    if conv_kernel_size is not None and (not isinstance(conv_kernel_size, int) or isinstance(conv_kernel_size, bool)
                                         or conv_kernel_size < 1):
        raise ValueError(f"conv_kernel_size must be a positive int or None, got {conv_kernel_size!r}")
    group = dist.GroupMember.WORLD if group is None else group
    P, rank = _pg_size(group), group_rank(group)
    U = hybrid_degrees(P, method, group_size, ulysses_degree)
    Q = P // U
    cu = normalize_global_cu_seqlens(cu_seqlens)
    if cu is not None:
        check_divisibility(P, layout, int(cu[-1]), cu)

    # sub-groups (global ranks): registered or created by every rank of the world (layers/cp/subgroups.py)
    ranks = cp_group_ranks(group)
    u_idx, q_idx = rank % U, rank // U
    subgroups = cp_subgroups(ranks, U, group_size if method == "grouped_allgather_p2p" else None)
    ulysses_group = subgroups[tuple(sorted(ranks[q_idx * U:(q_idx + 1) * U]))] if 1 < U < P else (
        group if U == P else None)
    if U == 1:
        state_ranks = ranks
        state_group = group
    else:
        state_ranks = tuple(ranks[q * U + u_idx] for q in range(Q))
        state_group = subgroups[tuple(sorted(state_ranks))]
    gather_group = None
    if method == "grouped_allgather_p2p" and group_size > 1:
        lo = (q_idx // group_size) * group_size
        gather_ranks = state_ranks[lo:lo + group_size]
        gather_group = state_group if group_size == Q else subgroups[tuple(sorted(gather_ranks))]
    state_method = "p2p" if method == "ulysses" else method
    return CPContext(group=group, world_size=P, rank=rank, method=method, state_method=state_method,
                     layout=layout, inner_layout=layout if Q > 1 else "contiguous", cu_seqlens=cu,
                     group_size=group_size, ulysses_degree=U, ulysses_rank=u_idx, ulysses_group=ulysses_group,
                     state_world_size=Q, state_rank=q_idx, state_group=state_group, gather_group=gather_group,
                     chain_comm=ChainComm(state_group, group_size, gather_group),
                     conv_kernel_size=conv_kernel_size, stats=stats if stats is not None else CommStats())


# -- shard / unshard ----------------------------------------------------------------------------------------
def _seq_len_of(x, seq_dim):
    if not -x.dim() <= seq_dim < x.dim():
        raise ValueError(f"seq_dim={seq_dim} out of range for a tensor of shape {tuple(x.shape)}")
    return x.shape[seq_dim]


def shard(x: torch.Tensor, ctx: CPContext, seq_dim: int) -> torch.Tensor:
    """This rank's part of the global tensor ``x`` along ``seq_dim``, in local (layout) order.

    BSHD zigzag equals megatron-core's ``get_batch_on_this_cp_rank``; packed THD (ctx.cu_seqlens) zigzag
    equals Transformer Engine's ``thd_get_partitioned_indices``. Differentiable (an index_select).
    """
    T = _seq_len_of(x, seq_dim)
    return sequence_plan(ctx.world_size, ctx.rank, ctx.layout, T, ctx.cu_seqlens).shard(x, seq_dim)


class _GatherOwnerGrad(torch.autograd.Function):
    """All-gather whose backward keeps this rank's slice of the gradient (for a loss replicated on all ranks)."""

    @staticmethod
    def forward(ctx, x, group, stats):
        from layers.cp.collectives import all_gather_raw

        ctx.rank = group_rank(group)
        return all_gather_raw(x, group, stats)

    @staticmethod
    def backward(ctx, g):
        return g[ctx.rank], None, None


def unshard(x_local: torch.Tensor, ctx: CPContext, seq_dim: int, *, grad: str = "sum") -> torch.Tensor:
    """The global tensor from every rank's local part (inverse of ``shard``), differentiable.

    grad="sum": the adjoint of the all-gather (reduce-scatter): the owner receives the sum over ranks of the
    gradient of its tokens, right when every rank's loss is a different term of one global sum.
    grad="owner": the owner keeps its own slice of its own gradient, right when every rank computes the same
    replicated loss from the gathered tensor.
    """
    if grad not in ("sum", "owner"):
        raise ValueError(f"grad must be 'sum' or 'owner', got {grad!r}")
    T_loc = _seq_len_of(x_local, seq_dim)
    P = ctx.world_size
    T = ctx.global_len(T_loc)
    xl = x_local.movedim(seq_dim, 0).contiguous()
    gathered = (all_gather(xl, ctx.group, ctx.stats) if grad == "sum"
                else _GatherOwnerGrad.apply(xl, ctx.group, ctx.stats))          # [P, T_loc, ...]
    flat = gathered.reshape((P * T_loc,) + tuple(xl.shape[1:]))
    to_global = sequence_plan(P, ctx.rank, ctx.layout, T, ctx.cu_seqlens).on("to_global", flat.device)
    return flat.index_select(0, to_global).movedim(0, seq_dim)
