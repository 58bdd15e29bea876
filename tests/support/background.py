"""Long single-process subprocess runs started when collection ends and awaited by their test, run last.

For much of the suite one core of the 2-core CI machine is busy (in-process tests, one subprocess at a time): the
whole `.ci/run` used 1.1 CPU seconds per second. A test module whose check is one long single-process subprocess
(a benchmark's smoke run) declares it with :func:`declare` at import; ``tests/conftest.py`` starts the declared
runs of modules with selected tests once collection ends (:func:`start_selected`), at nice 10 so that they take
the idle core and yield to the tests, moves those modules' tests to the end of the session (:func:`last`), and
the test collects the result with :func:`result`. Each run writes its stdout/stderr to files in its own temporary folder
(no pipe to fill), gets the environment of the pytest process at collection, and is killed at exit if still running.
"""
from __future__ import annotations

import atexit
import os
import subprocess
import tempfile
from dataclasses import dataclass, field


@dataclass
class BackgroundRun:
    """One declared run: its command (``{out}`` in an argument is replaced by the run's folder) and, once
    started, its process and folder."""
    module: str
    command: list
    cwd: str
    proc: subprocess.Popen | None = None
    folder: str = ""
    streams: list = field(default_factory=list)


_RUNS: dict[str, BackgroundRun] = {}


def declare(name: str, module: str, command: list, cwd: str) -> None:
    """Declare run ``name`` of test module ``module`` (its ``__name__``); started by :func:`start_selected`."""
    _RUNS.setdefault(name, BackgroundRun(module, list(command), str(cwd)))


def start_selected(modules) -> None:
    """Start the declared runs of these modules (those with selected tests); the others never start."""
    for run in _RUNS.values():
        if run.module in modules and run.proc is None:
            _start(run)


def _start(run: BackgroundRun) -> None:
    run.folder = tempfile.mkdtemp(prefix="hp-background-")
    run.streams = [open(os.path.join(run.folder, name), "w", encoding="utf-8") for name in ("stdout", "stderr")]
    command = [arg.replace("{out}", run.folder) for arg in run.command]
    run.proc = subprocess.Popen(command, cwd=run.cwd, stdout=run.streams[0], stderr=run.streams[1],
                                stdin=subprocess.DEVNULL, preexec_fn=lambda: os.nice(10))


def last(items) -> list:
    """``items`` (pytest's) with the tests of modules that declared a run moved to the end, order kept."""
    modules = {run.module for run in _RUNS.values()}
    waiting = [item for item in items if getattr(getattr(item, "module", None), "__name__", None) in modules]
    return [item for item in items if item not in waiting] + waiting


def result(name: str, timeout: float) -> tuple[int, str, str, str]:
    """``(exit status, stdout, stderr, folder)`` of run ``name``, started now if collection did not start it;
    ``subprocess.TimeoutExpired`` (the run killed) after ``timeout`` seconds of waiting."""
    run = _RUNS[name]
    if run.proc is None:
        _start(run)
    try:
        code = run.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        run.proc.kill()
        raise
    finally:
        for stream in run.streams:
            stream.close()
    with open(os.path.join(run.folder, "stdout"), encoding="utf-8") as out, \
            open(os.path.join(run.folder, "stderr"), encoding="utf-8") as err:
        return code, out.read(), err.read(), run.folder


@atexit.register
def _kill_unfinished() -> None:
    for run in _RUNS.values():
        if run.proc is not None and run.proc.poll() is None:
            run.proc.kill()
