"""Paths the tests read: the repository, the example and Megatron-LM's training code (None when absent).

Megatron-LM's training code pairs with one megatron-core release. ``MEGATRON_LM`` is the checkout for the
installed megatron-core: ``MEGATRON_LM_PATH`` when set (it must match the installed version), else
``../shared/megatron-lm-0.19`` (tag core_v0.19.0) for megatron-core >= 0.19 and ``../shared/megatron-lm``
(tag core_v0.16.1) below. ``MEGATRON_LM_SERIES`` is the (major, minor) of the megatron-core that checkout pairs
with, so tests written against one Megatron-LM release can skip under another (``megatron_lm_skip``).
"""
from __future__ import annotations

import importlib.metadata
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "pretrain")
SHARED = os.path.join(os.path.dirname(REPO), "shared")


def _mcore_series() -> tuple[int, int]:
    """(major, minor) of the megatron-core first on sys.path (its dist-info: no import of megatron.core)."""
    major, minor = importlib.metadata.version("megatron-core").split(".")[:2]
    return int(major), int(minor)


MCORE_VERSION_SERIES = _mcore_series()


def _megatron_lm_path():
    default = "megatron-lm-0.19" if MCORE_VERSION_SERIES >= (0, 19) else "megatron-lm"
    path = os.environ.get("MEGATRON_LM_PATH") or os.path.join(SHARED, default)
    return path if os.path.isfile(os.path.join(path, "pretrain_gpt.py")) else None


MEGATRON_LM = _megatron_lm_path()  # the Megatron-LM checkout for the installed megatron-core (module docstring)
MEGATRON_LM_SERIES = MCORE_VERSION_SERIES if MEGATRON_LM else None  # the megatron-core series it pairs with


def megatron_lm_skip(series: tuple[int, int]) -> str | None:
    """Why a test driving Megatron-LM of ``series`` (e.g. ``(0, 16)``) cannot run here, or None when it can."""
    wanted = "%d.%d" % series
    if MEGATRON_LM is None:
        return ("Megatron-LM's training code not found: set MEGATRON_LM_PATH to a checkout of "
                "https://github.com/NVIDIA/Megatron-LM at the tag of the installed megatron-core "
                "(default ../shared/megatron-lm for 0.16, ../shared/megatron-lm-0.19 for 0.19)")
    if MEGATRON_LM_SERIES != series:
        return (f"drives Megatron-LM {wanted}'s training code; the installed megatron-core is "
                f"{'%d.%d' % MEGATRON_LM_SERIES} (its checkout: {MEGATRON_LM}); the version matrix runs it on "
                f"megatron-core {wanted} (tests/run_mcore_versions.sh, HP_MCORE_VERSIONS)")
    return None


def pythonpath(*first: str) -> str:
    """PYTHONPATH for a child process: ``first``, then this process's PYTHONPATH (which carries the megatron-core
    of tests/run_mcore_versions.sh's matrix, so children run the same version)."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in first]
    return os.pathsep.join([*first, *rest])
