"""hp_megatron.platform: the CPU mode flushes denormal floats (the eager kernels' slow path on x86)."""
from __future__ import annotations

import subprocess
import sys


def test_cpu_shims_flush_denormals():
    code = ("import torch\n"
            "from hp_megatron.platform import apply_cpu_shims\n"
            "tiny = torch.tensor([1e-20]) * torch.tensor([1e-20])\n"   # 1e-40: a float32 denormal
            "assert tiny.item() != 0.0, tiny\n"
            "assert apply_cpu_shims(0)\n"
            "flushed = torch.tensor([1e-20]) * torch.tensor([1e-20])\n"
            "assert flushed.item() == 0.0, flushed\n"
            "assert (torch.tensor([1e-18]) * torch.tensor([1e-18])).item() > 0\n")   # 1e-36 stays normal
    subprocess.run([sys.executable, "-c", code], check=True)
