"""One log line per CP method a layer shape was built with: which method, and what decided it.

A mixer calls :func:`log_cp_choice` at construction when its CP group has more than one rank. Layers of one
mixer, shape, method and source share a line (a 48-layer model logs one), printed on global rank 0 and kept in
:data:`CP_CHOICE_LOG`::

    [hp_megatron cp] GDN H=4 HV=4 K=8 V=8 P=2: ulysses (cp_comm_type 'a2a')
    [hp_megatron cp] MLA heads=4 r=16 P=2: latent (config.mla_cp_strategy)

``auto`` logs ``auto`` here and its decision per micro-batch shape at the first forward (``layers.cp.auto``).
"""
from __future__ import annotations

import torch.distributed as dist

CP_CHOICE_LOG: list = []   # the lines logged by this process, in order
_LOGGED: set = set()


def log_cp_choice(owner: str, shape: str, cp_size: int, method: str, source: str) -> None:
    """Log ``owner``'s (``"GDN"``) CP ``method`` for its layer ``shape`` on ``cp_size`` ranks and the ``source``
    that chose it (``"ModuleSpec.params cp_method"``, ``"config.delta_cp_method"``, ``"cp_comm_type 'a2a'"``,
    ``"default"``), once per distinct line."""
    line = f"[hp_megatron cp] {owner} {shape} P={cp_size}: {method} ({source})"
    if line in _LOGGED:
        return
    _LOGGED.add(line)
    CP_CHOICE_LOG.append(line)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, flush=True)
