"""Which CP method each mixer runs, from the command line: one precedence for every mixer with a CP method.

1. an explicit ``--hp-*`` flag (``--hp-cp-method`` for GDN/KDA, ``--hp-mla-cp-strategy`` for MLA, a registered
   mixer's row with a ``layers.base.options.CommTypeRule``), or the mixer's keyword in ``ModuleSpec.params``;
2. a ``--cp-comm-type`` the user gave, mapped by the row's rule (``a2a`` -> ``ulysses`` / ``expanded_ulysses``, ...);
3. the mixer's default (``allgather`` / ``latent``: docs/cp.md, "Which CP method").

Megatron-LM's parser gives ``--cp-comm-type`` the default ``['p2p']``, which is no choice of the user's: following
it would turn every GDN/KDA layer into ``p2p``. :func:`record_given_cp_comm_type` (run by
``hp_megatron.arguments.add_hp_arguments``, so by every parser that has our flags: Megatron-LM's ``parse_args``
through the launchers and the example's) notes whether the flag is on the command line (``--cp-comm-type V`` or
``--cp-comm-type=V``; Megatron-LM and the example turn abbreviations off). :func:`resolved_cp_fields` then gives each
mixer's config field its method, so the layers never fall back to the ``cp_comm_type`` megatron's
``TransformerLayer`` hands them, except for a per-layer list of several values (the field stays None and each layer
maps its own value, the same rule at the layer).
"""
from __future__ import annotations

import sys

CP_COMM_TYPE_FLAG = "--cp-comm-type"
GIVEN_DEST = "hp_cp_comm_type_given"   # args attribute: whether --cp-comm-type was on the command line


def record_given_cp_comm_type(parser, argv=None) -> None:
    """Set the parser's default of ``args.hp_cp_comm_type_given``: whether ``--cp-comm-type`` is on ``argv``
    (default ``sys.argv[1:]``, what Megatron-LM's ``parse_args`` parses)."""
    from hp_megatron.flags import given_on_command_line

    parser.set_defaults(**{GIVEN_DEST: given_on_command_line(sys.argv[1:] if argv is None else argv,
                                                             CP_COMM_TYPE_FLAG)})


def user_cp_comm_type(args) -> list:
    """The ``--cp-comm-type`` values the user chose, distinct, in order (``[]``: not given, or only Megatron-LM's
    default). Args without the record (built in code) count a value they hold as chosen."""
    value = getattr(args, "cp_comm_type", None)
    if value is None or getattr(args, GIVEN_DEST, True) is False:
        return []
    return list(dict.fromkeys([value] if isinstance(value, str) else value))


def _rows():
    from hp_megatron.flags import flag_table

    return [row for row in flag_table() if row.comm_type is not None and row.flag is not None]


def _hierarchical_degree(args, values) -> int:
    sizes = getattr(args, "hierarchical_context_parallel_sizes", None)
    if not sizes:
        raise ValueError(f"{CP_COMM_TYPE_FLAG} {' '.join(values)} needs --hierarchical-context-parallel-sizes (its "
                         "first entry is the Ulysses degree of the GDN/KDA layers)")
    return int(sizes[0])


def resolved_cp_fields(args) -> dict:
    """``{config field: value}`` of every flag-table row whose method ``--cp-comm-type`` may decide, by the
    precedence above; a rule's ``hierarchical_degree`` field too when ``a2a+p2p`` decides it. A per-layer list
    of several values leaves the method None (each layer maps its own value; :func:`layer_methods` lists them)."""
    from hp_megatron.flags import flag_table

    values, fields = user_cp_comm_type(args), {}
    for row in _rows():
        rule, given = row.comm_type, getattr(args, row.dest, None)
        if given is not None:
            fields[row.field] = given
            continue
        for value in values:
            rule.method_of(value, CP_COMM_TYPE_FLAG)   # a value the rule does not know: one line naming it
        fields[row.field] = None if len(values) > 1 else rule.method_of(values[0]) if values else rule.default
        if rule.hierarchical_degree and values == ["a2a+p2p"]:
            degree_row = next(r for r in flag_table() if r.keyword == rule.hierarchical_degree and r.flag)
            if getattr(args, degree_row.dest, None) is None:
                fields[degree_row.field] = _hierarchical_degree(args, values)
    return fields


def layer_methods(args, field: str) -> list:
    """``[(method, degree, source)]``: the methods the layers of ``field``'s mixer may run (one, or one per distinct
    value of a per-layer ``--cp-comm-type`` list), the degree of the rule's ``hierarchical_degree`` keyword (its flag,
    else ``a2a+p2p``'s first hierarchical CP size, else None) and the flag that decided each method."""
    from hp_megatron.flags import flag_table

    row = next(r for r in _rows() if r.field == field)
    rule = row.comm_type
    degree_row = next((r for r in flag_table() if rule.hierarchical_degree and r.keyword == rule.hierarchical_degree
                       and r.flag), None)
    degree = getattr(args, degree_row.dest, None) if degree_row is not None else None
    if getattr(args, row.dest, None) is not None:
        return [(getattr(args, row.dest), degree, row.flag)]
    values = user_cp_comm_type(args)
    if not values:
        return [(rule.default, degree, "default")]
    return [(rule.method_of(v, CP_COMM_TYPE_FLAG),
             _hierarchical_degree(args, [v]) if degree is None and v == "a2a+p2p" and degree_row else degree,
             f"{CP_COMM_TYPE_FLAG} {v}") for v in values]
