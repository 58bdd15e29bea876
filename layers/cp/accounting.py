"""Communication accounting: bytes sent/received and sequential steps per CP call, forward and backward.

Every collective in ``layers.cp.collectives`` reports the bytes *this rank* moves into ``CommStats`` (see the
counting rules there). Algorithms open a *call* (``with stats.call("chain.p2p", "forward") as rec``) so that
all bytes of one exchange land in one ``CallRecord``; they also count ``rec.steps``, the number of sequential
communication rounds of the schedule (the critical path, the same number on every rank). A collective
issued outside an open call gets a record of its own with one step.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass

PHASES = ("forward", "backward")


@dataclass
class CallRecord:
    """One communication call of one rank: its name, phase, bytes, sequential steps and message count."""

    name: str
    phase: str
    bytes_sent: int = 0
    bytes_received: int = 0
    steps: int = 0
    messages: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


class CommStats:
    """Per-rank log of communication calls (a list of ``CallRecord``) with totals per phase and name.

    ``enabled=False`` turns recording off (the collectives then skip all bookkeeping).
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.records: list[CallRecord] = []
        self._open: list[CallRecord] = []

    # recording -----------------------------------------------------------------------------------------
    @contextmanager
    def call(self, name: str, phase: str = "forward"):
        """Group every collective issued inside into one record; yields it (or None when disabled)."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        if not self.enabled:
            yield None
            return
        rec = CallRecord(name, phase)
        self.records.append(rec)
        self._open.append(rec)
        try:
            yield rec
        finally:
            self._open.pop()

    def add(self, name: str, sent: int, received: int, messages: int = 1, phase: str | None = None) -> None:
        """Account ``sent``/``received`` bytes to the open call, or to a new one-step record."""
        if not self.enabled:
            return
        if self._open:
            rec = self._open[-1]
        else:
            rec = CallRecord(name, phase or "forward", steps=1)
            self.records.append(rec)
        rec.bytes_sent += int(sent)
        rec.bytes_received += int(received)
        rec.messages += int(messages)

    def reset(self) -> None:
        self.records.clear()

    # queries -------------------------------------------------------------------------------------------
    def select(self, name: str | None = None, phase: str | None = None) -> list[CallRecord]:
        """Records whose name starts with ``name`` (if given) and whose phase is ``phase`` (if given)."""
        return [r for r in self.records
                if (name is None or r.name.startswith(name)) and (phase is None or r.phase == phase)]

    def totals(self, name: str | None = None, phase: str | None = None) -> dict:
        """Sums over the selected records: bytes_sent, bytes_received, steps, messages, calls."""
        sel = self.select(name, phase)
        return {"bytes_sent": sum(r.bytes_sent for r in sel), "bytes_received": sum(r.bytes_received for r in sel),
                "steps": sum(r.steps for r in sel), "messages": sum(r.messages for r in sel), "calls": len(sel)}

    def last(self, name: str | None = None, phase: str | None = None) -> CallRecord | None:
        sel = self.select(name, phase)
        return sel[-1] if sel else None

    def __repr__(self) -> str:
        f, b = self.totals(phase="forward"), self.totals(phase="backward")
        return f"CommStats(calls={len(self.records)}, forward={f}, backward={b})"


def current_phase() -> str:
    """``"backward"`` while autograd runs a backward pass on this thread, else ``"forward"``."""
    import torch

    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"
