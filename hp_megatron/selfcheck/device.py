"""The device the self-check runs on, and how its CP ranks communicate.

``auto``: ascendc -> ``npu``; triton -> ``cuda`` when a CUDA GPU is visible, else ``cpu`` (FLA's kernels then need
Triton's interpreter, ``TRITON_INTERPRET=1``); eager -> ``cuda``, ``npu`` or ``cpu``, the first present.
CP ranks: rank r uses accelerator ``r % count``. With two or more accelerators they talk over NCCL (CUDA) or HCCL
(NPU). On one accelerator both ranks share it and use gloo with the device tensors staged through host memory
(``hp_megatron/selfcheck/gloo.py``; NCCL and HCCL refuse two ranks on one device), which checks the CP math on the
device's kernels but not the device's collectives. On CPU: gloo.
"""
from __future__ import annotations

import importlib

import torch

DEVICE_TYPES = ("auto", "cpu", "cuda", "npu")
DEVICE_COMM = {"cuda": "nccl", "npu": "hccl"}


def _npu_available() -> bool:
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    return bool(torch.npu.is_available())


def resolve(backend: str, requested: str) -> torch.device:
    """The device (index 0) to run on; RuntimeError naming what is missing for an explicit cuda / npu."""
    if requested == "auto":
        if backend == "ascendc":
            requested = "npu"
        elif torch.cuda.is_available():
            requested = "cuda"
        elif backend == "eager" and _npu_available():
            requested = "npu"
        else:
            requested = "cpu"
    if requested == "npu" and not _npu_available():
        raise RuntimeError("device 'npu' needs torch_npu and a visible Ascend NPU (torch_npu is not importable or "
                           "torch.npu.is_available() is False; source CANN's set_env.sh first)")
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' needs a visible CUDA GPU (torch.cuda.is_available() is False)")
    return torch.device(requested, 0) if requested != "cpu" else torch.device("cpu")


def accelerator_count(device_type: str) -> int:
    if device_type == "cuda":
        return torch.cuda.device_count()
    if device_type == "npu":
        importlib.import_module("torch_npu")
        return torch.npu.device_count()
    return 0


def comm_backend(device_type: str, count: int) -> str:
    """gloo on CPU and on a single accelerator (staged), else NCCL / HCCL."""
    return DEVICE_COMM[device_type] if device_type in DEVICE_COMM and count >= 2 else "gloo"


def rank_device(device_type: str, rank: int, count: int) -> torch.device:
    """This rank's device (made current for CUDA / NPU)."""
    if device_type == "cpu":
        return torch.device("cpu")
    if device_type == "npu":
        importlib.import_module("torch_npu")
    device = torch.device(device_type, rank % max(count, 1))
    getattr(torch, device_type).set_device(device)
    return device


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "npu":
        return f"{device} ({torch.npu.get_device_name(device.index or 0)})"
    return "cpu"
