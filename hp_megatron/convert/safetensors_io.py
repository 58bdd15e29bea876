"""Hugging Face weight directories, read and written one tensor at a time.

Reading: :class:`HFCheckpoint` parses ``config.json`` (:func:`load_hf_config`), ``model.safetensors.index.json`` (or
a single ``model.safetensors``) and every shard's header up front, so a missing shard, a bad header or a truncated
file is reported (file and tensor named) before anything is converted. Tensors are then read one by one: the
header's offsets locate the bytes, which are read straight into a new tensor. (``safetensors.safe_open`` was
measured first: its tensors are views of a memory-mapped shard, whose touched pages stayed in the resident set
(file-backed RSS grew by 160 MB over a 1.2 GB conversion); plain reads keep only the tensors in use.)

Writing: :class:`ShardedSafetensorsWriter` takes the names, dtypes and shapes of all tensors first, splits them
into shards of at most ``max_shard_bytes``, writes each shard's header, and then accepts the tensors in any order,
writing each at its final offset. The index (``model.safetensors.index.json``) is written last.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Sequence

import torch

from hp_megatron.checkpoint.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"

# safetensors dtype names (the format's header strings) <-> torch dtypes
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in a safetensors shard and what it holds."""

    file: str  # shard file name, relative to the directory
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int = 0  # absolute byte offset of the data in the file

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_safetensors_header(path: str) -> dict[str, TensorInfo]:
    """Tensor infos of one safetensors file; raises :class:`CheckpointError` for a bad header, an unknown dtype
    or a tensor whose bytes lie past the end of the file (a truncated shard)."""
    name = os.path.basename(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated shard: {size} bytes, no safetensors header")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise CheckpointError(f"{path}: truncated shard: header of {header_len} bytes, file has {size}")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as err:
            raise CheckpointError(f"{path}: unreadable safetensors header ({err})") from err
    header.pop("__metadata__", None)
    data_bytes = size - 8 - header_len
    infos = {}
    for key, entry in header.items():
        if entry.get("dtype") not in DTYPES:
            raise CheckpointError(f"{path}: tensor {key} has dtype {entry.get('dtype')!r}, not one of {sorted(DTYPES)}")
        begin, end = entry["data_offsets"]
        if end > data_bytes:
            raise CheckpointError(f"{path}: truncated shard: tensor {key} ends at data byte {end}, the file holds "
                                  f"{data_bytes} data bytes")
        info = TensorInfo(name, DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + header_len + begin)
        if end - begin != info.nbytes:
            raise CheckpointError(f"{path}: tensor {key} spans {end - begin} bytes, its dtype and shape "
                                  f"{info.dtype} {info.shape} need {info.nbytes}")
        infos[key] = info
    return infos


def load_hf_config(path_or_dict) -> dict:
    """A Hugging Face config as a dict: a dict as is, a ``config.json`` file, or a directory holding one (the one
    reader of config.json files); CheckpointError naming the file when it is missing or not JSON."""
    if isinstance(path_or_dict, dict):
        return path_or_dict
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing; a Hugging Face directory needs its config.json")
    with open(path) as f:
        try:
            config = json.load(f)
        except ValueError as err:
            raise CheckpointError(f"{path}: not a JSON config ({err})") from err
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: not a JSON object of config fields")
    return config


class HFCheckpoint:
    """A Hugging Face directory: ``config`` (dict), ``tensors`` (key -> :class:`TensorInfo`), ``read(key)``."""

    def __init__(self, directory: str):
        self.directory = directory
        if not os.path.isdir(directory):
            raise CheckpointError(f"{directory}: not a directory")
        self.config = load_hf_config(directory)
        self.tensors = self._scan()

    def _scan(self) -> dict[str, TensorInfo]:
        index_path = os.path.join(self.directory, INDEX_NAME)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index_path}: no 'weight_map' of tensor -> shard file")
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(os.path.join(self.directory, SINGLE_NAME)):
            weight_map, files = None, [SINGLE_NAME]
        else:
            raise CheckpointError(f"{self.directory}: neither {INDEX_NAME} nor {SINGLE_NAME} found")
        tensors = {}
        for file in files:
            path = os.path.join(self.directory, file)
            if not os.path.isfile(path):
                missing = sorted(k for k, v in weight_map.items() if v == file)
                raise CheckpointError(f"{path}: shard listed in {INDEX_NAME} is missing (holds {missing[:3]}...)")
            tensors.update(read_safetensors_header(path))
        if weight_map is not None:
            for key, file in weight_map.items():
                info = tensors.get(key)
                if info is None or info.file != file:
                    raise CheckpointError(f"{os.path.join(self.directory, file)}: tensor {key} listed in "
                                          f"{INDEX_NAME} is not in this shard")
        return tensors

    def path(self, key: str) -> str:
        return os.path.join(self.directory, self.tensors[key].file)

    def read(self, key: str) -> torch.Tensor:
        """The tensor ``key``: its bytes only, read from its shard straight into a new tensor."""
        if key not in self.tensors:
            raise CheckpointError(f"{self.directory}: tensor {key} is in no shard")
        info = self.tensors[key]
        out = torch.empty(info.shape, dtype=info.dtype)
        with open(self.path(key), "rb", buffering=0) as f:
            f.seek(info.offset)
            view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
            done = 0
            while done < info.nbytes:
                n = f.readinto(view[done:])
                if not n:
                    raise CheckpointError(f"{self.path(key)}: truncated shard: tensor {key} ends early")
                done += n
        return out


def shard_file_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def parse_size(text: str | int) -> int:
    """``"5GB"`` / ``"500MB"`` / ``"1.5GiB"`` / an int -> bytes."""
    if isinstance(text, int):
        return text
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "TB": 10**12, "B": 1}
    upper = text.strip().upper()
    for unit, factor in units.items():
        if upper.endswith(unit):
            try:
                return int(float(upper[: -len(unit)]) * factor)
            except ValueError:
                break
    try:
        return int(upper)
    except ValueError:
        raise ValueError(f"size must be a byte count or a number with KB/MB/GB/KiB/MiB/GiB, got {text!r}") from None


class ShardedSafetensorsWriter:
    """Writes the tensors named in ``specs`` (``[(key, dtype, shape), ...]``, in shard order) into
    ``directory`` as safetensors shards of at most ``max_shard_bytes`` (a larger tensor gets a shard of its own)
    plus the index. Call :meth:`write` once per key, in any order, then :meth:`close`."""

    def __init__(self, directory: str, specs: Sequence[tuple[str, torch.dtype, Sequence[int]]],
                 max_shard_bytes: int):
        self.directory = directory
        shards: list[list[tuple[str, torch.dtype, tuple]]] = [[]]
        size = 0
        for key, dtype, shape in specs:
            if dtype not in DTYPE_NAMES:
                raise ValueError(f"tensor {key}: dtype {dtype} cannot be stored in safetensors")
            nbytes = math.prod(shape) * dtype.itemsize
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((key, dtype, tuple(shape)))
            size += nbytes
        self._where: dict[str, tuple[str, int, int]] = {}  # key -> (file, absolute offset, nbytes)
        self.weight_map, self.total_size = {}, 0
        for index, shard in enumerate(shards):
            file = shard_file_name(index, len(shards))
            self._write_header(file, shard)
        self._pending = set(self._where)

    def _write_header(self, file: str, shard) -> None:
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for key, dtype, shape in shard:
            nbytes = math.prod(shape) * dtype.itemsize
            header[key] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
        data_start = 8 + len(raw)
        with open(os.path.join(self.directory, file), "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(data_start + offset)
        for key, dtype, shape in shard:
            begin = header[key]["data_offsets"][0]
            self._where[key] = (file, data_start + begin, math.prod(shape) * dtype.itemsize)
            self.weight_map[key] = file
        self.total_size += offset

    def write(self, key: str, tensor: torch.Tensor) -> None:
        if key not in self._where:
            raise KeyError(f"tensor {key} was not announced to the writer")
        if key not in self._pending:
            raise ValueError(f"tensor {key} was written twice")
        file, offset, nbytes = self._where[key]
        data = tensor.detach().cpu().contiguous()
        if data.nbytes != nbytes:
            raise ValueError(f"tensor {key}: {data.nbytes} bytes ({data.dtype} {tuple(data.shape)}), "
                             f"announced {nbytes}")
        with open(os.path.join(self.directory, file), "r+b") as f:
            f.seek(offset)
            f.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
        self._pending.discard(key)

    def close(self) -> None:
        if self._pending:
            raise ValueError(f"tensors never written: {sorted(self._pending)[:5]}")
        index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(self.weight_map.items()))}
        with open(os.path.join(self.directory, INDEX_NAME), "w") as f:
            json.dump(index, f, indent=2)

