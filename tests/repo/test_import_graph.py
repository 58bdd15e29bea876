"""The dependency direction of ``layers``: mixers -> ``layers.cp`` -> ``layers.ops``; no cycles; ops never import cp;
no cycle between the packages of ``hp_megatron`` and ``layers`` (``hp_megatron.X`` / ``layers.X``).

Every import statement in ``layers/`` and ``hp_megatron/`` counts, also the ones inside functions (a lazy import is
still a dependency), so the graph is read from the source with ``ast`` rather than from ``sys.modules``.
"""
from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

from tests.support.paths import pythonpath

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(target: str, known: set[str]) -> str | None:
    """The longest known module that ``target`` (a dotted import target) names or lies in."""
    while target:
        if target in known:
            return target
        target = target.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of the layers/hp_megatron packages it imports}`` (absolute and relative imports)."""
    files = {_module_name(p): p for pkg in ("layers", "hp_megatron") for p in (ROOT / pkg).rglob("*.py")}
    known = set(files)
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            deps.update(d for d in (_resolve(t, known) for t in targets) if d is not None and d != name)
        graph[name] = deps
    return graph


def _cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_cycles_inside_layers():
    graph = {m: {d for d in deps if d.startswith("layers")} for m, deps in import_graph().items()
             if m.startswith("layers.")}
    assert _cycles(graph) == []


def test_ops_never_import_cp_and_layers_never_import_hp_megatron():
    graph = import_graph()
    bad_ops = {m: sorted(d for d in deps if d == "layers.cp" or d.startswith("layers.cp."))
               for m, deps in graph.items() if m == "layers.ops" or m.startswith("layers.ops.")}
    assert {m: d for m, d in bad_ops.items() if d} == {}
    bad_layers = {m: sorted(d for d in deps if d.startswith("hp_megatron"))
                  for m, deps in graph.items() if m.startswith("layers")}
    assert {m: d for m, d in bad_layers.items() if d} == {}
    # cp sits between the mixers and ops: it imports only cp, ops and the leaves, never a mixer module
    mixers = {"layers.mixers.delta.gdn", "layers.mixers.delta.kda", "layers.mixers.mla.layer",
              "layers.mixers.delta.mixer", "layers.mixers.attention"}
    assert mixers <= set(graph)
    allowed = ("layers.cp", "layers.ops", "layers.base")
    bad_cp = {m: sorted(d for d in deps if not any(d == a or d.startswith(a + ".") for a in allowed))
              for m, deps in graph.items() if m == "layers.cp" or m.startswith("layers.cp.")}
    assert {m: d for m, d in bad_cp.items() if d} == {}


# layers/ by kind, lowest first: each package imports only itself and the packages before it
LAYERS_ORDER = ("layers.base", "layers.ops", "layers.cp", "layers.shared", "layers.mixers")


def _kind(module: str) -> str | None:
    return next((k for k in LAYERS_ORDER if module == k or module.startswith(k + ".")), None)


def test_layers_by_kind_import_only_downwards():
    """base (leaf tables) <- ops <- cp <- shared (building blocks) <- mixers; every module of layers/ but the
    package's own ``__init__`` lies in one of them."""
    graph = import_graph()
    loose = sorted(m for m in graph if m.startswith("layers.") and _kind(m) is None)
    assert loose == []
    upward = {}
    for module, deps in graph.items():
        kind = _kind(module)
        if kind is None:
            continue
        level = LAYERS_ORDER.index(kind)
        bad = sorted(d for d in deps if _kind(d) is not None and LAYERS_ORDER.index(_kind(d)) > level)
        if bad:
            upward[module] = bad
    assert upward == {}


def test_no_cycles_in_hp_megatron_and_the_converter_never_imports_models():
    """hp_megatron: no cycle anywhere (with layers/); imports go models -> convert: no module of the conversion
    engine imports hp_megatron.models, except the command-line entry point (``python -m hp_megatron.convert``)."""
    graph = import_graph()
    assert _cycles(graph) == []
    entry = "hp_megatron.convert.__main__"
    engine = {m: sorted(d for d in deps if d == "hp_megatron.models" or d.startswith("hp_megatron.models."))
              for m, deps in graph.items() if m.startswith("hp_megatron.convert") and m != entry}
    assert {m: d for m, d in engine.items() if d} == {}
    assert "hp_megatron.models" in graph[entry] and "hp_megatron.convert.rules" in graph["hp_megatron.models.common"]


def package_of(module: str) -> str:
    """The package a module counts for in the package graph: ``hp_megatron.X`` / ``layers.X`` (its first
    subpackage or top-level module), or the top package itself for its ``__init__``."""
    return ".".join(module.split(".")[:2])


def package_graph(graph=None) -> dict[str, set[str]]:
    """``{package: packages it imports}`` of :func:`import_graph` (function-level imports included); entry points
    (modules named ``__main__``, which may import anything) left out."""
    graph = import_graph() if graph is None else graph
    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        if module.rpartition(".")[2] == "__main__":
            continue
        package = package_of(module)
        out.setdefault(package, set()).update(
            package_of(d) for d in deps if d.rpartition(".")[2] != "__main__" and package_of(d) != package)
    return out


def test_no_cycles_between_packages():
    """No cycle between the packages of hp_megatron/ and layers/, lazy imports counted: e.g. hp_megatron.checkpoint
    (the files on disk) never imports hp_megatron.convert, hp_megatron.models (architectures, presets) never imports
    hp_megatron.training or hp_megatron.arguments (which import it)."""
    packages = package_graph()
    assert _cycles(packages) == []
    assert not {d for d in packages["hp_megatron.checkpoint"] if d.startswith("hp_megatron")}
    assert not packages["hp_megatron.models"] & {"hp_megatron.training", "hp_megatron.arguments"}


def test_package_graph_sees_function_level_edges():
    """The package graph holds edges that only function-level imports make, and leaves entry points out."""
    graph = import_graph()
    # hp_megatron/models/build.py imports hp_megatron.model_builders inside its functions only
    assert "hp_megatron.model_builders" in graph["hp_megatron.models.build"]
    # hp_megatron/generate/model.py imports hp_megatron.checkpoint inside its functions only
    assert "hp_megatron.checkpoint" in graph["hp_megatron.generate.model"]
    packages = package_graph(graph)
    assert {"hp_megatron.model_builders", "hp_megatron.checkpoint"} <= packages["hp_megatron.models"]
    assert "hp_megatron.checkpoint" in packages["hp_megatron.generate"]
    # the converter's command line imports hp_megatron.models; as an entry point it is no edge of convert
    assert "hp_megatron.models" in graph["hp_megatron.convert.__main__"]
    assert "hp_megatron.models" not in packages["hp_megatron.convert"]
    assert package_graph({"x.a.m": {"x.b.n", "x.a.k"}, "x.b.n": set(), "x.a.__main__": {"x.c"}}) == \
        {"x.a": {"x.b"}, "x.b": set()}


def test_cp_imports_no_megatron():
    """``layers.cp`` needs torch only: no module of it imports megatron (also not lazily); what it needs of a
    layer comes in the layer's own description (``layers.cp.auto.AutoLayer``)."""
    bad = {}
    for path in sorted((ROOT / "layers" / "cp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            hits = [n for n in names if n == "megatron" or n.startswith("megatron.")]
            if hits:
                bad.setdefault(str(path.relative_to(ROOT)), []).extend(hits)
    assert bad == {}


def test_graph_sees_known_edges():
    """The reader finds real edges (guards against a parser that finds nothing and passes vacuously)."""
    graph = import_graph()
    assert "layers.ops.backends" in graph["layers.ops.delta_rule"]
    assert "layers.cp.chain" in graph["layers.cp.state_parallel"]
    assert "layers.mixers.attention.masking" in graph["layers.mixers.attention.eager"]   # relative import
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_importing_ops_loads_no_cp_module():
    code = ("import sys, layers.ops, layers.ops.eager.backend, layers.ops.summary, layers.ops.gates;"
            "print(sorted(m for m in sys.modules if m.startswith('layers.cp')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": pythonpath(str(ROOT))})
    assert out.stdout.strip() == "[]"
