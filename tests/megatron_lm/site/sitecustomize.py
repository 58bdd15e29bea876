"""Start-up hook of Python processes run with this folder on PYTHONPATH: the CPU/gloo mode of Megatron-LM's
training loop (tests/megatron_lm/cpu_mode.py) and, with HP_MEGATRON_LM_RECORD_DIR set, the per-iteration
recorder (tests/megatron_lm/record.py), both armed before anything imports ``megatron.training``; with
HP_MEGATRON_LM_WITHOUT_FLA=1, ``import fla`` fails as if FLA were not installed (tests/megatron_lm/without_fla.py);
on Python 3.11, ``typing.override`` for Megatron-LM 0.19 (tests/megatron_lm/typing_override.py)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cpu_mode  # noqa: E402
import record  # noqa: E402
import typing_override  # noqa: E402
import without_fla  # noqa: E402

cpu_mode.install()
record.install()
without_fla.install()
typing_override.install()
