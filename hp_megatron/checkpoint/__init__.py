"""Megatron checkpoints on disk, the one place that knows their files (read by the converter, generation and the
example, none of which this package imports).

``directory.py``: Megatron-LM's layout (tracker file, ``iter_XXXXXXX`` / ``release``; ``find_checkpoint``,
``checkpoint_directory``, ``verify_checkpoint_files``); ``dcp_io.py``: torch.distributed.checkpoint files written
lazily and read by region (damaged files named); ``common_state.py``: the common state where the installed
megatron-core keeps it; ``errors.py``: ``CheckpointError`` (a ValueError naming the file), which the HF side of the
converter raises too.
"""
from hp_megatron.checkpoint.directory import (COMMON_FILE, COMMON_OBJECT, RELEASE, TRACKER, checkpoint_directory,
                                              find_checkpoint, iteration_directory, verify_checkpoint_files,
                                              write_tracker)
from hp_megatron.checkpoint.errors import CheckpointError

__all__ = ["COMMON_FILE", "COMMON_OBJECT", "RELEASE", "TRACKER", "CheckpointError", "checkpoint_directory",
           "find_checkpoint", "iteration_directory", "read_common_state", "verify_checkpoint_files",
           "with_common_state", "write_tracker"]


def __getattr__(name):
    """``read_common_state`` / ``with_common_state`` import torch and megatron-core's checkpoint format on first use
    (the directory layout alone needs neither)."""
    if name in ("read_common_state", "with_common_state"):
        from hp_megatron.checkpoint import common_state

        return getattr(common_state, name)
    raise AttributeError(f"module 'hp_megatron.checkpoint' has no attribute {name!r}")
