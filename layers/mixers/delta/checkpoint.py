"""Distributed checkpointing of the GDN/KDA mixers: ShardedTensors with TP axes, fused parameters split into parts.

:func:`delta_sharded_state_dict` is the mixers' ``sharded_state_dict``: every parameter a ``ShardedTensor`` with
its TP axis, and every fused parameter (``in_proj.weight``, ``conv1d.weight``, KDA's ``gate_down_proj.weight``)
a :func:`split_sharded_tensor` factory that saves each logical part (``<key>.query`` ...) as its own
ShardedTensor, so a checkpoint reshards across TP sizes.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from megatron.core import parallel_state

from layers.base.compat import own_state_dict
from layers.mixers.delta.params import ShortConvWeights


def delta_sharded_state_dict(mixer, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
    """``mixer.sharded_state_dict``: ShardedTensors with TP axes; fused parameters split into their logical parts
    (``mixer.param_layouts``, TP-reshardable)."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint, sharded_state_dict_default

    metadata = dict(metadata) if metadata is not None else {}
    if metadata.get("dp_cp_group") is None and parallel_state.model_parallel_is_initialized():
        metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    groups = dict(tp_group=mixer.tp_group, dp_cp_group=metadata.get("dp_cp_group"))
    layouts = mixer.param_layouts
    own = own_state_dict(mixer)
    own_axes = {path: lay.tp_dim for path, lay in layouts.items() if "." not in path and lay.tp_dim is not None}
    result = make_sharded_tensors_for_checkpoint(own, prefix, own_axes, sharded_offsets, **groups)
    for child_name, child in mixer.named_children():
        child_prefix = f"{prefix}{child_name}."
        if isinstance(child, ShortConvWeights):
            sd = child.state_dict(prefix="", keep_vars=True)
            result.update(make_sharded_tensors_for_checkpoint(sd, child_prefix, {k: 0 for k in sd},
                                                              sharded_offsets, **groups))
        else:
            result.update(sharded_state_dict_default(child, child_prefix, sharded_offsets, metadata,
                                                     tp_group=mixer.tp_group))
    for path, lay in layouts.items():
        if len(lay.parts) > 1:
            key = prefix + path
            result[key] = split_sharded_tensor(result[key], lay.local_sizes(mixer.tp_size),
                                               [p.name for p in lay.parts], lay.cat_dim)
    return result


def split_sharded_tensor(sharded, local_sizes, names, dim):
    """A ShardedTensorFactory saving a fused local tensor as independent ``<key>.<name>`` ShardedTensors."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if not isinstance(sharded, ShardedTensor):
        raise TypeError(f"expected a ShardedTensor for {getattr(sharded, 'key', sharded)!r}, got "
                        f"{type(sharded).__name__}")
    if sum(local_sizes) != sharded.local_shape[dim]:
        raise ValueError(f"split sizes {local_sizes} do not cover dim {dim} of {sharded.key} "
                         f"(local shape {sharded.local_shape})")
    template = sharded.without_data()

    @torch.no_grad()
    def build(key, data, replica_id, flattened_range):
        whole = replace(template, key=key, data=data, dtype=data.dtype, replica_id=replica_id,
                        flattened_range=flattened_range)
        pieces, start = [], 0
        for size, part in zip(local_sizes, names):
            for piece in whole.narrow(dim, start, size):
                piece.key = f"{piece.key}.{part}"
                pieces.append(piece)
            start += size
        return pieces

    @torch.no_grad()
    def merge(loaded):
        return torch.cat(loaded, dim=dim)

    return ShardedTensorFactory(sharded.key, sharded.data, build, merge, sharded.replica_id)
