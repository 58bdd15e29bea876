"""One row of the flag table: a parameter's command-line flag, config field, mixer keyword, type and checks.

A leaf module (it imports only ``layers.base.choices``): a mixer declares its rows beside its options
(``layers.mixers.*``), ``hp_megatron`` assembles the table from them and its own rows and derives the argparse
groups, the config fields and their checks from it (``hp_megatron.registry.entries``, ``hp_megatron.arguments``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from layers.base.choices import CP_LAYOUTS

CHECKS = ("positive", "non_negative", "negative")
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")   # megatron-core's cp_comm_type values (--cp-comm-type)


@dataclass(frozen=True)
class CommTypeRule:
    """How a mixer's CP method follows megatron's ``cp_comm_type`` (``--cp-comm-type``) when nothing of ours sets it.

    One precedence for every mixer: its keyword (``ModuleSpec.params``) or our config field / ``--hp-*`` flag, then
    a ``cp_comm_type`` the user chose, mapped by ``methods`` (``((cp_comm_type, method), ...)``, one pair per value
    of :data:`CP_COMM_TYPES`), then ``default``. ``hierarchical_degree``: the keyword that ``a2a+p2p`` sets to the
    first of ``hierarchical_context_parallel_sizes`` (the Ulysses degree of a hybrid method), None when the mixer
    has no such keyword. Megatron-LM's argparse default ``['p2p']`` is not a choice: the ``--hp-*`` flags' path tells
    the two apart (``hp_megatron.cp_choice``); a config's ``cp_comm_type`` (megatron-core's default is None) is one.
    """

    methods: tuple
    default: str
    hierarchical_degree: Optional[str] = None

    def __post_init__(self):
        if sorted(k for k, _ in self.methods) != sorted(CP_COMM_TYPES):
            raise ValueError(f"CommTypeRule.methods must map each of {CP_COMM_TYPES}, got {self.methods!r}")

    def method_of(self, cp_comm_type: str, owner: str = "cp_comm_type") -> str:
        """The method of one ``cp_comm_type`` value; ValueError naming the accepted ones."""
        for value, method in self.methods:
            if value == cp_comm_type:
                return method
        raise ValueError(f"{owner}: cp_comm_type must be one of {sorted(CP_COMM_TYPES)}, got {cp_comm_type!r}")

    def resolve(self, given, cp_comm_type, owner: str) -> tuple:
        """``(method, source)``: ``given`` (the keyword or config field; None: not set), else the method of
        ``cp_comm_type`` (one layer's value; None: not chosen), else :attr:`default`; ``source`` says which."""
        if given is not None:
            return given, "set"
        if cp_comm_type is not None:
            return self.method_of(cp_comm_type, owner), f"cp_comm_type {cp_comm_type!r}"
        return self.default, "default"


@dataclass(frozen=True)
class OptionRow:
    """``flag`` (``--hp-...``; its argparse dest is the flag without dashes; None: a config field without a flag) sets
    config ``field`` (None: a flag without a config field), which the mixer reads as its ``keyword``
    (``ModuleSpec.params``) when that is not given. ``type``: int, float, str or bool (a bool flag is
    ``store_true``); ``model``: the value defines the model's tensors or forward (stored in the example's
    checkpoints); ``default``: the flag's default; ``help``: its help text; ``choices``: the accepted values;
    ``check``: one of :data:`CHECKS` for numbers; ``optional``: the config field may be None (not set);
    ``preset``: ``--hp-hf-config``'s architecture sets it (a flag given beside it must agree); ``megatron_field``:
    ``field`` is megatron-core's own config field (``TransformerConfig`` / ``MLATransformerConfig``, e.g. the
    ``linear_*`` shapes of its GDN), which the row sets and the mixer reads as megatron-core defines it (registration
    refuses a megatron-core field without this declaration: it would overwrite megatron's value silently).
    A bool row with ``default=True`` gets a ``--no-...`` form (``argparse.BooleanOptionalAction``), as Megatron-LM's
    on-by-default switches have. ``comm_type``: a :class:`CommTypeRule` when megatron's ``--cp-comm-type`` decides
    the field where the flag is not given (the row's ``default`` is then None, "not given")."""

    flag: Optional[str]
    field: Optional[str]
    keyword: Optional[str] = None
    type: type = str
    model: bool = False
    default: object = None
    help: str = ""
    choices: Optional[tuple] = None
    check: Optional[str] = None
    optional: bool = True
    preset: bool = False
    megatron_field: bool = False
    comm_type: Optional[CommTypeRule] = None

    def __post_init__(self):
        if self.flag is None and self.field is None:
            raise ValueError("OptionRow needs a flag, a config field or both")
        if self.flag is not None and not self.flag.startswith("--"):
            raise ValueError(f"OptionRow.flag must start with '--', got {self.flag!r}")
        if self.type not in (int, float, str, bool):
            raise ValueError(f"OptionRow {self.flag}: type must be int, float, str or bool, got {self.type!r}")
        if self.check is not None and self.check not in CHECKS:
            raise ValueError(f"OptionRow {self.flag}: check must be one of {CHECKS} or None, got {self.check!r}")
        if self.check is not None and self.type not in (int, float):
            raise ValueError(f"OptionRow {self.flag}: check {self.check!r} is for int or float rows, got type "
                             f"{self.type.__name__}")
        if self.type is bool and self.default not in (None, False, True):
            raise ValueError(f"OptionRow {self.flag}: a bool row's default must be True, False or None, got "
                             f"{self.default!r}")
        if self.comm_type is not None and self.default is not None:
            raise ValueError(f"OptionRow {self.flag}: a row that --cp-comm-type decides has default None (not given), "
                             f"got {self.default!r}; its CommTypeRule holds the mixer's default")

    @property
    def dest(self) -> str:
        """The argparse attribute of the flag (``--hp-toy-decay`` -> ``hp_toy_decay``); None without a flag."""
        return None if self.flag is None else self.flag[2:].replace("-", "_")

    def problem(self, value) -> Optional[str]:
        """Why ``value`` is not accepted for this row (None when it is): type, choices, check; the text reads after
        the field's name (``"must be a positive int or None"``)."""
        if value is None:
            return None if self.optional else f"must be {self.expected()}"
        wrong_type = {bool: not isinstance(value, bool),
                      int: isinstance(value, bool) or not isinstance(value, int),
                      float: isinstance(value, bool) or not isinstance(value, (int, float)),
                      str: not isinstance(value, str)}[self.type]
        bad_value = self.choices is not None and value not in self.choices
        if not wrong_type and not bad_value and self.check is not None:
            bad_value = {"positive": value <= 0, "non_negative": value < 0, "negative": value >= 0}[self.check]
        if wrong_type or bad_value:
            return f"must be {self.expected()}{' or None' if self.optional else ''}"
        return None

    def expected(self) -> str:
        """What the row accepts, in words: ``"a positive int"``, ``"a number >= 0"``, ``"a negative number"``,
        ``"one of ('a', 'b')"``, ``"a bool"``, ``"a string"`` (an int is also "a number": a float row takes it)."""
        if self.choices is not None:
            return f"one of {self.choices}"
        if self.type is bool:
            return "a bool"
        if self.type is str:
            return "a string"
        number = "int" if self.type is int else "number"
        return {None: f"an {number}" if number == "int" else "a number", "positive": f"a positive {number}",
                "non_negative": f"{'an int' if number == 'int' else 'a number'} >= 0",
                "negative": f"a negative {number}"}[self.check]


def keyword_attrs(rows, keyword: str) -> tuple:
    """The config fields a mixer reads its ``keyword`` option from: those of the rows declaring that keyword."""
    return tuple(r.field for r in rows if r.keyword == keyword and r.field is not None)


# the rows every mixer shares: the token layout over CP ranks and the calibration cache of the CP method "auto"
CP_LAYOUT_ROW = OptionRow("--hp-cp-layout", "hp_cp_layout", "cp_layout", str, default="zigzag", choices=CP_LAYOUTS,
                          optional=False, help="token layout over CP ranks: zigzag (Megatron's load-balanced split) or "
                                               "contiguous (not with layers that use the model's RoPE, e.g. A)")
CP_CALIBRATION_ROW = OptionRow(
    "--hp-cp-calibration", "hp_cp_calibration", "cp_calibration", str,
    help="with --hp-cp-method auto or --hp-mla-cp-strategy auto (an error without): JSON file caching the CP group's "
         "calibration (keyed by world layout and hardware); reused when it holds this layout, else measured and saved "
         "there")
SHARED_ROWS = (CP_LAYOUT_ROW, CP_CALIBRATION_ROW)
