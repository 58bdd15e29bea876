"""Megatron-LM 0.19's training code on Python 3.11 (test infrastructure).

Megatron-LM 0.19 (``megatron/training/models/gpt.py``, ``hybrid.py``) imports ``typing.override``, new in Python
3.12 (megatron-core 0.17+ declares ``Requires-Python >=3.12``: its users run 3.12 or later). This machine has 3.11;
:func:`install` sets ``typing.override`` to ``typing_extensions.override``, the same decorator (it marks the method
and returns it), where ``typing`` lacks it. Nothing else of 3.12 is needed by the paths the tests run.
"""
from __future__ import annotations

import typing


def install() -> None:
    """Provide ``typing.override`` on Python < 3.12."""
    if not hasattr(typing, "override"):
        from typing_extensions import override

        typing.override = override
