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


def torch_distributed_answers_fake_groups(monkeypatch) -> None:
    """For the duration of the test, torch.distributed says it is initialized and ``get_world_size`` / ``get_rank``
    answer for a :class:`FakeGroup`: megatron-core's ``get_batch_on_this_cp_rank`` asks the group only when
    torch.distributed is initialized (0.16), or asks torch.distributed (0.19)."""
    import torch.distributed as dist

    size, rank = dist.get_world_size, dist.get_rank
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size",
                        lambda group=None: group.size() if isinstance(group, FakeGroup) else size(group))
    monkeypatch.setattr(dist, "get_rank",
                        lambda group=None: group.rank() if isinstance(group, FakeGroup) else rank(group))


# transformers binds flash-linear-attention's kernels in place of these pure-PyTorch functions when FLA imports.
_FLA_BOUND_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
                        "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")


def use_transformers_torch_path(module):
    """Reset a transformers modeling ``module`` (Qwen3-Next, Kimi-Linear) to its own pure-PyTorch GDN/KDA functions
    and return it: where FLA is installed transformers calls FLA's Triton kernels instead, which cannot run on
    CPU and would not be an independent reference. Idempotent."""
    for name in _FLA_BOUND_FUNCTIONS:
        fn = getattr(module, name, None)
        if fn is not None and hasattr(fn, "__wrapped__"):
            setattr(module, name, fn.__wrapped__)
    return module

