"""GDN, KDA and MLA mixers for megatron-core, their functional ops and context parallelism.

``layers.ops`` and ``layers.cp`` need only torch; the Megatron modules (``GatedDeltaNet``,
``KimiDeltaAttention``, ``MultiLatentAttention``) import megatron.core when first accessed.
"""
_LAZY = {
    "GatedDeltaNet": "layers.gdn",
    "KimiDeltaAttention": "layers.kda",
    "MultiLatentAttention": "layers.mla",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'layers' has no attribute {name!r}")
