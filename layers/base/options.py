"""One row of the flag table: a parameter's command-line flag, config field, mixer keyword, type and checks.

A leaf module (no imports of ``layers`` or ``hp_megatron``): a mixer declares its rows beside its options
(``layers.mixers.*``), ``hp_megatron`` assembles the table from them and its own rows and derives the argparse
groups, the config fields and their checks from it (``hp_megatron.mixers.registry``, ``hp_megatron.arguments``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

CHECKS = ("positive", "non_negative", "negative")


@dataclass(frozen=True)
class OptionRow:
    """``flag`` (``--hp-...``; its argparse dest is the flag without dashes) sets config ``field``, which the mixer
    reads as its ``keyword`` (``ModuleSpec.params``) when that is not given. ``type``: int, float, str or bool (a bool
    flag is ``store_true``); ``model``: the value defines the model's tensors or forward (stored in checkpoints);
    ``default``: the flag's and the field's default; ``choices``: the accepted values; ``check``: one of
    :data:`CHECKS` for numbers; ``optional``: the field may be None (not set)."""

    flag: str
    field: str
    keyword: Optional[str] = None
    type: type = str
    model: bool = False
    default: object = None
    help: str = ""
    choices: Optional[tuple] = None
    check: Optional[str] = None
    optional: bool = True

    def __post_init__(self):
        if not self.flag.startswith("--"):
            raise ValueError(f"OptionRow.flag must start with '--', got {self.flag!r}")
        if self.type not in (int, float, str, bool):
            raise ValueError(f"OptionRow {self.flag}: type must be int, float, str or bool, got {self.type!r}")
        if self.check is not None and self.check not in CHECKS:
            raise ValueError(f"OptionRow {self.flag}: check must be one of {CHECKS} or None, got {self.check!r}")

    @property
    def dest(self) -> str:
        """The argparse attribute of the flag (``--hp-toy-decay`` -> ``hp_toy_decay``)."""
        return self.flag[2:].replace("-", "_")

    def problem(self, value) -> Optional[str]:
        """Why ``value`` is not accepted for this row (None when it is): type, choices, check."""
        if value is None:
            return None if self.optional else "must be set"
        if self.type is bool:
            return None if isinstance(value, bool) else "must be a bool"
        if self.type is int and (isinstance(value, bool) or not isinstance(value, int)):
            return "must be an int"
        if self.type is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return "must be a number"
        if self.type is str and not isinstance(value, str):
            return "must be a string"
        if self.choices is not None and value not in self.choices:
            return f"must be one of {self.choices}"
        if self.check == "positive" and value <= 0:
            return "must be positive"
        if self.check == "non_negative" and value < 0:
            return "must be >= 0"
        if self.check == "negative" and value >= 0:
            return "must be negative"
        return None
