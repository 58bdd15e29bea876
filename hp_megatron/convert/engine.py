"""Streaming conversion between Hugging Face directories and megatron-core ``torch_dist`` checkpoints.

``hf_to_mcore``: every rule is checked first on ``meta`` tensors (HF shapes from the shard headers -> the
model's shapes), so missing/unexpected tensors, shape mismatches and a wrong architecture fail before a byte is
written; then each checkpoint chunk is produced when the writer reaches it (read the rule's HF tensors, apply
the rule, split as the model's ``sharded_state_dict`` says). ``mcore_to_hf`` is the mirror image. Output goes
to a temporary sibling directory that is renamed into place only when complete.

Checkpoint directory (what Megatron-LM's ``--load``/``--finetune`` and ``examples/pretrain`` read)::

    SAVE/latest_checkpointed_iteration.txt      "release" or the iteration
    SAVE/release/ (or iter_0000000/)            .metadata, __0_0.distcp, metadata.json (and common.pt)

The common state holds ``checkpoint_version`` 3.0, ``iteration``, ``content_metadata`` (the sharded_state_dict
metadata the layout was built with) and ``hf_config`` (the HF config.json, carried back by ``mcore_to_hf``); it is
written where the installed megatron-core writes it (``common.pt`` on 0.16, the DCP object ``common_state`` on
0.19: ``layers.base.megatron_compat.common_state_in_dcp``) and read from either.

Both directions take the ``architecture`` to convert: any object with ``model_type`` (config.json's, checked),
``conversion_rules(hf_config) -> list[TensorRule]``, ``build_model(hf_config, **TransformerConfig overrides)``
(the GPTModel on the current megatron parallel state) and ``unmodeled_tensors(hf_config) -> {HF key prefix: what
it holds}`` (checkpoint tensors of parts the model does not build). ``hp_megatron.models.Architecture`` is one;
the engine knows no architecture itself (``hp_megatron.models`` imports it, never the other way).
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import time
from dataclasses import dataclass

import torch

from hp_megatron.checkpoint.common_state import read_common_state, with_common_state
from hp_megatron.checkpoint.dcp_io import ChunkReader, save_lazily
from hp_megatron.checkpoint.directory import checkpoint_directory, iteration_directory, write_tracker
from hp_megatron.checkpoint.errors import CheckpointError
from hp_megatron.convert.layout import CheckpointLayout, LayoutEntry, checkpoint_layout
from hp_megatron.convert.rules import TensorRule
from hp_megatron.convert.safetensors_io import (CONFIG_NAME, HFCheckpoint, ShardedSafetensorsWriter, load_hf_config,
                                                parse_size)
from hp_megatron.platform import single_rank_megatron

NON_MODEL_PREFIXES = ("optimizer.", "rng_state", "rerun_state_machine")  # tensors of a training checkpoint


@dataclass
class ConversionReport:
    """What a conversion did: tensors and bytes written, seconds taken in all and in the setup before the first
    tensor byte (parsing headers, building the model layout, checking every rule)."""

    tensors: int
    bytes: int
    seconds: float
    setup_seconds: float
    output: str
    dropped: tuple = ()      # HF tensors left out (``drop_unmodeled``): parts the megatron model does not build

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / max(self.seconds, 1e-9)

    @property
    def data_mb_per_s(self) -> float:
        """Throughput of the tensor phase alone (reading, converting, writing)."""
        return self.bytes / 1e6 / max(self.seconds - self.setup_seconds, 1e-9)


# ------------------------------------------------------------------------------------------ model layout
def build_layout(build_model, hf_config: dict, metadata: dict | None = None) -> CheckpointLayout:
    """The checkpoint layout of ``build_model(hf_config)`` built at TP=PP=EP=1 on the ``meta`` device (no
    weights are allocated; parameters a module places on an explicit device stay small)."""
    with single_rank_megatron():
        return layout_on_meta(build_model, hf_config, metadata)


def layout_on_meta(build_model, hf_config: dict, metadata: dict | None = None) -> CheckpointLayout:
    """:func:`build_layout` under the megatron parallel state in force (which must be TP=PP=EP=1)."""
    # imported outside the meta context: megatron-core's module-level tensors (the MTP loss scale) stay real
    importlib.import_module("megatron.core.models.gpt")
    with torch.device("meta"):
        model = build_model(hf_config, perform_initialization=False, use_cpu_initialization=True)
        layout = checkpoint_layout(model, metadata)
    layout.check_pieces_tile()
    return layout


def _check_model_type(architecture, hf_config: dict, where: str) -> None:
    if hf_config.get("model_type") != architecture.model_type:
        raise CheckpointError(f"{where}: config.json has model_type={hf_config.get('model_type')!r}; the architecture "
                              f"given converts {architecture.model_type!r}")


def _match_rules(rules: list[TensorRule], layout: CheckpointLayout, where: str) -> list[tuple[TensorRule, LayoutEntry]]:
    """Rules in the model's order, one per model tensor; CheckpointError for gaps and extras."""
    by_key = {}
    for rule in rules:
        if rule.mcore_key in by_key:
            raise CheckpointError(f"two conversion rules build {rule.mcore_key}")
        by_key[rule.mcore_key] = rule
    missing = [k for k in layout.entries if k not in by_key]
    if missing:
        raise CheckpointError(f"{where}: model tensors without a conversion rule (wrong architecture?): {missing[:5]}")
    unknown = [k for k in by_key if k not in layout.entries]
    if unknown:
        raise CheckpointError(f"{where}: conversion rules for tensors the model does not have (wrong architecture?): "
                              f"{unknown[:5]}")
    owner: dict[str, str] = {}
    for rule in rules:
        for hf_key in rule.hf_keys:
            if hf_key in owner:
                raise CheckpointError(f"HF tensor {hf_key} is used by two rules ({owner[hf_key]}, {rule.mcore_key})")
            owner[hf_key] = rule.mcore_key
    return [(by_key[k], entry) for k, entry in layout.entries.items()]


def _meta(shape, dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def _on_meta(fn, arg, what: str):
    """``fn(arg)`` on meta tensors (shapes only); a rule that cannot take these shapes names the tensor."""
    try:
        return fn(arg)
    except Exception as err:
        shapes = [tuple(t.shape) for t in arg] if isinstance(arg, list) else tuple(arg.shape)
        raise CheckpointError(f"{what}: the conversion rule fails on shapes {shapes}: {err}") from err


# ------------------------------------------------------------------------------------------ output dirs
@contextlib.contextmanager
def _atomic_directory(target: str, overwrite: bool):
    """Yields a temporary sibling of ``target``; renames it to ``target`` on success, removes it on failure."""
    target = os.path.abspath(target)
    if os.path.exists(target) and not overwrite:
        raise FileExistsError(f"{target} exists; pass overwrite=True (--overwrite) to replace it")
    tmp = f"{target}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = f"{target}.old-{os.getpid()}"
    if os.path.exists(target):
        os.rename(target, old)
    os.rename(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def stored_hf_config(load: str) -> dict:
    """The HF config.json a checkpoint carries (written by :func:`hf_to_mcore`); ``load`` as in :func:`mcore_to_hf`."""
    ckpt = checkpoint_directory(load)
    return _hf_config_of(read_common_state(ckpt), ckpt)


def stored_mtp_depth(load: str) -> int:
    """How many multi-token-prediction layers (megatron-core ``mtp.layers.<k>.*`` tensors) a checkpoint holds."""
    import re

    keys = ChunkReader(checkpoint_directory(load)).tensors
    return len({m.group(1) for k in keys if (m := re.match(r"mtp\.layers\.(\d+)\.", k))})


def stored_model_class(load: str) -> str:
    """``hybrid`` when a checkpoint holds megatron-core ``HybridModel`` tensors (its final norm
    ``decoder.final_norm.*``), else ``gpt`` (``GPTModel``: ``decoder.final_layernorm.*``)."""
    keys = ChunkReader(checkpoint_directory(load)).tensors
    return "hybrid" if any(k.startswith("decoder.final_norm.") for k in keys) else "gpt"


def _hf_config_of(common: dict, ckpt: str) -> dict:
    if common.get("hf_config") is None:
        raise CheckpointError(f"{ckpt}: its common state stores no hf_config; pass the HF config.json (--hf-config)")
    return common["hf_config"]


# ------------------------------------------------------------------------------------------ HF -> mcore
def hf_to_mcore(hf_dir: str, save: str, architecture, *, iteration: int | None = None,
                metadata: dict | None = None, overwrite: bool = False,
                drop_unmodeled: bool = False) -> ConversionReport:
    """Convert the HF directory ``hf_dir`` of ``architecture`` (see the module docstring) into a megatron-core
    checkpoint at ``save``.

    ``iteration=None`` writes a ``release`` checkpoint (Megatron-LM loads it as a starting point: no optimizer,
    iteration 0), an int writes ``iter_XXXXXXX``. ``metadata`` is the ``sharded_state_dict`` metadata (default:
    megatron-core's defaults, as Megatron-LM and examples/pretrain load without content metadata).
    Tensors of parts the model does not build (the architecture's ``unmodeled_tensors``, e.g. DeepSeek-V3's
    multi-token-prediction layers) stop the conversion with a CheckpointError naming them, unless
    ``drop_unmodeled`` (then the report lists them in ``dropped``); any other tensor no rule reads always stops it."""
    start = time.perf_counter()
    hf = HFCheckpoint(hf_dir)
    _check_model_type(architecture, hf.config, hf_dir)
    rules = list(architecture.conversion_rules(hf.config))
    layout = build_layout(architecture.build_model, hf.config, metadata)
    matched = _match_rules(rules, layout, hf_dir)

    unexpected = sorted(set(hf.tensors) - {k for rule in rules for k in rule.hf_keys})
    unmodeled = architecture.unmodeled_tensors(hf.config)
    parts = {k: next((what for prefix, what in unmodeled.items() if k.startswith(prefix)), None) for k in unexpected}
    dropped = tuple(k for k in unexpected if parts[k] is not None)
    unexpected = [k for k in unexpected if parts[k] is None]
    if unexpected:
        raise CheckpointError(f"{hf.path(unexpected[0])}: unexpected tensor {unexpected[0]}: no conversion rule reads "
                              f"it ({len(unexpected)} such tensors: {unexpected[:5]})")
    if dropped and not drop_unmodeled:
        raise CheckpointError(f"{hf_dir}: {len(dropped)} tensors of parts the megatron model does not build: "
                              f"{sorted(set(parts[k] for k in dropped))} (e.g. {dropped[0]}); build the model with "
                              "them (multi-token prediction: --mtp-num-layers) or pass drop_unmodeled=True "
                              "(--drop-unmodeled) to convert the rest without them")
    chunks, owners = [], []
    for index, (rule, entry) in enumerate(matched):
        for key in rule.hf_keys:
            if key not in hf.tensors:
                raise CheckpointError(f"{hf_dir}: missing tensor {key} (needed for {rule.mcore_key}; no shard "
                                      "holds it)")
        infos = [hf.tensors[k] for k in rule.hf_keys]
        out = _on_meta(rule.to_mcore, [_meta(i.shape, i.dtype) for i in infos], rule.mcore_key)
        if tuple(out.shape) != entry.shape:
            described = ", ".join(f"{k} {i.shape} in {i.file}" for k, i in zip(rule.hf_keys, infos))
            raise CheckpointError(f"{hf_dir}: shape mismatch for {rule.mcore_key}: the model built from config.json "
                                  f"needs {entry.shape}, the HF tensors ({described}) give {tuple(out.shape)}")
        for piece, _ in entry.split(out):
            chunks.append(piece)
            owners.append(index)

    current: dict = {}

    def produce(i: int) -> torch.Tensor:
        index = owners[i]
        if current.get("index") != index:
            current.clear()  # drop the previous rule's tensors before reading the next
            rule, entry = matched[index]
            full = rule.to_mcore([hf.read(k) for k in rule.hf_keys])
            current.update(index=index, pieces={(p.key, p.offset): data for p, data in entry.split(full)})
        return current["pieces"][(chunks[i].key, chunks[i].offset)]

    setup = time.perf_counter() - start
    with _atomic_directory(save, overwrite) as tmp:
        ckpt = iteration_directory(tmp, iteration)
        os.makedirs(ckpt)
        common = {"checkpoint_version": 3.0, "iteration": 0 if iteration is None else iteration,
                  "hf_config": hf.config}
        if metadata is not None:
            common["content_metadata"] = metadata
        save_lazily(ckpt, chunks, with_common_state(ckpt, common, layout.objects), produce)
        current.clear()
        write_tracker(tmp, iteration)
    nbytes = sum(torch.Size(c.size).numel() * c.dtype.itemsize for c in chunks)
    return ConversionReport(len(chunks), nbytes, time.perf_counter() - start, setup, os.path.abspath(save),
                            dropped)


# ------------------------------------------------------------------------------------------ mcore -> HF
def mcore_to_hf(load: str, save: str, architecture, *, hf_config=None, max_shard_size: str | int = "5GB",
                overwrite: bool = False) -> ConversionReport:
    """Convert the megatron-core checkpoint ``load`` (root with a tracker file, or the iteration directory) of
    ``architecture`` (see the module docstring) into an HF directory at ``save`` (config.json + safetensors shards
    + index).

    ``hf_config`` (a dict, a config.json or a directory holding one) defaults to the config the checkpoint carries
    (:func:`stored_hf_config`)."""
    start = time.perf_counter()
    ckpt = checkpoint_directory(load)
    common = read_common_state(ckpt)
    reader = ChunkReader(ckpt)  # checks the files .metadata points into: damage is named before any work
    hf_config = _hf_config_of(common, ckpt) if hf_config is None else load_hf_config(hf_config)
    _check_model_type(architecture, hf_config, ckpt)
    rules = list(architecture.conversion_rules(hf_config))
    metadata = common.get("content_metadata")
    layout = build_layout(architecture.build_model, hf_config, metadata)
    matched = _match_rules(rules, layout, ckpt)

    specs, used = [], set()
    for rule, entry in matched:
        pieces = entry.pieces()
        for piece in pieces:
            stored = reader.tensors.get(piece.key)
            if stored is None:
                raise CheckpointError(f"{ckpt}: missing tensor {piece.key} (for {rule.mcore_key})")
            if stored[0] != piece.global_shape:
                raise CheckpointError(f"{ckpt}: shape mismatch for {piece.key}: stored {stored[0]}, the model built "
                                      f"from config.json needs {piece.global_shape}")
            used.add(piece.key)
        dtype = reader.tensors[pieces[0].key][1]
        outs = _on_meta(rule.to_hf, _meta(entry.shape, dtype), rule.mcore_key)
        if len(outs) != len(rule.hf_keys):
            raise CheckpointError(f"{rule.mcore_key}: the rule returned {len(outs)} tensors for {len(rule.hf_keys)} "
                                  "HF keys")
        specs += [(k, t.dtype, tuple(t.shape)) for k, t in zip(rule.hf_keys, outs)]
    unexpected = sorted(k for k in set(reader.tensors) - used if not k.startswith(NON_MODEL_PREFIXES))
    if unexpected:
        raise CheckpointError(f"{ckpt}: unexpected tensor {unexpected[0]}: the model built from config.json has no "
                              f"such tensor ({len(unexpected)} such tensors: {unexpected[:5]})")

    setup = time.perf_counter() - start
    with _atomic_directory(save, overwrite) as tmp:
        writer = ShardedSafetensorsWriter(tmp, specs, parse_size(max_shard_size))
        for rule, entry in matched:
            pieces = entry.pieces()
            full = torch.empty(entry.shape, dtype=reader.tensors[pieces[0].key][1])
            targets = entry.split(full)
            for _, view in targets:
                if view.untyped_storage().data_ptr() != full.untyped_storage().data_ptr():
                    raise CheckpointError(f"{rule.mcore_key}: its sharding factory copies; cannot assemble it")
            reader.read_into([(p.key, p.offset, view) for p, view in targets])
            for key, tensor in zip(rule.hf_keys, rule.to_hf(full)):
                writer.write(key, tensor)
            del full, targets
        writer.close()
        with open(os.path.join(tmp, CONFIG_NAME), "w") as f:
            json.dump(hf_config, f, indent=2, sort_keys=True)
    return ConversionReport(len(specs), writer.total_size, time.perf_counter() - start, setup, os.path.abspath(save))
