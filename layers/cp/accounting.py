"""Communication accounting: bytes sent/received and sequential steps per CP call, forward and backward.

Every collective in ``layers.cp.collectives`` reports the bytes *this rank* moves into ``CommStats`` (see the
counting rules there). Algorithms open a *call* (``with stats.call("chain.p2p", "forward") as rec``) so that
all bytes of one exchange land in one ``CallRecord``; they also count ``rec.steps``, the number of sequential
communication rounds of the schedule (the critical path, the same number on every rank). A collective
issued outside an open call gets a record of its own with one step.
"""
from __future__ import annotations

from collections import deque
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

    ``enabled=False`` turns recording off (the collectives then skip all bookkeeping). Only the newest
    ``max_records`` records are kept, so a long-lived context does not grow without bound.
    """

    def __init__(self, enabled: bool = True, max_records: int = 4096):
        self.enabled = enabled
        self.records: deque[CallRecord] = deque(maxlen=max_records)
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

    def __repr__(self) -> str:
        f, b = self.totals(phase="forward"), self.totals(phase="backward")
        return f"CommStats(calls={len(self.records)}, forward={f}, backward={b})"


def current_phase() -> str:
    """``"backward"`` while autograd runs a backward pass on this thread, else ``"forward"``."""
    from layers.base.compat import in_backward

    return "backward" if in_backward() else "forward"


# -- closed forms (docs/cp.md) --------------------------------------------------------------------------------
def _powers_upto(i: int) -> int:
    """Number of powers of two <= i (0 for i <= 0)."""
    return i.bit_length() if i > 0 else 0


def state_scan_comm(method: str, layout: str, world_size: int, rank: int, *, num_chains: int, heads: int,
                    k_dim: int, v_dim: int, group_size: int | None = None, phase: str = "forward",
                    element_size: int = 4) -> dict:
    """Closed-form bytes_sent, bytes_received and steps of one ``exclusive_scan`` on ``rank``.

    s = D*HV*K*V*e bytes (one running state), m = D*HV*K*(K+V)*e (one position's map [M | E]),
    n = 2 (zigzag) or 1 (contiguous) own positions, L = n*P, nb(i) = number of powers of two <= i:

    * p2p: steps = L - 1 - (n - 1) = owner changes (2(P-1) zigzag, P-1 contiguous); zigzag rank r sends and
      receives ([r>0] + [r<P-1]) s; contiguous forward receives s if r > 0 and sends s if r < P-1 (mirrored
      in backward).
    * allgather: 1 step; (P-1) n m sent and received.
    * grouped_allgather_p2p (g | P, G = P/g, group q = r // g): (g-1) n m for the all-gather plus the p2p terms
      of ``p2p`` with (G, q) for (P, r); steps = [g>1] + (2(G-1) zigzag, G-1 contiguous).
    * recursive_doubling: ceil(log2 L) steps; zigzag: (nb(r) + nb(2P-1-r) - [r = P-1]) m sent and received;
      contiguous forward: nb(r) m received, nb(P-1-r) m sent (mirrored in backward).
    """
    P, r = world_size, rank
    n = 2 if layout == "zigzag" else 1
    L = n * P
    s = num_chains * heads * k_dim * v_dim * element_size
    m = num_chains * heads * k_dim * (k_dim + v_dim) * element_size
    if P == 1:
        return {"bytes_sent": 0, "bytes_received": 0, "steps": 0}

    def walk(nodes, node):                       # (sent, received, steps) of a state walking over nodes
        if nodes == 1:
            return 0, 0, 0
        if layout == "zigzag":
            k = (node > 0) + (node < nodes - 1)
            return k * s, k * s, 2 * (nodes - 1)
        first, last = (node == 0, node == nodes - 1) if phase == "forward" else (node == nodes - 1, node == 0)
        return (0 if last else s), (0 if first else s), nodes - 1

    if method == "allgather":
        sent = recv = (P - 1) * n * m
        steps = 1
    elif method == "p2p":
        sent, recv, steps = walk(P, r)
    elif method == "grouped_allgather_p2p":
        g = group_size
        if g is None or P % g:
            raise ValueError(f"group_size must divide P={P}, got {g}")
        sent, recv, steps = walk(P // g, r // g)
        sent += (g - 1) * n * m
        recv += (g - 1) * n * m
        steps += g > 1
    elif method == "recursive_doubling":
        steps = (L - 1).bit_length()             # ceil(log2 L)
        if layout == "zigzag":
            sent = recv = (_powers_upto(r) + _powers_upto(2 * P - 1 - r) - (r == P - 1)) * m
        else:
            i = r if phase == "forward" else P - 1 - r
            sent, recv = _powers_upto(P - 1 - i) * m, _powers_upto(i) * m
    else:
        raise ValueError(f"unknown state method {method!r}")
    return {"bytes_sent": int(sent), "bytes_received": int(recv), "steps": int(steps)}
