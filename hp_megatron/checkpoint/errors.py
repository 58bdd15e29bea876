"""The one error of checkpoint files, Megatron's and Hugging Face's alike."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, written or converted: the message names the file and the tensor."""
