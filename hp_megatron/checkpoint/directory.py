"""Megatron-LM's checkpoint directory layout, read and written in one place.

A checkpoint root holds ``latest_checkpointed_iteration.txt`` (the tracker: an iteration number, or ``release``
for weights without training state) and one directory per saved iteration, ``iter_XXXXXXX`` (7 digits), or
``release``. The tracker is written last, so a root whose tracker exists holds a finished checkpoint.
:func:`verify_checkpoint_files` checks a ``dist_checkpointing`` (torch_dist) directory's files before a collective
load, so a missing or truncated shard is named instead of failing inside torch.distributed.checkpoint;
:func:`checkpoint_directory` is the directory holding a checkpoint's tensors, given a root or the directory itself.

An iteration directory keeps its common (non-tensor) state in ``common.pt`` (megatron-core 0.16) or inside the
DCP files as the object ``COMMON_OBJECT`` (0.19, which reads both).
"""
from __future__ import annotations

import os

from hp_megatron.checkpoint.errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
COMMON_FILE = "common.pt"
COMMON_OBJECT = "common_state/shard_0_1"  # DCP key of megatron-core 0.19's ShardedObject "common_state"


def iteration_directory(root: str, iteration: int | None) -> str:
    """``<root>/iter_XXXXXXX`` for an iteration, ``<root>/release`` for ``None``."""
    return os.path.join(root, RELEASE if iteration is None else f"iter_{iteration:07d}")


def write_tracker(root: str, iteration: int | None) -> None:
    """Point ``root``'s tracker to ``iteration`` (``None``: ``release``); call it after the directory is complete."""
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write(RELEASE if iteration is None else str(iteration))


def find_checkpoint(root: str) -> str | None:
    """The directory ``root``'s tracker names, or None when ``root`` has no tracker.

    ValueError for a tracker that holds neither an integer nor ``release``, or names a missing directory."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        return None
    with open(tracker) as f:
        text = f.read().strip()
    if text != RELEASE and not text.isdigit():
        raise ValueError(f"checkpoint tracker {tracker} holds {text!r}, not an iteration number")
    path = iteration_directory(root, None if text == RELEASE else int(text))
    if not os.path.isdir(path):
        what = "says 'release'" if text == RELEASE else f"names iteration {text}"
        raise ValueError(f"checkpoint tracker {tracker} {what}, but {path} does not exist")
    return path


def checkpoint_directory(path: str) -> str:
    """The directory holding the tensors: ``path`` itself, or the one its tracker file names; CheckpointError
    when that directory has no ``metadata.json`` (not a megatron-core dist checkpoint)."""
    path = find_checkpoint(path) or path
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise CheckpointError(f"{path}: no metadata.json; not a megatron-core dist checkpoint (nor a directory "
                              f"with {TRACKER})")
    return path


def verify_checkpoint_files(path: str) -> None:
    """Check that ``path``'s ``.metadata``, every shard it lists and the common state (``common.pt`` or
    ``COMMON_OBJECT``) are present and long enough (a ValueError naming the file otherwise); reads only the small
    ``.metadata`` file."""
    from hp_megatron.checkpoint.dcp_io import verify_dcp_files   # torch.distributed.checkpoint: only here

    common = os.path.join(path, COMMON_FILE)
    metadata = verify_dcp_files(path)
    if not os.path.isfile(common) and COMMON_OBJECT not in metadata.state_dict_metadata:
        raise ValueError(f"checkpoint {path} is incomplete: no {common} and no {COMMON_OBJECT} in its .metadata "
                         "(megatron-core keeps the common state in one of them)")
