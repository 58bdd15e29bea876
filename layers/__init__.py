"""GDN, KDA and MLA mixers for megatron-core, their functional ops and context parallelism.

Laid out by kind, each package importing only the ones before it: ``base`` (leaf tables and compatibility shims) <-
``ops`` (functional kernels) <- ``cp`` (context parallelism) <- ``shared`` (building blocks) <- ``mixers`` (one folder
per family: ``delta``, ``mla``, ``attention``).

``layers.ops`` and ``layers.cp`` need only torch; the Megatron modules (``GatedDeltaNet``,
``KimiDeltaAttention``, ``MultiLatentAttention``) import megatron.core when first accessed.
"""
_LAZY = {
    "GatedDeltaNet": "layers.mixers.delta.gdn",
    "KimiDeltaAttention": "layers.mixers.delta.kda",
    "MultiLatentAttention": "layers.mixers.mla.layer",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'layers' has no attribute {name!r}")
