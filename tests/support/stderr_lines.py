"""What a launched command printed on stderr, less the lines torch's own logger prints at import.

A CUDA build of torch on a machine without a CUDA runtime (Python 3.12's part of .ci/run installs one from PyPI)
logs ``W1205 00:03:05.753000 13345 torch/utils/cpp_extension.py:183] No CUDA runtime is found, ...`` when
``torch.utils.cpp_extension`` is imported: torch's line, not ours, so tests asserting that our refusal is one line
drop lines in torch's log format (``[IWE]MMDD hh:mm:ss.micro pid path:line]``) and keep every other line.
"""
from __future__ import annotations

import re

_TORCH_LOG_LINE = re.compile(r"^[IWE]\d{4} \d{2}:\d{2}:\d{2}\.\d+ +\d+ \S+:\d+\] ")


def own_stderr_lines(stderr: str) -> list[str]:
    """Non-empty stderr lines that are not torch's import-time log lines (module docstring)."""
    return [line for line in stderr.strip().splitlines() if line.strip() and not _TORCH_LOG_LINE.match(line)]
