"""Rows of the self-check, tolerances per dtype, and the printed tables.

A row is one op case and one phase: ``fwd`` (outputs and final states), ``bwd`` (every input gradient) or ``step``
(decode tokens and the cache after them). Its error is the largest relative L2 error ``||a - e|| / ||e||`` over the
phase's tensors, ``a`` from the backend and ``e`` from the eager backend on fp32 copies of the same rounded values,
on the same device. Statuses: ``pass``, ``FAIL`` (error above the dtype's tolerance), ``ERROR`` (the run raised),
``n/a`` (the backend or device lacks this path; the reason is printed and the exit status is unaffected).
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass, field

import torch

# Relative L2 tolerance per input dtype. bf16: 8 bits of mantissa, unit roundoff u = 2^-9 = 2e-3; the delta-rule
# kernels round inputs and intermediates (WY factors, states) to bf16, observed errors are a few u (DESIGN.md
# section 4). fp16 and fp32 share 5e-3: fp16 has u = 2^-12, and GPU kernels may multiply fp32 inputs in TF32
# (the same 10-bit mantissa); a CPU run (eager, Triton's interpreter) is exact to ~1e-6 in fp32.
TOLERANCES = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 5e-3}
DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PASS, FAIL, ERROR, NA = "pass", "FAIL", "ERROR", "n/a"


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPE_NAMES.items() if d == dtype)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative L2 error in float64 on the host (inf for a shape mismatch or a non-finite value)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.shape != e.shape:
        return float("inf")
    err = float((a - e).norm() / e.norm().clamp_min(1e-30))
    return err if err == err else float("inf")


@dataclass
class Row:
    op: str
    case: str
    phase: str
    dtype: torch.dtype
    errors: dict = field(default_factory=dict)   # tensor name -> relative error
    status: str = PASS
    note: str = ""
    detail: str = ""     # an ERROR's traceback (printed with --verbose)

    @property
    def tol(self) -> float:
        return TOLERANCES[self.dtype]

    @property
    def worst(self):
        return max(self.errors.items(), key=lambda kv: kv[1]) if self.errors else (None, None)

    def judge(self) -> "Row":
        """Set the status from the errors (rows already ERROR / n/a keep theirs)."""
        if self.status in (ERROR, NA):
            return self
        name, err = self.worst
        if name is None:
            self.status, self.note = ERROR, "no tensor compared"
        else:
            self.status = PASS if err <= self.tol else FAIL
        return self


def error_rows(op, case, phases, dtype, error: BaseException):
    """Rows for a case whose run raised: the exception's type and first line."""
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    detail = "".join(traceback.format_exception(error))
    return [Row(op, case, phase, dtype, status=ERROR, note=f"{type(error).__name__}: {message}"[:300], detail=detail)
            for phase in phases]


def na_row(op, case, phase, dtype, reason: str) -> Row:
    return Row(op, case, phase, dtype, status=NA, note=reason)


def _fmt_err(row: Row) -> tuple[str, str]:
    name, err = row.worst
    if name is None:
        return "-", ""
    return ("inf" if err == float("inf") else f"{err:.1e}"), name


def format_results(rows: list[Row]) -> str:
    """The one results table."""
    head = ("op", "case", "phase", "dtype", "max rel err", "tensor", "tol", "result")
    body = []
    for r in rows:
        err, name = _fmt_err(r)
        body.append((r.op, r.case, r.phase, dtype_name(r.dtype), err, name, f"{r.tol:.0e}", r.status))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)] if body else [len(h) for h in head]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [line(head), line("-" * w for w in widths)]
    for i, (r, cells) in enumerate(zip(rows, body)):
        out.append(line(cells))
        following = rows[i + 1] if i + 1 < len(rows) else None
        if r.note and r.status != PASS and not (following and (following.status, following.note) == (r.status, r.note)):
            out.append(" " * 4 + f"{r.status}: {r.note}")   # once under a run of rows with the same reason
    return "\n".join(out)


def format_details(rows: list[Row]) -> str:
    """The tracebacks of the ERROR rows, once per distinct traceback."""
    seen, out = set(), []
    for r in rows:
        if r.detail and r.detail not in seen:
            seen.add(r.detail)
            out.append(f"--- {r.op} {r.case} ({dtype_name(r.dtype)})\n{r.detail.rstrip()}")
    return "\n".join(out)


def format_requirements(checks) -> str:
    """The installed versions against ``layers.ops.requirements``."""
    head = ("package", "required", "found", "status")
    body = [(c.package, c.required, c.found or "-", c.status) for c in checks]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [line(head), line("-" * w for w in widths)]
    for c, cells in zip(checks, body):
        out.append(line(cells))
        if c.note:
            out.append(" " * 4 + c.note)
    return "\n".join(out)


def summary(rows: list[Row], checks) -> tuple[int, str]:
    """(exit status, one line): 0 when no row failed or errored and no requirement failed, else 1."""
    count = {s: sum(r.status == s for r in rows) for s in (PASS, FAIL, ERROR, NA)}
    failed_reqs = [c.package for c in checks if c.status == "FAIL"]
    ok = count[FAIL] == 0 and count[ERROR] == 0 and not failed_reqs
    text = (f"{'PASSED' if ok else 'FAILED'}: {count[PASS]} pass, {count[FAIL]} fail, {count[ERROR]} error, "
            f"{count[NA]} not available" + (f"; requirements not met: {', '.join(failed_reqs)}" if failed_reqs else ""))
    return (0 if ok else 1), text
