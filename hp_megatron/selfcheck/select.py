"""``--only``: which rows to run, by case-insensitive substrings of "<op> <case>" (any one matches)."""
from __future__ import annotations


def selector(patterns):
    """``wanted(op, case) -> bool`` for a list of substrings (empty or None: everything)."""
    needles = [p.strip().lower() for p in (patterns or ()) if p.strip()]

    def wanted(op: str, case: str) -> bool:
        text = f"{op} {case}".lower()
        return not needles or any(n in text for n in needles)
    return wanted
