"""Small stand-ins shared by single-process tests."""
from __future__ import annotations


class FakeGroup:
    """A process group that only answers ``size()`` and ``rank()``: enough for code that reads the CP size
    and rank from a group (megatron-core's and our ``get_batch_on_this_cp_rank``)."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank
