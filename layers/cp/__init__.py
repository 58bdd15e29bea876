"""Context parallelism for GDN/KDA/MLA: layouts, chain plans, differentiable collectives, state scans, Ulysses.

Light on import (torch only). The op-level engines (``layers.cp.state_parallel``, ``layers.cp.halo``,
``layers.cp.mla``) are imported by the ops when a ``cp_context`` is passed, never here.

Main entry points::

    ctx = build_cp_context(group, method="allgather", layout="zigzag", cu_seqlens=None)
    x_local = shard(x, ctx, seq_dim=1)          # this rank's tokens, Megatron's order
    x = unshard(x_local, ctx, seq_dim=1)        # back to the global tensor (differentiable)
    register_cp_subgroups(cp_group, method="auto")   # every rank of the world, once, when the CP group
                                                     # is smaller than the world (layers/cp/subgroups.py)

See docs/cp.md for the methods, their costs and when to choose them.
"""
from layers.cp.accounting import CallRecord, CommStats
from layers.cp.chain import STATE_METHODS, ChainComm, ChainScan, chain_scan, exclusive_scan
from layers.cp.context import METHODS, CPContext, build_cp_context, shard, unshard
from layers.cp.plan import LAYOUTS, ChainPlan, build_chain_plan, local_seq_index
from layers.cp.subgroups import register_cp_subgroups
from layers.cp.ulysses import heads_to_seq, seq_to_heads

__all__ = [
    "CallRecord", "CommStats", "STATE_METHODS", "ChainComm", "ChainScan", "chain_scan", "exclusive_scan",
    "METHODS", "CPContext", "build_cp_context", "shard", "unshard", "LAYOUTS", "ChainPlan",
    "build_chain_plan", "local_seq_index", "heads_to_seq", "seq_to_heads", "register_cp_subgroups",
]
