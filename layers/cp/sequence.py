"""One sequence plan per micro-batch: which global tokens every CP rank holds, shared by the data slicer and mixers.

A :class:`SequencePlan` is the token layout of one micro-batch on one CP group: P ranks, this rank, the layout
(``layers/cp/plan.py``), the global length T (of a BSHD row, or of the packed THD stream) and the global packed
boundaries. It gives every index the project needs, each computed once:

* ``local_index [T/P]``: global positions this rank holds, in local order (the shard);
* ``gathered_index [T]``: global positions of the rank-major concatenation of every rank's local tokens;
* ``to_global [T]``: its inverse, ``gathered.index_select(0, to_global)`` is in global order.

:func:`plan_for_batch` caches the plan on the micro-batch's ``PackedSeqParams`` object (THD) or by value (BSHD),
so ``hp_megatron.data.get_batch_on_this_cp_rank`` and every layer of the micro-batch share one object and read
``cu_seqlens`` once. :func:`gather_sequence` is the one differentiable all-gather + reorder into global order.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

from layers.cp.collectives import all_gather
from layers.cp.plan import _check_rank, check_divisibility, check_layout, local_seq_index, normalize_global_cu_seqlens

_BATCH_CACHE_ATTR = "_hp_sequence_plans"   # dict on a PackedSeqParams object: one plan per (P, rank, layout, T)


@dataclass(frozen=True, eq=False)
class SequencePlan:
    """The CP token layout of one micro-batch (tensors CPU int64; see the module doc)."""

    world_size: int
    rank: int
    layout: str
    seq_len: int
    cu_seqlens: torch.Tensor | None

    @property
    def local_len(self) -> int:
        return self.seq_len // self.world_size

    @cached_property
    def local_index(self) -> torch.Tensor:
        return self.rank_index(self.rank)

    def rank_index(self, rank: int) -> torch.Tensor:
        """Global positions held by ``rank`` of the group, in its local order."""
        return local_seq_index(self.world_size, rank, self.layout, self.seq_len, self.cu_seqlens)

    @cached_property
    def gathered_index(self) -> torch.Tensor:
        return torch.cat([self.rank_index(r) for r in range(self.world_size)])

    @cached_property
    def to_global(self) -> torch.Tensor:
        return torch.argsort(self.gathered_index)

    def on(self, name: str, device) -> torch.Tensor:
        """Index ``name`` (``local_index`` / ``gathered_index`` / ``to_global``) on ``device``, moved once."""
        cache = self.__dict__.setdefault("_on_device", {})
        key = (name, torch.device(device))
        if key not in cache:
            cache[key] = getattr(self, name).to(device)
        return cache[key]

    def shard(self, x: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """This rank's tokens of the global tensor ``x`` along ``seq_dim`` (differentiable index_select)."""
        if x.shape[seq_dim] != self.seq_len:
            raise ValueError(f"tensor of shape {tuple(x.shape)} has {x.shape[seq_dim]} tokens at dim {seq_dim}, "
                             f"the plan {self.seq_len}")
        return x.index_select(seq_dim, self.on("local_index", x.device))


@lru_cache(maxsize=256)   # bounded: packed batches bring new boundaries every step
def _plan_cached(world_size, rank, layout, seq_len, cu_key) -> SequencePlan:
    cu = None if cu_key is None else torch.tensor(cu_key, dtype=torch.int64)
    return SequencePlan(world_size, rank, layout, seq_len, cu)


def sequence_plan(world_size: int, rank: int, layout: str, seq_len: int, cu_seqlens=None) -> SequencePlan:
    """The plan of ``rank`` among ``world_size`` ranks for global length ``seq_len`` (ValueError naming the
    violated constraint when the layout cannot hold it); cached by value."""
    check_layout(layout)
    _check_rank(world_size, rank)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    cu = normalize_global_cu_seqlens(cu_seqlens)
    check_divisibility(world_size, layout, seq_len, cu)
    return _plan_cached(world_size, rank, layout, seq_len, None if cu is None else tuple(cu.tolist()))


def packed_cu_seqlens(packed_seq_params) -> torch.Tensor | None:
    """Global packed boundaries of a THD micro-batch as CPU int64 (``cu_seqlens_q_padded``, else ``cu_seqlens_q``;
    cached on the object), or None when ``packed_seq_params`` is None or not THD. Our mixers are self-attention:
    the key boundaries (``cu_seqlens_kv(_padded)``), when given, must equal them (ValueError)."""
    if packed_seq_params is None or getattr(packed_seq_params, "qkv_format", None) != "thd":
        return None
    cache = micro_batch_cache(packed_seq_params)
    if "cu" not in cache:
        cu = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
        if cu is None:
            cu = getattr(packed_seq_params, "cu_seqlens_q", None)
        if cu is None:
            raise ValueError("PackedSeqParams(qkv_format='thd') needs cu_seqlens_q (or cu_seqlens_q_padded)")
        cu = normalize_global_cu_seqlens(cu)
        kv = getattr(packed_seq_params, "cu_seqlens_kv_padded", None)
        if kv is None:
            kv = getattr(packed_seq_params, "cu_seqlens_kv", None)
        if kv is not None and not torch.equal(kv.detach().to("cpu", torch.int64), cu):
            raise ValueError("self-attention needs identical query and key document boundaries; "
                             f"cu_seqlens_q={cu.tolist()} cu_seqlens_kv={kv.tolist()}")
        cache["cu"] = cu
    return cache["cu"]


def check_packed_tokens(owner: str, cu_seqlens, batch: int, seq: int, cp_size: int) -> None:
    """ValueError unless a packed THD input (``cu_seqlens`` not None) has batch 1 and ``cu_seqlens`` (the global,
    pre-CP-split boundaries) ends at the ``seq`` local tokens x ``cp_size`` it holds."""
    if cu_seqlens is None:
        return
    if batch != 1:
        raise ValueError(f"{owner}: packed THD input must have batch size 1 ([t, 1, h]), got b={batch}")
    if int(cu_seqlens[-1]) != seq * cp_size:
        raise ValueError(f"{owner}: cu_seqlens end at {int(cu_seqlens[-1])} tokens but the input holds {seq} "
                         f"local tokens x context-parallel size {cp_size} = {seq * cp_size}; cu_seqlens must be "
                         "the global (pre-CP-split) boundaries")


def micro_batch_cache(packed_seq_params) -> dict:
    """A dict living on the micro-batch's ``PackedSeqParams`` object: what every layer of the micro-batch shares
    (the boundaries, the plans, the CP contexts) is computed once and dies with the micro-batch."""
    cache = getattr(packed_seq_params, _BATCH_CACHE_ATTR, None)
    if cache is None:
        cache = {}
        setattr(packed_seq_params, _BATCH_CACHE_ATTR, cache)
    return cache


def plan_for_batch(packed_seq_params, world_size: int, rank: int, layout: str, seq_len: int) -> SequencePlan:
    """The micro-batch's plan: THD boundaries from ``packed_seq_params`` (the plan is then cached on that object,
    so every layer of the micro-batch gets the same one), BSHD (``packed_seq_params`` None or not THD) by value."""
    cu = packed_cu_seqlens(packed_seq_params)
    if cu is None:
        return sequence_plan(world_size, rank, layout, seq_len)
    cache = micro_batch_cache(packed_seq_params)
    key = (world_size, rank, layout, seq_len)
    if key not in cache:
        cache[key] = sequence_plan(world_size, rank, layout, seq_len, cu)
    return cache[key]


def gather_sequence(x_local: torch.Tensor, plan: SequencePlan, group, stats=None, seq_dim: int = 0) -> torch.Tensor:
    """Every rank's local tokens along ``seq_dim`` all-gathered over ``group`` and put in global order.

    Differentiable: the backward reduce-scatters the gradient, so each owner receives the sum over ranks of the
    gradient of its tokens (right when every rank's loss is a different term of one global sum)."""
    if x_local.shape[seq_dim] != plan.local_len:
        raise ValueError(f"local tensor of shape {tuple(x_local.shape)} has {x_local.shape[seq_dim]} tokens at dim "
                         f"{seq_dim}, the plan {plan.local_len} per rank")
    xl = x_local.movedim(seq_dim, 0).contiguous()
    gathered = all_gather(xl, group, stats).reshape((plan.seq_len,) + tuple(xl.shape[1:]))
    return gathered.index_select(0, plan.on("to_global", xl.device)).movedim(0, seq_dim)
