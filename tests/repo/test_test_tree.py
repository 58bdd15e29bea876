"""The test tree's rules: every test module lives in an area folder that is a package, and no module under tests/
imports a test module (shared code lives in tests/support). Imports are read from the source with ``ast``, the
lazy ones inside functions included, as tests/repo/test_import_graph.py does for the library."""
from __future__ import annotations

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]


def _python_files():
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _imported_modules(path):
    """Every module an import statement in ``path`` names: ``import a.b`` -> a.b; ``from a import b`` -> a.b
    (b may be a module) and a; relative imports resolved against the file's package."""
    package = path.relative_to(TESTS.parent).parent.parts
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ((base,) if base else ()))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def _is_test_module(name):
    return name.rsplit(".", 1)[-1].startswith("test_")


def test_no_test_module_imports_another_test_module():
    offenders = [f"{p.relative_to(TESTS)} imports {name}" for p in _python_files()
                 for name in _imported_modules(p) if _is_test_module(name)]
    assert not offenders, "move what is shared to tests/support: " + "; ".join(offenders)


def test_every_test_module_is_in_an_area_package():
    loose = [p.name for p in TESTS.glob("test_*.py")]
    assert not loose, ("test modules directly in tests/ (put each in its area folder, see docs/architecture.md): "
                       f"{loose}")
    folders = {p.parent for p in TESTS.rglob("test_*.py")} | {TESTS / "support"}
    missing = sorted(str(f.relative_to(TESTS)) for f in folders if not (f / "__init__.py").is_file())
    # without __init__.py pytest imports a test file under its bare name: two areas could not hold the same name,
    # and spawned ranks would import workers by a name another folder may shadow
    assert not missing, f"test folders without __init__.py: {missing}"


def test_the_checks_see_imports():
    """The reader finds the forms used in this tree (module, from-import, relative, lazy inside a function)."""
    source = TESTS / "layers" / "test_layers_checkpoint.py"
    assert "tests.support.delta_layer_cases.spawn_results" in set(_imported_modules(source))
    assert _is_test_module("tests.layers.test_mla") and not _is_test_module("tests.support.mla_layer")
