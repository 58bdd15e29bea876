"""The field names of megatron-core's config classes (``TransformerConfig``, its base ``ModelParallelConfig`` and
``MLATransformerConfig``), read from the installed megatron-core's source with ``ast``, without importing it.

Registration (``hp_megatron.registry.entries.register_mixer``) refuses a flag-table row that would set one of these
fields unless the row declares it reads megatron's field (``OptionRow.megatron_field``). The registry is imported by
the flag parsers, before the example filters megatron-core's start-up warnings, so megatron-core itself is not
imported here; tests/integration/test_mixer_support.py checks these names against ``dataclasses.fields``.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import os

# (module file under megatron/core, class names whose annotated class attributes are dataclass fields)
_SOURCES = (("model_parallel_config.py", ("ModelParallelConfig",)),
            (os.path.join("transformer", "transformer_config.py"), ("TransformerConfig", "MLATransformerConfig")))


@functools.lru_cache(maxsize=1)
def megatron_config_fields() -> frozenset:
    """Every field name of megatron-core's ``ModelParallelConfig``, ``TransformerConfig`` and
    ``MLATransformerConfig``; RuntimeError naming megatron-core when it is not installed or its layout differs."""
    spec = importlib.util.find_spec("megatron")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    core = next((os.path.join(r, "core") for r in roots if os.path.isdir(os.path.join(r, "core"))), None)
    if core is None:
        raise RuntimeError("hp_megatron needs megatron-core (pip install megatron-core): no megatron/core package "
                           "found to read TransformerConfig's fields from")
    names = set()
    for relative, classes in _SOURCES:
        path = os.path.join(core, relative)
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
        except OSError as err:
            raise RuntimeError(f"megatron-core at {core} has no readable {relative} ({err})") from err
        found = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef) and node.name in classes}
        missing = sorted(set(classes) - set(found))
        if missing:
            raise RuntimeError(f"megatron-core's {path} defines no {missing}")
        for node in found.values():
            names.update(item.target.id for item in node.body
                         if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name))
    return frozenset(names)
