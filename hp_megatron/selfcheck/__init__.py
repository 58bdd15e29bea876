"""Self-check of a kernel backend on the user's hardware: ``python -m hp_megatron.selfcheck --backend ascendc``
(Ascend NPU, fla-npu) or ``--backend triton`` (NVIDIA GPU, flash-linear-attention); ``eager`` is accepted as a
trivial baseline.

It runs every op of the backend at small shapes against the eager backend on the same device: GDN and KDA forward
and backward, dense and packed (``cu_seqlens``), with and without the in-kernel gates; the short conv (dense, and
packed with history and bias); the decode steps; and the CP paths on 2 spawned ranks (each CP method the backend
has, BSHD and packed THD layouts, and the conv halo). It prints one table (op, case, phase, dtype, largest relative
L2 error and its tensor, tolerance, result) and the installed versions against ``layers/ops/requirements.py``, and
exits 0 only when every row passes (rows the backend cannot run on this device are "n/a" with the reason) and every
requirement is met; 1 otherwise, 2 for bad arguments.

Modules: ``cli`` (arguments, run, exit status), ``problems`` (cases and inputs), ``single`` (single-process rows),
``cp`` (rows on each CP rank), ``spawn`` (the 2 ranks), ``limits`` (what the backend cannot run here), ``device``
(device and CP communication), ``gloo`` (gloo patches), ``report`` (rows, tolerances, tables), ``select`` (``--only``).
"""
from hp_megatron.selfcheck.cli import main

__all__ = ["main"]
