"""Paths the tests read: the repository, the example and Megatron-LM's training code (None when absent)."""
from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "pretrain")


def _megatron_lm_path():
    path = os.environ.get("MEGATRON_LM_PATH") or os.path.join(os.path.dirname(REPO), "shared", "megatron-lm")
    return path if os.path.isfile(os.path.join(path, "pretrain_gpt.py")) else None


MEGATRON_LM = _megatron_lm_path()  # a Megatron-LM checkout (MEGATRON_LM_PATH, default ../shared/megatron-lm)
