"""Register the CP sub-groups of a Megatron run (``layers.cp.register_cp_subgroups`` from the ``--hp-*`` flags).

Call :func:`register_cp_subgroups_from_args` on every rank at the same point after megatron's
``initialize_model_parallel`` (the example calls it in ``setup``, the Megatron-LM launcher in its model
provider): without it, a hybrid Ulysses or grouped all-gather context on a CP group smaller than the world
(TP, DP or PP > 1) raises RuntimeError naming this function, where it used to risk a hang (docs/cp.md).
"""
from __future__ import annotations

import math


def _model_cp_groups(args) -> list:
    """This rank's CP groups: megatron's, and with ``--hybrid-context-parallel`` the DP x CP groups of every
    size a micro-batch's ``PackedSeqParams.cp_group`` may be."""
    from megatron.core import parallel_state

    groups = [parallel_state.get_context_parallel_group()]
    if getattr(args, "hybrid_context_parallel", False):
        dp_cp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        # megatron's sizes (parallel_state.create_hybrid_dp_cp_groups): 2 .. 2**(floor(log2 n) - 1), and n itself
        for size in [2 ** i for i in range(1, int(math.log2(dp_cp)))] + [dp_cp]:
            groups.append(parallel_state.get_hybrid_data_context_parallel_groups(group_size=size))
    return groups


def register_cp_subgroups_from_args(args, cp_groups=None) -> list:
    """``layers.cp.register_cp_subgroups`` for the GDN/KDA CP configuration of the flags ``--hp-cp-method`` (or, not
    given, the method a ``--cp-comm-type`` you gave selects, else the default: ``hp_megatron.cp_choice``),
    ``--hp-cp-ulysses-degree``, ``--hp-cp-group-size`` (``auto``: every configuration it may choose).

    COLLECTIVE over the whole world: every rank, at the same point, after ``initialize_model_parallel``.
    cp_groups: the CP groups this rank may use (default: megatron's CP group, plus the hybrid DP x CP groups
    with ``--hybrid-context-parallel``). Without CP (``--context-parallel-size 1``, no hybrid CP) there is
    nothing to create and nothing is communicated (the flags are the same on every rank). Returns the member
    ranks of the sub-groups created.
    """
    from hp_megatron.cp_choice import layer_methods
    from layers.cp import register_cp_subgroups

    if cp_groups is None:
        if (getattr(args, "context_parallel_size", 1) or 1) == 1 and not getattr(args, "hybrid_context_parallel",
                                                                              False):
            return []
        cp_groups = _model_cp_groups(args)
    created = []
    for method, degree, _ in layer_methods(args, "delta_cp_method"):   # one per value of a per-layer list
        created += register_cp_subgroups(cp_groups, method=method, ulysses_degree=degree,
                                         group_size=args.hp_cp_group_size)
    return created
