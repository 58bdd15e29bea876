"""Run callbacks right before / right after a module's first execution (``sys.meta_path`` finder).

Used to change Megatron-LM's modules from outside, before ``pretrain_gpt.py`` uses them:
``run_before("megatron.training", fn)`` calls ``fn()`` before the package's ``__init__`` executes,
``run_after("megatron.training.training", fn)`` calls ``fn(module)`` once it has executed.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_before: dict = {}
_after: dict = {}


class _CallbackFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _before and name not in _after:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_with_callbacks(module):
            for fn in _before.pop(name, ()):
                fn()
            exec_module(module)
            for fn in _after.pop(name, ()):
                fn(module)

        spec.loader.exec_module = exec_with_callbacks
        return spec


def _register(table: dict, name: str, fn) -> None:
    if name in sys.modules:
        raise RuntimeError(f"{name} is already imported; the callback {fn.__qualname__} must be registered first")
    table.setdefault(name, []).append(fn)
    if not any(isinstance(finder, _CallbackFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _CallbackFinder())


def run_before(name: str, fn) -> None:
    """Call ``fn()`` right before module ``name`` first executes."""
    _register(_before, name, fn)


def run_after(name: str, fn) -> None:
    """Call ``fn(module)`` right after module ``name`` first executed."""
    _register(_after, name, fn)
