"""The megatron-core APIs that differ between the supported releases (0.16.1 .. 0.19.x), each behind one function.

The code follows megatron-core 0.19's API; where 0.16 differs, the function here maps it (tests/layers/
test_megatron_compat.py checks each on the installed version). Each switch is detected from megatron-core itself
(a signature, an attribute), not from its version number, and says which release changed it.
"""
from __future__ import annotations

import functools
import inspect


@functools.cache
def _takes(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def experts_builder(module: type, submodules):
    """What ``BackendSpecProvider.grouped_mlp_modules`` returns for ``module(submodules=submodules)`` experts: a
    builder (``functools.partial``) since megatron-core 0.17, a ``(module, submodules)`` pair before."""
    from megatron.core.models.backends import BackendSpecProvider

    if _takes(BackendSpecProvider.grouped_mlp_modules, "moe_use_legacy_grouped_gemm"):
        return module, submodules
    return functools.partial(module, submodules=submodules)


def bind_moe_router_gemm() -> None:
    """megatron-core 0.16 without Transformer Engine never binds ``moe_utils.te_general_gemm``, yet its router
    reads it (0.19 binds None); bind None there."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def dense_mlp_spec(submodules):
    """A ``TransformerLayer``'s dense ``mlp`` spec: ``MLP.as_mlp_submodule`` bound to ``submodules`` since
    megatron-core 0.17 (which rewrites a ``ModuleSpec(MLP)`` into that, in place, with a warning), a
    ``ModuleSpec(MLP)`` before."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    if hasattr(MLP, "as_mlp_submodule"):
        return functools.partial(MLP.as_mlp_submodule, submodules=submodules)
    return ModuleSpec(module=MLP, submodules=submodules)
