"""GPTModel -> HybridModel migration of a ``torch_dist`` checkpoint of our layers (``python -m hp_megatron.convert
gpt-to-hybrid``): GDN, KDA, MLA and attention layers, dense and MoE MLPs mixed, MTP layers.

megatron-core's own routes (``gpt_checkpoint_interop.py`` at load time, ``tools/checkpoint/gpt_hybrid_conversion.py``
offline) refuse patterns with ``G`` / ``+`` layers, MTP and mixed MLPs. Here every tensor and serialized object of
the checkpoint keeps its bytes and chunking and only its key changes, by ``hp_megatron.hybrid_model.numbering.
LayerNumbering``: the model's (``decoder.layers.<i>.self_attention.*`` -> ``decoder.layers.<j>.self_attention.*``,
``decoder.final_layernorm`` -> ``decoder.final_norm``, MTP inner layers), and the optimizer state's, which
megatron-core keys by the same names (``optimizer.state.exp_avg.<model key>``); the common state (iteration, LR
schedule, optimizer param groups, which name no parameter) is kept, with ``model_class = "hybrid"`` and the pattern
added; the output layer's ``_extra_state`` object, empty without Transformer Engine, which ``GPTModel`` leaves out
of its checkpoints and ``HybridModel`` reads, is added empty. So a training checkpoint resumes as HybridModel where
the GPT run left off (weights bit-exact, Adam moments too); a weights-only (``release``) checkpoint stays weights-only.

Refused: GPT checkpoints with megatron-core's stacked layer axis (every layer of one mixer and one MLP kind,
``decoder.layers.<name>`` of shape ``[layers, ...]``; megatron-core's ``gpt_hybrid_conversion.py`` handles those
``*-`` / ``*E`` models) and a pattern whose layers do not match the checkpoint's.
"""
from __future__ import annotations

import os
import re

from hp_megatron.checkpoint.common_state import read_common_state, with_common_state
from hp_megatron.checkpoint.dcp_io import Chunk, ChunkReader, object_bytes, save_lazily
from hp_megatron.checkpoint.directory import (COMMON_OBJECT, RELEASE, checkpoint_directory, iteration_directory,
                                              write_tracker)
from hp_megatron.checkpoint.errors import CheckpointError

OUTPUT_EXTRA_STATE = "output_layer._extra_state/shard_0_1"
STACKED = re.compile(r"(^|\.)decoder\.layers\.(?!\d)")


def pattern_of_model_args(stored: dict) -> str:
    """The HybridModel pattern of an example checkpoint's stored flags (``hp_model_args``: ``hp_layer_pattern``,
    ``num_layers``, ``num_experts`` (every layer MoE: the example has no ``--moe-layer-freq``), ``mtp_num_layers``,
    ``hp_mtp_layer_symbol``)."""
    from hp_megatron.hybrid_model.numbering import hybrid_pattern_of

    pattern, layers = stored["hp_layer_pattern"], stored["num_layers"]
    depth = stored.get("mtp_num_layers") or 0
    mtp_symbol = stored.get("hp_mtp_layer_symbol") or (pattern[0] if len(set(pattern)) == 1 else None)
    return hybrid_pattern_of(pattern, layers, [stored.get("num_experts") is not None] * layers,
                             mtp_symbol=mtp_symbol, mtp_depth=depth)


def _renamed(key: str, rename) -> str:
    """``key`` (a tensor key or a ``<key>/shard_<i>_<n>`` object key) with its name renamed by ``rename``."""
    name, slash, shard = key.partition("/")
    return rename(name) + slash + shard


def migrate_gpt_to_hybrid(load: str, save: str, hybrid_pattern: str, *, overwrite: bool = False) -> dict:
    """Write the HybridModel checkpoint of the GPTModel checkpoint ``load`` (root or iteration directory) under
    ``save`` (same iteration directory name and tracker); ``hybrid_pattern``: the model's HybridModel pattern (with
    ``/`` MTP parts; ``|`` is irrelevant to the keys). Returns ``{"tensors", "objects", "optimizer": bool}``."""
    return _migrate(load, save, hybrid_pattern, "hybrid", overwrite)


def migrate_hybrid_to_gpt(load: str, save: str, hybrid_pattern: str, *, overwrite: bool = False) -> dict:
    """The inverse of :func:`migrate_gpt_to_hybrid` (``hybrid-to-gpt``: e.g. to generate from a HybridModel
    checkpoint, which ``hp_megatron.generate`` does not build yet); ``hybrid_pattern``: the checkpoint's."""
    return _migrate(load, save, hybrid_pattern, "gpt", overwrite)


def _migrate(load: str, save: str, hybrid_pattern: str, target: str, overwrite: bool) -> dict:
    from hp_megatron.convert.engine import _atomic_directory
    from hp_megatron.hybrid_model.numbering import LayerNumbering

    ckpt = checkpoint_directory(load)
    reader = ChunkReader(ckpt)
    stacked = sorted(k for k in reader.tensors if STACKED.search(k))
    if stacked:
        raise CheckpointError(f"{ckpt}: GPT tensors on megatron-core's stacked layer axis ({stacked[0]}, ...): a "
                              "model of one mixer and one MLP kind; migrate it with megatron-core's "
                              "tools/checkpoint/gpt_hybrid_conversion.py")
    is_hybrid = any(k.startswith("decoder.final_norm.") for k in reader.tensors)
    if is_hybrid == (target == "hybrid"):
        raise CheckpointError(f"{ckpt}: already a {'HybridModel' if is_hybrid else 'GPTModel'} checkpoint (decoder."
                              f"{'final_norm' if is_hybrid else 'final_layernorm'}.*)")
    numbering = LayerNumbering(hybrid_pattern)
    layers = {int(m.group(1)) for k in reader.tensors if (m := re.search(r"(?:^|\.)decoder\.layers\.(\d+)\.", k))}
    expected = len(numbering.hybrid_pattern.split("/")[0].replace("|", "")) if is_hybrid else numbering.num_gpt_layers
    if layers != set(range(expected)):
        raise CheckpointError(f"{ckpt}: holds layers {sorted(layers)}, the hybrid layer pattern {hybrid_pattern!r} "
                              f"{expected} {'HybridModel' if is_hybrid else 'GPT'} layers")
    common = read_common_state(ckpt)
    if target == "hybrid":
        rename = numbering.gpt_to_hybrid
        common.update(model_class="hybrid", hybrid_layer_pattern=hybrid_pattern)
    else:
        def rename(name):   # GPTModel's MTP checkpoint keys say transformer_layer on every megatron-core version
            return numbering.hybrid_to_gpt(name, mtp_inner="transformer_layer")

        common.update(model_class="gpt")
        common.pop("hybrid_layer_pattern", None)
    keys = {k: _renamed(k, rename) for k in reader.tensors}
    if len(set(keys.values())) != len(keys):
        raise CheckpointError(f"{ckpt}: two tensors map to one HybridModel key under {hybrid_pattern!r}")
    chunks, sources = [], []
    for key, (shape, dtype) in reader.tensors.items():
        for offset, size in reader.chunks(key):
            chunks.append(Chunk(keys[key], shape, offset, size, dtype))
            sources.append((key, offset, size, dtype))
    objects = {_renamed(k, rename): v for k, v in reader.read_objects([k for k in reader.objects
                                                                     if k != COMMON_OBJECT]).items()}
    # GPTModel leaves its (empty) output-layer extra state out of checkpoints, HybridModel reads it
    if target == "gpt":
        objects.pop(OUTPUT_EXTRA_STATE, None)
    elif "output_layer.weight" in reader.tensors:
        objects.setdefault(OUTPUT_EXTRA_STATE, object_bytes(None))

    def produce(i: int):
        import torch

        key, offset, size, dtype = sources[i]
        out = torch.empty(size, dtype=dtype)
        reader.read_into([(key, offset, out)])
        return out

    name = os.path.basename(os.path.normpath(ckpt))
    iteration = None if name == RELEASE else int(name.removeprefix("iter_"))
    with _atomic_directory(save, overwrite) as tmp:
        target = iteration_directory(tmp, iteration)
        os.makedirs(target)
        save_lazily(target, chunks, with_common_state(target, common, objects), produce)
        write_tracker(tmp, iteration)
    return {"tensors": len(reader.tensors), "objects": len(objects),
            "optimizer": any(k.startswith("optimizer.") for k in reader.tensors)}
