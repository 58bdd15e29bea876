"""The delta-rule kinds are told apart only by their descriptors (layers/ops/kinds.py): no other module of layers/
compares a value with a kind name, so a new kind cannot silently take another kind's path; in hp_megatron/ the
issue's check (``kind == "gdn"`` / ``== "kda"``) holds (its mixer-name tables are the mixer registry's business)."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
DESCRIPTORS = "layers/ops/kinds.py"
NAME = r"""["'](?:gdn|kda)["']"""
# any comparison with a kind name: x == "gdn", "kda" != x, x in ("gdn", ...), x not in ["kda", ...]
LAYERS_PATTERN = re.compile(rf"[!=]=\s*{NAME}|{NAME}\s*[!=]=|\bin\s*[(\[{{]\s*{NAME}")
HP_MEGATRON_PATTERN = re.compile(rf"""\bkind\s*[!=]=\s*{NAME}|[!=]=\s*["']kda["']""")


def _offenders(package: str, pattern: re.Pattern) -> list[str]:
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line) and rel != DESCRIPTORS:
                out.append(f"{rel}:{number}: {line.strip()}")
    return out


def test_kind_names_are_compared_only_in_the_descriptor_module():
    offenders = _offenders("layers", LAYERS_PATTERN) + _offenders("hp_megatron", HP_MEGATRON_PATTERN)
    assert not offenders, ("read the kind's descriptor (layers.ops.kinds.delta_kind(...).<attribute>, or a table "
                           "keyed by descriptor found with DeltaKind.pick) instead of comparing names:\n"
                           + "\n".join(offenders))


def test_the_patterns_see_the_branches_they_forbid():
    for line in ('fn = a if kind == "gdn" else b', "if 'kda' != kind:", 'if kind not in ("gdn", "kda"):',
                 'x = k in ["kda"]'):
        assert LAYERS_PATTERN.search(line), line
    assert HP_MEGATRON_PATTERN.search('if shape.kind == "gdn":') and HP_MEGATRON_PATTERN.search('m == "kda"')
    for line in ('kind = "gdn"', 'delta_kind("kda")', 'API = {"gdn": {}}', 'mixer == "gdnx"'):
        assert not LAYERS_PATTERN.search(line), line
