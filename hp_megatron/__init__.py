"""Megatron integration of the ``layers`` package: specs, arguments, data slicing, platform shims.

``hp_megatron.register_cp_subgroups_from_args(args)`` (every rank, after ``initialize_model_parallel``) creates
the CP sub-groups of the run's ``--hp-*`` CP flags; ``hp_megatron.register_cp_subgroups`` is
``layers.cp.register_cp_subgroups`` for other configurations (docs/cp.md). Both import torch.distributed
when first accessed.
"""
__version__ = "0.1.0"

_LAZY = {
    "register_cp_subgroups": "layers.cp.subgroups",
    "register_cp_subgroups_from_args": "hp_megatron.cp_subgroups",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hp_megatron' has no attribute {name!r}")
