"""torch.distributed.checkpoint (DCP) files of megatron-core's ``torch_dist`` format, written and read lazily.

megatron-core's ``dist_checkpointing.save`` gathers every tensor before writing; a converter cannot hold a whole
model. :func:`save_lazily` writes the same files (one ``.distcp`` file plus ``.metadata``) from a plan of chunks
whose data :class:`LazySavePlanner` produces only when DCP's serial writer asks for that chunk, in plan order, so
the resident set is one conversion rule's tensors. :class:`ChunkReader` reads any region of a stored tensor
(one layer of a stacked tensor, say) whatever the chunking it was saved with (a TP=8 training run, say).
"""
from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (BytesIOWriteData, LoadItemType, LoadPlan, LoadPlanner, ReadItem,
                                                  SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from hp_megatron.checkpoint.errors import CheckpointError


@dataclass(frozen=True)
class Chunk:
    """One chunk of a checkpoint tensor: ``key`` of global ``global_shape``, at ``offset``, of ``size``."""

    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    size: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.size)


class LazySavePlanner(SavePlanner):
    """A DCP save planner over ``chunks`` (tensor chunks, written in this order) and ``objects`` (DCP key ->
    serialized bytes); ``produce(i)`` returns the data of ``chunks[i]`` when the writer reaches it."""

    def __init__(self, chunks: Sequence[Chunk], objects: dict[str, bytes], produce: Callable[[int], torch.Tensor]):
        self.chunks, self.objects, self.produce = list(chunks), dict(objects), produce
        self._position = {}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        pass

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO, bytes_io_data=BytesIOWriteData(
            nbytes=len(data))) for key, data in self.objects.items()]
        for i, chunk in enumerate(self.chunks):
            index = MetadataIndex(chunk.key, torch.Size(chunk.offset))
            self._position[(chunk.key, tuple(chunk.offset))] = i
            items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(chunk.offset), sizes=torch.Size(chunk.size)),
                properties=TensorProperties(dtype=chunk.dtype), size=torch.Size(chunk.global_shape))))
        return SavePlan(items)

    def create_global_plan(self, all_plans):
        return create_default_global_save_plan(all_plans, rewrite_index_hints=False)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self.objects[write_item.index.fqn])
        i = self._position[(write_item.index.fqn, tuple(write_item.index.offset))]
        data = self.produce(i)
        chunk = self.chunks[i]
        if tuple(data.shape) != tuple(chunk.size) or data.dtype != chunk.dtype:
            raise CheckpointError(f"checkpoint tensor {chunk.key} at {chunk.offset}: produced "
                                  f"{data.dtype} {tuple(data.shape)}, planned {chunk.dtype} {chunk.size}")
        return data


def save_lazily(directory: str, chunks: Sequence[Chunk], objects: dict[str, bytes],
                produce: Callable[[int], torch.Tensor]) -> None:
    """Write a DCP checkpoint of ``chunks`` and ``objects`` into ``directory`` without a process group."""
    import torch.distributed.checkpoint as dcp

    writer = FileSystemWriter(directory, single_file_per_rank=True, thread_count=1)
    dcp.save({}, storage_writer=writer, planner=LazySavePlanner(chunks, objects, produce), no_dist=True)


class _KnownMetadataReader(FileSystemReader):
    """A :class:`FileSystemReader` of ``.metadata`` parsed once (a reader serves many small loads)."""

    def __init__(self, directory: str, metadata):
        super().__init__(directory)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs):
        return self._metadata


def verify_dcp_files(directory: str):
    """The parsed ``.metadata`` of the DCP checkpoint ``directory``, after checking that every file it points into
    exists and holds the bytes it points at; CheckpointError (a ValueError) naming the missing, unreadable or
    truncated file otherwise, before anything is read."""
    path = os.path.join(directory, ".metadata")
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {directory} is incomplete: no {path}")
    try:
        metadata = FileSystemReader(directory).read_metadata()
    except Exception as err:  # unpickling a damaged file raises anything
        raise CheckpointError(f"checkpoint metadata {path} is unreadable: {error_summary(err)}") from err
    needed: dict[str, tuple[int, str]] = {}  # file -> (bytes it must hold, the key stored last in it)
    for index, info in metadata.storage_data.items():
        end = info.offset + info.length
        if end > needed.get(info.relative_path, (-1, ""))[0]:
            needed[info.relative_path] = (end, index.fqn)
    for name, (end, key) in sorted(needed.items()):
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"checkpoint {directory} is incomplete: no {file}")
        size = os.path.getsize(file)
        if size < end:
            raise CheckpointError(f"checkpoint file {file} is truncated: {size} bytes, its metadata needs {end} "
                                  f"(for {key})")
    return metadata


def object_bytes(data) -> bytes:
    """The bytes of a megatron-core ShardedObject holding ``data``, as its torch_dist strategy stores them."""
    buffer = io.BytesIO()
    torch.save([data], buffer)
    return buffer.getvalue()


def read_object(directory: str, key: str, metadata=None):
    """The object stored under the DCP bytes entry ``key`` of ``directory`` (a megatron-core ShardedObject: the
    one-element list ``torch.save`` wrote); ``metadata``: its parsed ``.metadata`` when already read.
    CheckpointError naming the directory when it cannot be read."""
    import torch.distributed.checkpoint as dcp

    metadata = verify_dcp_files(directory) if metadata is None else metadata
    if key not in metadata.state_dict_metadata:
        raise CheckpointError(f"{directory}: checkpoint has no object {key}")
    state = {key: io.BytesIO()}
    try:
        dcp.load(state, storage_reader=_KnownMetadataReader(directory, metadata), no_dist=True)
        value = state[key]
        if isinstance(value, io.BytesIO):
            value.seek(0)
            value = torch.load(value, map_location="cpu", weights_only=False)
    except Exception as err:  # unpickling damaged bytes raises anything
        raise CheckpointError(f"{directory}: torch.distributed.checkpoint cannot read object {key}: "
                              f"{error_summary(err)}") from err
    return value


class _RegionLoadPlanner(LoadPlanner):
    """Reads ``regions`` (``[(key, offset, destination tensor)]``) from whatever chunks the checkpoint holds, and the
    serialized objects ``objects`` (keys) into ``self.loaded``."""

    def __init__(self, regions, objects=()):
        self.regions = {(key, tuple(offset)): dest for key, offset, dest in regions}
        self.objects, self.loaded = tuple(objects), {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items = []
        for (key, offset), dest in self.regions.items():
            stored = self.metadata.state_dict_metadata[key]
            chunk = ChunkStorageMetadata(offsets=torch.Size(offset), sizes=dest.shape)
            items += create_read_items_for_chunk_list(key, stored, [chunk])
        zero = torch.Size((0,))
        items += [ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key), dest_offsets=zero,
                           storage_index=MetadataIndex(key), storage_offsets=zero, lengths=zero)
                  for key in self.objects]
        return LoadPlan(items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        key = read_item.dest_index.fqn
        if key not in self.objects:
            raise CheckpointError(f"unexpected object read for {key}")
        self.loaded[key] = value.read()

    def resolve_tensor(self, read_item):
        dest = self.regions[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, start, length)
        return dest

    def commit_tensor(self, read_item, tensor) -> None:
        pass


class ChunkReader:
    """Regions of the tensors of a DCP checkpoint directory; ``tensors`` maps key -> (global shape, dtype),
    ``objects`` lists the keys of its serialized (non-tensor) objects."""

    def __init__(self, directory: str):
        self.directory = directory
        metadata = verify_dcp_files(directory)
        self._metadata = metadata
        self._reader = _KnownMetadataReader(directory, metadata)
        self.tensors = {key: (tuple(md.size), md.properties.dtype) for key, md in metadata.state_dict_metadata.items()
                        if isinstance(md, TensorStorageMetadata)}
        self.objects = [key for key, md in metadata.state_dict_metadata.items()
                        if isinstance(md, BytesStorageMetadata)]

    def chunks(self, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """``[(offset, size)]`` of the chunks tensor ``key`` was saved in (the writing run's sharding)."""
        return [(tuple(c.offsets), tuple(c.sizes)) for c in self._metadata.state_dict_metadata[key].chunks]

    def read_objects(self, keys: Sequence[str]) -> dict[str, bytes]:
        """The stored bytes of the serialized objects ``keys``."""
        import torch.distributed.checkpoint as dcp

        unknown = sorted(set(keys) - set(self.objects))
        if unknown:
            raise CheckpointError(f"{self.directory}: checkpoint has no object {unknown[0]}")
        planner = _RegionLoadPlanner((), keys)
        try:
            dcp.load({}, storage_reader=self._reader, planner=planner, no_dist=True)
        except CheckpointException as err:
            raise CheckpointError(f"{self.directory}: torch.distributed.checkpoint cannot read objects "
                                  f"{sorted(keys)[:3]}: {error_summary(err)}") from err
        return planner.loaded

    def read_into(self, regions: Sequence[tuple[str, Sequence[int], torch.Tensor]]) -> None:
        """``[(key, offset, destination)]``: fill each destination (any dtype; views allowed) with the stored
        region of its shape at ``offset``."""
        import torch.distributed.checkpoint as dcp

        for key, offset, dest in regions:
            if key not in self.tensors:
                raise CheckpointError(f"{self.directory}: checkpoint has no tensor {key}")
            shape = self.tensors[key][0]
            if len(offset) != len(shape) or any(o + s > g for o, s, g in zip(offset, dest.shape, shape)):
                raise CheckpointError(f"{self.directory}: tensor {key} has shape {shape}; region at {tuple(offset)} "
                                      f"of size {tuple(dest.shape)} lies outside it")
        try:
            dcp.load({}, storage_reader=self._reader, planner=_RegionLoadPlanner(regions), no_dist=True)
        except CheckpointException as err:  # damage the size check cannot see (bytes rewritten in place)
            raise CheckpointError(f"{self.directory}: torch.distributed.checkpoint cannot read "
                                  f"{sorted({k for k, _, _ in regions})[:3]}: {error_summary(err)}") from err


def error_summary(err: BaseException) -> str:
    """``"Type: first line of the message"`` of ``err`` (for DCP's CheckpointException: of the first rank's
    failure), for one-line errors."""
    if isinstance(err, CheckpointException) and err.failures:
        failure = next(iter(err.failures.values()))
        err = failure[0] if isinstance(failure, tuple) else failure
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"
