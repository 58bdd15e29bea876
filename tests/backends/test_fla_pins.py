"""flash-linear-attention: pinned below the next minor, and the private functions' signatures checked at load."""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_setup_pins_fla_below_the_next_minor():
    text = (ROOT / "setup.py").read_text()
    for package in ("flash-linear-attention", "fla-core"):
        assert re.search(rf'"{package}>=0\.6\.0,<0\.7"', text), package


def test_keyword_table_matches_the_calls():
    """KEYWORDS (what the load-time check verifies) lists exactly the keywords triton_engine_exchange passes to each
    function."""
    from layers.cp.triton_engine_exchange import KEYWORDS

    used: dict = {}
    for node in ast.walk(ast.parse((ROOT / "layers/cp/triton_engine_exchange.py").read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "fi"):
            used.setdefault(node.func.attr, set()).update(k.arg for k in node.keywords if k.arg)
    assert {k: set(v) for k, v in KEYWORDS.items()} == used


def test_moved_signature_raises_naming_the_version():
    from layers.cp.triton_engine_exchange import KEYWORDS, check_signatures

    def accepts_all(*args, **kwargs):
        return None

    found = {name: accepts_all for name in KEYWORDS}
    check_signatures(found, "0.6.0")                       # **kwargs: nothing to check

    def renamed(q, k, v, chunk_size, cu_seqlens, chunk_indices, g, scale):   # "h" moved away
        return None

    found["chunk_fwd_o"] = renamed
    with pytest.raises(RuntimeError, match=r"flash-linear-attention 9\.9\.9's chunk_fwd_o no longer takes \['h'\]"):
        check_signatures(found, "9.9.9")
    del found["chunk_fwd_o"]
    with pytest.raises(RuntimeError, match=r"flash-linear-attention 9\.9\.9 lacks chunk_fwd_o"):
        check_signatures(found, "9.9.9")


def test_installed_fla_passes_the_check():
    from layers.cp.triton_engine_exchange import load_internals

    try:
        load_internals()
    except RuntimeError as err:
        if "not installed" in str(err) or "importable" in str(err):
            pytest.skip(f"flash-linear-attention unavailable here: {err}")
        raise


def test_kind_descriptors_name_installed_fla_functions():
    """The FLA ``module:function`` paths of every delta-rule kind (layers/ops/kinds.py) import, and the CP engine
    loads (and signature-checks) each kind's gate cumsum kernel."""
    import importlib

    pytest.importorskip("fla")
    from layers.cp.triton_engine_exchange import _INTERNALS
    from layers.ops.kinds import GDN, KDA

    for kind in (GDN, KDA):
        for role, path in kind.kernels["triton"].items():
            module, _, name = path.partition(":")
            assert callable(getattr(importlib.import_module(module), name)), (kind.name, role, path)
        module, _, name = kind.kernel("triton", "gate_cumsum").partition(":")
        assert name in _INTERNALS[module]


def test_interpreter_shims_name_the_triton_they_support():
    """The tests that run FLA's kernels on CPU skip with this reason under another triton, and enable() refuses."""
    from tests.support import triton_interpreter

    assert triton_interpreter.available("3.7.1") is None
    reason = triton_interpreter.available("3.8.0")
    assert "support triton 3.7.x only, found triton 3.8.0" in reason, reason
    assert triton_interpreter.available("3.6.0") is not None


def test_fla_dispatch_is_turned_off_only_before_fla_is_imported_and_unless_the_user_chose():
    from layers.ops.triton.runtime import DISPATCH_ENV, default_dispatch_off

    environ = {}
    assert default_dispatch_off({}, environ) and environ == {DISPATCH_ENV: "1"}
    chosen = {DISPATCH_ENV: "0"}
    assert not default_dispatch_off({}, chosen) and chosen == {DISPATCH_ENV: "0"}
    late = {}
    assert not default_dispatch_off({"fla.backends": object()}, late) and late == {}
