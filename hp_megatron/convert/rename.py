"""A megatron-core ``torch_dist`` checkpoint copied with its model tensors under new names.

For two models whose checkpoints hold the same global tensors under other keys (megatron-core's own GatedDeltaNet
layers and ours: ``hp_megatron.models.megatron_gdn``). Every model tensor keeps its global shape, its bytes and
the chunking of the run that wrote it (any TP / PP / EP); ``dist_checkpointing`` reshards on load as it does for
any checkpoint, so the copy loads at any parallel layout. ``rename(key)`` gives each stored model key its new key
(it raises for a key it has no name for); two keys renamed alike are refused. Training state (optimizer, RNG,
rerun state machine) is left out: the copy is a model-only checkpoint (``release`` unless ``iteration``), a
starting point as ``hf_to_mcore`` writes one (Megatron-LM ``--load`` with ``--finetune``, or ``--no-load-optim
--no-load-rng``).

``target``: the model the copy is for, built at TP=PP=EP=1 (the ``meta`` device is enough). With it, the renamed
tensors are checked against the target's ``sharded_state_dict`` before a byte is written (each tensor the target
loads present with its global shape, no other tensor) and the copy holds the target's own non-tensor objects
(linear layers' ``_extra_state``); without it, the source's objects are copied under their renamed keys. The
common state (``checkpoint_version``, ``iteration`` and the source's ``content_metadata``) is written where the
installed megatron-core keeps it (``hp_megatron.checkpoint.with_common_state``).
"""
from __future__ import annotations

import os
import time

import torch

from hp_megatron.checkpoint.common_state import read_common_state, with_common_state
from hp_megatron.checkpoint.dcp_io import Chunk, ChunkReader, save_lazily
from hp_megatron.checkpoint.directory import (COMMON_FILE, COMMON_OBJECT, checkpoint_directory, iteration_directory,
                                              write_tracker)
from hp_megatron.checkpoint.errors import CheckpointError
from hp_megatron.convert.engine import NON_MODEL_PREFIXES, ConversionReport, _atomic_directory
from hp_megatron.convert.layout import checkpoint_layout


def _source_common(ckpt: str, reader: ChunkReader) -> dict:
    """The source's common state (``common.pt`` or megatron-core 0.19's ``COMMON_OBJECT``), else nothing (a
    checkpoint saved without common state)."""
    if os.path.isfile(os.path.join(ckpt, COMMON_FILE)) or COMMON_OBJECT in reader.objects:
        return read_common_state(ckpt)
    return {}


def _object_base(key: str) -> str:
    """A ShardedObject's key without its ``/shard_...`` suffix."""
    return key.split("/", 1)[0]


def _renamed(keys, rename, what: str) -> dict:
    out, seen = {}, {}
    for key in keys:
        new = rename(key)
        if new in seen:
            raise CheckpointError(f"{what} {seen[new]} and {key} would both be stored as {new}")
        seen[new] = key
        out[key] = new
    return out


def _check_target(target, tensors: dict, reader: ChunkReader) -> dict:
    """The target's objects after checking that the renamed tensors are exactly those it loads, with its shapes."""
    layout = checkpoint_layout(target)
    wanted = {p.key: p.global_shape for entry in layout.entries.values() for p in entry.pieces()}
    have = {new: reader.tensors[old][0] for old, new in tensors.items()}
    missing = sorted(set(wanted) - set(have))
    if missing:
        raise CheckpointError(f"{reader.directory}: the target model loads {len(missing)} tensors the renamed "
                              f"checkpoint lacks: {missing[:5]}")
    extra = sorted(set(have) - set(wanted))
    if extra:
        raise CheckpointError(f"{reader.directory}: {len(extra)} renamed tensors are not in the target model: "
                              f"{extra[:5]}")
    for key, shape in wanted.items():
        if tuple(have[key]) != tuple(shape):
            source = next(old for old, new in tensors.items() if new == key)
            raise CheckpointError(f"{reader.directory}: {source} has shape {tuple(have[key])}; the target model's "
                                  f"{key} has {tuple(shape)}")
    return layout.objects


def rename_checkpoint(load: str, save: str, rename, *, target=None, iteration: int | None = None,
                      overwrite: bool = False) -> ConversionReport:
    """Copy the model tensors of the checkpoint ``load`` (root with a tracker, or an iteration directory) to a new
    checkpoint root ``save``, tensor ``key`` stored as ``rename(key)`` (see the module docstring)."""
    start = time.perf_counter()
    ckpt = checkpoint_directory(load)
    reader = ChunkReader(ckpt)
    common = _source_common(ckpt, reader)
    model_keys = [k for k in reader.tensors if not k.startswith(NON_MODEL_PREFIXES)]
    tensors = _renamed(model_keys, rename, "tensors")
    if target is not None:
        objects = _check_target(target, tensors, reader)
    else:
        common_base = _object_base(COMMON_OBJECT)
        kept = [k for k in reader.objects if not k.startswith(NON_MODEL_PREFIXES) and _object_base(k) != common_base]
        names = _renamed(sorted({_object_base(k) for k in kept}), rename, "objects")   # key/shard_i_n: one base
        data = reader.read_objects(kept)
        objects = {names[_object_base(k)] + k[len(_object_base(k)):]: data[k] for k in kept}
    chunks, sources = [], []
    for old, new in tensors.items():
        shape, dtype = reader.tensors[old]
        for offset, size in reader.chunks(old):
            chunks.append(Chunk(new, shape, offset, size, dtype))
            sources.append(old)

    def produce(i: int) -> torch.Tensor:
        chunk = chunks[i]
        out = torch.empty(chunk.size, dtype=chunk.dtype)
        reader.read_into([(sources[i], chunk.offset, out)])
        return out

    setup = time.perf_counter() - start
    with _atomic_directory(save, overwrite) as tmp:
        out_dir = iteration_directory(tmp, iteration)
        os.makedirs(out_dir)
        record = {"checkpoint_version": 3.0, "iteration": 0 if iteration is None else iteration}
        if common.get("content_metadata") is not None:
            record["content_metadata"] = common["content_metadata"]
        save_lazily(out_dir, chunks, with_common_state(out_dir, record, objects), produce)
        write_tracker(tmp, iteration)
    nbytes = sum(c.numel * c.dtype.itemsize for c in chunks)
    return ConversionReport(len(chunks), nbytes, time.perf_counter() - start, setup, os.path.abspath(save))
