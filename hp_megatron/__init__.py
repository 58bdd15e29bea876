"""Megatron integration of the ``layers`` package: specs, arguments, data slicing, platform shims.

``register_cp_subgroups_from_args(args)`` (every rank, after ``initialize_model_parallel``) creates the CP
sub-groups of the run's ``--hp-*`` CP flags (``layers.cp.register_cp_subgroups`` for other configurations;
docs/cp.md, "CP sub-groups").
"""
from hp_megatron.training.cp_subgroup_registration import register_cp_subgroups_from_args

__version__ = "0.1.0"
__all__ = ["register_cp_subgroups_from_args"]
