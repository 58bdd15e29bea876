"""Where each tensor of a megatron-core model goes in a ``dist_checkpointing`` checkpoint.

A checkpoint's layout is whatever the target model's ``sharded_state_dict()`` says: the checkpoint key of each
parameter (``decoder.layers.mlp.linear_fc1.weight`` for every layer of a homogeneous stack, ``...layers.3...``
otherwise), its global shape (layers and experts are axes of it), its offset in it, and sharding factories that
store one parameter as several pieces (megatron's SwiGLU ``linear_fc1``, grouped experts). Reading that metadata
from the model itself, rather than re-deriving it, is what makes the converted checkpoint load at any
TP/PP/EP/CP through the same ``sharded_state_dict`` path training uses.

:func:`checkpoint_layout` reads it from a model built at TP=PP=EP=1 (ideally on the ``meta`` device, see
``hp_megatron.convert.engine.build_layout``): one :class:`LayoutEntry` per ``GPTModel.state_dict()`` tensor
(the keys of :class:`~hp_megatron.convert.rules.TensorRule`), plus the non-tensor objects (``_extra_state``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from hp_megatron.checkpoint.dcp_io import Chunk, object_bytes
from hp_megatron.checkpoint.errors import CheckpointError


def _flatten(built) -> list:
    if isinstance(built, dict):
        return [x for v in built.values() for x in _flatten(v)]
    if isinstance(built, (list, tuple)):
        return [x for v in built for x in _flatten(v)]
    return [built]


def _piece(sh_ten) -> Chunk:
    size = (1,) * sh_ten.prepend_axis_num + tuple(sh_ten.local_shape)
    return Chunk(sh_ten.key, tuple(sh_ten.global_shape), tuple(sh_ten.global_offset), size, sh_ten.dtype)


@dataclass(frozen=True)
class LayoutEntry:
    """One model tensor (``state_key``, full shape ``shape`` at TP=1) and how it is sharded into the checkpoint."""

    state_key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    sharded: Any  # megatron ShardedTensor or ShardedTensorFactory of the template model

    def split(self, tensor: torch.Tensor) -> list[tuple[Chunk, torch.Tensor]]:
        """``tensor`` (this entry's full tensor) as checkpoint pieces and their data (views where possible)."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

        if isinstance(self.sharded, ShardedTensorFactory):
            f = self.sharded
            built = _flatten(f.build_fn(f.key, tensor, f.replica_id, None))
        else:
            built = [replace(self.sharded, data=tensor, dtype=tensor.dtype)]
        return [(_piece(t), t.data.reshape(_piece(t).size)) for t in built]

    def pieces(self) -> list[Chunk]:
        return [p for p, _ in self.split(torch.empty(self.shape, dtype=self.dtype, device="meta"))]


@dataclass
class CheckpointLayout:
    """``entries`` (state key -> :class:`LayoutEntry`, model order) and ``objects`` (DCP key -> serialized
    non-tensor object, e.g. a linear layer's ``_extra_state``)."""

    entries: dict[str, LayoutEntry]
    objects: dict[str, bytes]

    def check_pieces_tile(self) -> None:
        """Every checkpoint tensor is covered exactly once by the pieces of all entries (else the model's
        sharded_state_dict and the converter disagree, and a load would read unwritten bytes)."""
        covered: dict[str, int] = {}
        shapes: dict[str, tuple] = {}
        for entry in self.entries.values():
            for piece in entry.pieces():
                covered[piece.key] = covered.get(piece.key, 0) + piece.numel
                shapes[piece.key] = piece.global_shape
        for key, numel in covered.items():
            if numel != math.prod(shapes[key]):
                raise CheckpointError(f"checkpoint tensor {key} of shape {shapes[key]}: the model's pieces cover "
                                      f"{numel} of {math.prod(shapes[key])} elements")


def checkpoint_layout(model, metadata: dict | None = None) -> CheckpointLayout:
    """The :class:`CheckpointLayout` of ``model`` (a megatron-core module built at TP=PP=EP=1), from
    ``model.sharded_state_dict(metadata=metadata)``."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    sharded = model.sharded_state_dict(metadata=metadata)
    # sharded_state_dict may rename keys (a layer's sharded_state_dict_keys_map); its tensors are the state's
    state_key_of = {id(t): k for k, t in model.state_dict(keep_vars=True).items() if torch.is_tensor(t)}
    entries, objects = {}, {}
    for sharded_key, value in sharded.items():
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)):
            data = value.data
            state_key = state_key_of.get(id(data))
            if state_key is None:
                raise CheckpointError(f"model state {sharded_key}: its tensor is not one of the model's "
                                      "state_dict() tensors; the converter cannot name it")
            entries[state_key] = LayoutEntry(state_key, tuple(data.shape), data.dtype, value)
        elif isinstance(value, ShardedObject):
            objects[value.unique_key] = object_bytes(value.data)
        else:
            raise CheckpointError(f"model state {sharded_key}: {type(value).__name__} is neither a sharded tensor "
                                  "nor a sharded object; the converter cannot place it")
    return CheckpointLayout(entries, objects)

