"""Runs of the eager backend without flash-linear-attention (test infrastructure; ~2.5 CPU s per rank).

Megatron-LM's ``pretrain_gpt.py`` imports megatron-core's ``gated_delta_net`` (through ``gpt_builders``), whose
``try: from fla ... except ImportError: HAVE_FLA = False`` imports FLA and with it its Triton kernels' modules,
which no eager run calls. With ``HP_MEGATRON_LM_WITHOUT_FLA=1`` (set by tests/support/megatron_lm_runs.py for
``BACKEND=eager``), :func:`install` makes ``import fla`` raise ``ModuleNotFoundError`` (``sys.modules["fla"] =
None``, as if it were not installed), so megatron-core takes its documented path without FLA; a run that
still reaches FLA (the triton backend) fails naming it instead of silently differing.
"""
from __future__ import annotations

import os
import sys

ENV = "HP_MEGATRON_LM_WITHOUT_FLA"


def install() -> None:
    """Block ``import fla`` in this process when ``HP_MEGATRON_LM_WITHOUT_FLA=1``."""
    if os.environ.get(ENV) == "1" and "fla" not in sys.modules:
        sys.modules["fla"] = None
