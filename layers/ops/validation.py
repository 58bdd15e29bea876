"""Input checks shared by the public ops: every violation names the constraint and the values."""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_tensor(name: str, x, ndim: int | None = None, dtypes=FLOAT_DTYPES) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        raise TypeError(f"{name} must have a floating dtype in {[str(d) for d in dtypes]}, got {x.dtype}")


def check_shape(name: str, x: torch.Tensor, expected: tuple) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(x.shape)}")


def check_same_device(**tensors) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def as_cu_seqlens(cu_seqlens) -> torch.Tensor:
    """Packed document boundaries as a CPU int64 tensor (one host copy); TypeError/ValueError unless they are
    1-D integers starting at 0 and strictly increasing (every document non-empty)."""
    if isinstance(cu_seqlens, (list, tuple)):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in cu_seqlens):
            raise TypeError(f"cu_seqlens must hold integers, got {cu_seqlens!r}")
        cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int64)
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a tensor or a list of ints, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(cu[0])}")
    if bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must be strictly increasing (no empty documents), got {cu.tolist()}")
    return cu


def normalize_cu_seqlens(cu_seqlens, batch: int, total: int) -> torch.Tensor | None:
    """``as_cu_seqlens`` for a [batch, total, ...] op input: also batch == 1 and the last entry == total."""
    if cu_seqlens is None:
        return None
    cu = as_cu_seqlens(cu_seqlens)
    if batch != 1:
        raise ValueError(f"packed input (cu_seqlens given) requires batch size 1, got B={batch}")
    if int(cu[-1]) != total:
        raise ValueError(f"cu_seqlens must end at the sequence length T={total}, got {int(cu[-1])}")
    return cu


def check_state(name: str, state, expected: tuple) -> None:
    if state is None:
        return
    check_tensor(name, state)
    check_shape(name, state, expected)
