"""Hugging Face weights out of a running megatron-core model, for rollout engines (vLLM / SGLang weight sync).

:class:`HFWeightExporter` (and the one-shot :func:`export_hf_weights`) yields ``(hf_name, tensor)`` for every
tensor of the Hugging Face checkpoint, in its names and layouts, from a ``GPTModel`` sharded over any TP / PP /
EP / ETP / CP / DP layout: exactly the tensors ``mcore_to_hf`` writes for a checkpoint of the same weights, because
it is ``mcore_to_hf`` with the checkpoint reader replaced by the ranks' own shards.

- **What a tensor is.** As in ``mcore_to_hf``: the model built at TP=PP=EP=1 on the ``meta`` device (the
  *template*) says, for each conversion rule's megatron tensor (``TensorRule.mcore_key``), which regions of which
  checkpoint tensors (``sharded_state_dict`` keys) it is made of; the running model's ``sharded_state_dict`` says
  which rank holds which region. Only main replicas count (``replica_id`` all zeros): a DP / CP / expert-DP replica
  and a tied output layer on the last pipeline stage are never read.
- **Streaming.** One rule at a time: the owners send their regions of its megatron tensor to the receiving rank(s)
  (point-to-point to ``dst``, or a broadcast from each owner when ``dst=None``), the receiver assembles the full
  tensor, applies the rule's ``to_hf`` and yields its HF tensors, then drops it. Extra memory: one full megatron
  tensor (the largest rule's) plus one region buffer on a receiver, one region copy on a sender. The generator
  keeps no reference to a tensor it yielded once the next rule starts.
- **Collective.** Building an exporter and iterating it are collective over ``group``: every rank of it iterates
  the generator to the end, in step. Ranks that do not receive yield ``(hf_name, None)``, so every rank sees the
  same sequence of names.

The template is built inside this multi-rank process: :func:`single_rank_parallel_state` presents megatron-core's
parallel state as one rank (every group this rank's own one-rank gloo group) while the meta model is built, and
restores it afterwards. Build an exporter once and call it every step: the template, the rule matching and the
map of who holds what are computed once; a call re-reads only this rank's ``sharded_state_dict`` (local).
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.distributed as dist

from hp_megatron.checkpoint.dcp_io import Chunk
from hp_megatron.checkpoint.errors import CheckpointError
from hp_megatron.convert.engine import _check_model_type, _match_rules, layout_on_meta
from hp_megatron.convert.layout import _flatten, _piece

_SELF_GROUP = {}  # global rank -> this process's one-rank gloo group (created once)


def _self_group():
    rank = dist.get_rank()
    if rank not in _SELF_GROUP:
        # only this rank creates it: no collective, and torch names it by a hash of its ranks, not the group count
        _SELF_GROUP[rank] = dist.new_group([rank], backend="gloo", use_local_synchronization=True)
    return _SELF_GROUP[rank]


@contextlib.contextmanager
def single_rank_parallel_state():
    """megatron-core's parallel state as a one-rank world (TP=PP=CP=EP=DP=1) for the duration, in a process of a
    multi-rank world: every process group of ``parallel_state`` is this rank's own one-rank group, every rank list
    ``[rank]``, every size / rank override unset; all of it restored afterwards. For building a template model
    (no communication happens over these groups)."""
    from megatron.core import parallel_state

    state = vars(parallel_state)
    saved = {name: value for name, value in state.items() if name.startswith("_") and name.isupper()}
    group, rank = _self_group(), dist.get_rank()
    for name, value in saved.items():
        if isinstance(value, dist.ProcessGroup):
            state[name] = group
        elif name.endswith("_RANKS"):
            state[name] = [rank]
        elif name.startswith(("_MPU_", "_VIRTUAL_PIPELINE_")) or name == "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS":
            state[name] = None
        elif name == "_HYBRID_DP_CP_GROUPS":
            state[name] = {}
    try:
        yield group
    finally:
        state.update(saved)


def _box(tensor: torch.Tensor, start, size) -> torch.Tensor:
    return tensor[tuple(slice(s, s + n) for s, n in zip(start, size))]


def _intersection(a: Chunk, b: Chunk):
    """(start, size) of the overlap of two chunks of one checkpoint tensor, or None."""
    start = tuple(max(x, y) for x, y in zip(a.offset, b.offset))
    end = tuple(min(x + n, y + m) for x, n, y, m in zip(a.offset, a.size, b.offset, b.size))
    if any(e <= s for s, e in zip(start, end)):
        return None
    return start, tuple(e - s for s, e in zip(start, end))


def local_main_shards(model, metadata: dict | None = None) -> list[tuple[Chunk, torch.Tensor]]:
    """This rank's main-replica pieces of ``model.sharded_state_dict(metadata=metadata)``: (chunk, detached data
    shaped as the chunk), sharding factories built, ``_extra_state`` objects left out."""
    from megatron.core.dist_checkpointing.mapping import (ShardedObject, ShardedTensor, ShardedTensorFactory,
                                                          is_main_replica)

    shards = []
    for name, value in model.sharded_state_dict(metadata=metadata).items():
        if isinstance(value, ShardedObject):
            continue
        if isinstance(value, ShardedTensorFactory):
            built = _flatten(value.build())
        elif isinstance(value, ShardedTensor):
            built = [value]
        else:
            raise CheckpointError(f"model state {name}: {type(value).__name__} is neither a sharded tensor nor a "
                                  "sharded object; cannot export it")
        for sh_ten in built:
            if sh_ten.flattened_range is not None:
                raise CheckpointError(f"model state {sh_ten.key}: a flattened (distributed-optimizer) shard; export "
                                      "takes the model's own sharded_state_dict")
            if is_main_replica(sh_ten.replica_id):
                chunk = _piece(sh_ten)
                shards.append((chunk, sh_ten.data.detach().reshape(chunk.size)))
    return shards


class HFWeightExporter:
    """The HF tensors of a running ``model`` (this rank's ``GPTModel`` pipeline stage, TP / EP shards, unwrapped
    from DDP / Float16Module) of ``architecture`` (as in ``mcore_to_hf``: ``model_type``, ``conversion_rules``,
    ``build_model``; with the model's MTP depth, ``with_mtp``) built from ``hf_config`` (the config.json dict), over
    the process group ``group`` (default: the whole world; every rank holding a piece of the model must be in it).

    Constructing it is collective over ``group`` (the template model is built on ``meta``, the ranks' shard
    metadata all-gathered); so is each call. ``metadata`` is the ``sharded_state_dict`` metadata the model is
    checkpointed with (default: megatron-core's defaults)."""

    def __init__(self, model, architecture, hf_config: dict, *, metadata: dict | None = None, group=None):
        _check_model_type(architecture, hf_config, "export")
        if isinstance(model, (list, tuple)):
            raise TypeError(f"export takes one model (this rank's GPTModel), got a {type(model).__name__} of "
                            f"{len(model)}: virtual pipeline chunks are not supported")
        self.model, self.metadata = model, metadata
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank()
        self.device = next(model.parameters()).device
        with single_rank_parallel_state():
            layout = layout_on_meta(architecture.build_model, hf_config, metadata)
        self.matched = _match_rules(list(architecture.conversion_rules(hf_config)), layout, "export")
        try:  # a rank that fails here still joins the all-gather: the others would wait there for it
            self.local_chunks, failure = [chunk for chunk, _ in local_main_shards(model, metadata)], None
        except Exception as err:  # noqa: BLE001 (re-raised below, on every rank)
            self.local_chunks, failure = None, err
        gathered = [None] * dist.get_world_size(self.group)
        why = None if failure is None else f"{type(failure).__name__}: " + str(failure).partition("\n")[0]
        dist.all_gather_object(gathered, (self.rank, self.local_chunks, why), group=self.group)
        failed = [(rank, why) for rank, _, why in gathered if why is not None]
        if failed:
            raise CheckpointError(f"export: rank {failed[0][0]} cannot list its shards of the model: {failed[0][1]} "
                                  f"({len(failed)} of {len(gathered)} ranks failed)") from failure
        self.plan = self._plan([(rank, chunks) for rank, chunks, _ in gathered])

    def _plan(self, gathered) -> list[tuple[torch.dtype, list]]:
        """Per matched rule: (dtype, transfers), a transfer ``(owner rank, index in its shards, template piece,
        start in the owner's shard, start in the piece, size)``. CheckpointError (the same on every rank) when the
        ranks' main replicas do not tile the template's pieces exactly."""
        by_key: dict[str, list] = {}
        unread = {}  # (rank, index) -> elements of that shard no template piece has read yet
        for rank, chunks in gathered:
            for index, chunk in enumerate(chunks):
                by_key.setdefault(chunk.key, []).append((rank, index, chunk))
                unread[(rank, index)] = chunk.numel
        plan = []
        for rule, entry in self.matched:
            transfers, dtype = [], None
            for p, piece in enumerate(entry.pieces()):
                covered = 0
                for rank, index, chunk in by_key.get(piece.key, ()):
                    if chunk.global_shape != piece.global_shape:
                        raise CheckpointError(f"export: {piece.key} has shape {chunk.global_shape} on rank {rank}; "
                                              f"the model built from hf_config needs {piece.global_shape}")
                    overlap = _intersection(piece, chunk)
                    if overlap is None:
                        continue
                    start, size = overlap
                    transfers.append((rank, index, p, tuple(s - o for s, o in zip(start, chunk.offset)),
                                      tuple(s - o for s, o in zip(start, piece.offset)), size))
                    covered += math.prod(size)
                    unread[(rank, index)] -= math.prod(size)
                    dtype = chunk.dtype if dtype is None else dtype
                if covered != piece.numel:
                    raise CheckpointError(f"export: the ranks' main replicas hold {covered} of the {piece.numel} "
                                          f"elements of {piece.key} at {piece.offset} (for {rule.mcore_key})")
            plan.append((entry.dtype if dtype is None else dtype, transfers))
        left = [(rank, index) for (rank, index), n in unread.items() if n]
        if left:
            rank, index = left[0]
            raise CheckpointError(f"export: {dict(gathered)[rank][index].key} held by rank {rank} is not (fully) "
                                  f"read by any conversion rule ({len(left)} such shards)")
        return plan

    def __call__(self, dst: int | None = 0) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Yield ``(hf_name, tensor)`` for every HF tensor, in the rules' order. ``dst``: the global rank that
        receives the tensors (the others get ``None``), or None: every rank of ``group`` receives every tensor.
        Tensors are on the model's device, in its dtype, and may be views of one assembled megatron tensor."""
        if dst is not None and dst not in dist.get_process_group_ranks(self.group):
            raise ValueError(f"dst={dst} is not a rank of the export's group "
                             f"{dist.get_process_group_ranks(self.group)}")
        return self._weights(dst)

    def _weights(self, dst):
        shards = local_main_shards(self.model, self.metadata)
        unchanged = torch.tensor([int([chunk for chunk, _ in shards] == self.local_chunks)], device=self.device)
        dist.all_reduce(unchanged, op=dist.ReduceOp.MIN, group=self.group)  # every rank stops, or none
        if not unchanged.item():
            raise CheckpointError("export: a rank's sharded_state_dict differs from when the exporter was built; "
                                  "build a new HFWeightExporter")
        data = [tensor for _, tensor in shards]
        del shards
        receives = dst is None or dst == self.rank
        for (rule, entry), (dtype, transfers) in zip(self.matched, self.plan):
            if not receives:
                for owner, index, _, start, _, size in transfers:
                    self._move(dst, owner, data[index] if owner == self.rank else None, start, size, dtype, None)
                for name in rule.hf_keys:
                    yield name, None
                continue
            full = torch.empty(entry.shape, dtype=dtype, device=self.device)
            views = [view for _, view in entry.split(full)]
            if any(view._base is not full and view is not full for view in views):
                raise CheckpointError(f"{rule.mcore_key}: its sharding factory copies; cannot assemble it")
            for owner, index, piece, start, piece_start, size in transfers:
                self._move(dst, owner, data[index] if owner == self.rank else None, start, size, dtype,
                           _box(views[piece], piece_start, size))
            del views
            outs = list(rule.to_hf(full))
            del full
            names = list(rule.hf_keys)
            while outs:  # hand each tensor over without keeping it
                yield names.pop(0), outs.pop(0)

    def _move(self, dst, owner, source, start, size, dtype, target) -> None:
        """One region from ``owner`` (``source``: its shard there) into ``target`` on the receiving rank(s)."""
        block = _box(source, start, size) if source is not None else None
        if dst is None:
            buffer = block.contiguous() if block is not None else torch.empty(size, dtype=dtype, device=self.device)
            dist.broadcast(buffer, src=owner, group=self.group)
            target.copy_(buffer)
        elif owner == dst:
            if target is not None:
                target.copy_(block)
        elif block is not None:
            dist.send(block.contiguous(), dst=dst, group=self.group)
        elif target is not None:
            buffer = torch.empty(size, dtype=dtype, device=self.device)
            dist.recv(buffer, src=owner, group=self.group)
            target.copy_(buffer)


def export_hf_weights(model, architecture, hf_config: dict, *, dst: int | None = 0, metadata: dict | None = None,
                      group=None) -> Iterator[tuple[str, torch.Tensor | None]]:
    """``HFWeightExporter(model, architecture, hf_config, metadata=metadata, group=group)(dst)``: the HF tensors
    of a running model, once (collective over ``group``; see :class:`HFWeightExporter`)."""
    return HFWeightExporter(model, architecture, hf_config, metadata=metadata, group=group)(dst)
