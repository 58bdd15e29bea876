"""Command-line flags for hp_megatron's layers and the config fields they become.

Megatron-LM: ``pretrain(..., extra_args_provider=add_hp_arguments)`` adds the flags; then
``config = apply_hp_config(config, args)`` turns the ``TransformerConfig`` Megatron-LM built from its own flags
into the declared :class:`hp_megatron.config.HybridTransformerConfig` (or ``HybridMLATransformerConfig`` for an
``MLATransformerConfig``) holding these flags' fields (``hp_layer_pattern``, ``hp_cp_layout``, ``delta_*``,
``kda_*``, ``mla_cp_strategy``, megatron's ``linear_*`` and the MLA fields; the table is in docs/usage.md). The
example ``examples/pretrain/pretrain_hybrid.py`` uses the same two functions.

Megatron's ``--recompute-granularity selective --recompute-modules`` also takes our parts' names
(``layers.base.choices.RECOMPUTE_MODULES``: ``hp_conv``, ``hp_gated_norm``, ``hp_mla_up_proj``);
:func:`hp_megatron.config.split_recompute_modules` moves them to ``args.hp_recompute_modules`` (then the config
field) before megatron-core, which refuses unknown names, builds its config; docs/layers.md says what each costs.
"""
from __future__ import annotations

import argparse
import sys

from hp_megatron.cp_choice import layer_methods, record_given_cp_comm_type, resolved_cp_fields
from hp_megatron.flags import flag_groups, flag_table
from hp_megatron.registry import (MIXER_MODULE_FLAG, describe_symbols, load_mixer_modules, mixer_modules_in, mixers,
                                  refuse_unsupported, symbols, symbols_where)
from layers.cp.auto import MEASURE_TOP
from layers.cp.subgroups import check_auto_leaves_free
from layers.mixers.mla.dsa_options import DSA_ROWS


def _row_type(row):
    """The argparse ``type`` of a flag-table row: its type, with its check (``OptionRow.check``) as an
    ``ArgumentTypeError`` saying what it expects (``OptionRow.expected``: "a positive number" for a float row); every
    row's check runs again in :func:`hp_config_from_args`, naming the flag."""
    def parse(text):
        value = row.type(text)
        if row.check is not None and row.problem(value):
            raise argparse.ArgumentTypeError(f"expected {row.expected()}, got {text}")
        return value
    parse.__name__ = row.type.__name__   # argparse names the type in "invalid int value: ..."
    return parse


def add_row_arguments(group, rows) -> None:
    """One flag per flag-table row that has one (``layers.base.options.OptionRow``). A bool row: ``store_true``
    (default False), or with ``default=True`` both ``--flag`` and ``--no-flag`` (``argparse.BooleanOptionalAction``),
    so that the default is honoured and can be turned off, as Megatron-LM's on-by-default switches."""
    for row in rows:
        if row.flag is None:
            continue
        if row.type is bool and row.default is True:
            group.add_argument(row.flag, action=argparse.BooleanOptionalAction, default=True, help=row.help)
        elif row.type is bool:
            group.add_argument(row.flag, action="store_true", help=row.help)
        else:
            group.add_argument(row.flag, type=_row_type(row), default=row.default, choices=row.choices,
                               help=row.help)


def add_hp_arguments(parser: argparse.ArgumentParser, argv=None) -> argparse.ArgumentParser:
    """Add the ``--hp-*`` flags and return the parser: first ``--hp-mixer-module MODULE`` (repeatable), whose
    modules (read from ``argv``, default ``sys.argv[1:]``) are imported now so that their mixers' symbols and flags
    exist when the rest is added and parsed; then one group per part of the flag table (``hp_megatron.flags``:
    hp_megatron's rows, then each registered mixer's). Notes whether ``--cp-comm-type`` is on ``argv``
    (``hp_megatron.cp_choice``: Megatron-LM's default ``['p2p']`` is no choice of the user's)."""
    load_mixer_modules(mixer_modules_in(sys.argv[1:] if argv is None else argv))
    record_given_cp_comm_type(parser, argv)
    for i, (title, rows) in enumerate(flag_groups()):
        group = parser.add_argument_group(title)
        if i == 0:
            group.add_argument(MIXER_MODULE_FLAG, action="append", default=[], metavar="MODULE",
                               help="import MODULE before the flags are checked: it registers mixers of its own "
                                    "(hp_megatron.registry.register_mixer; their pattern symbols and flags); "
                                    "repeatable")
        add_row_arguments(group, rows)
    return parser


def hp_config_from_args(args) -> dict:
    """``{config field: value}`` that our layers read, from parsed args (defaults from the model size).

    GDN/KDA read megatron-core 0.16's ``linear_*`` names and our ``delta_*`` / ``kda_*`` names; MLA reads
    ``MLATransformerConfig``'s names and ``mla_cp_strategy``; every mixer reads ``hp_cp_layout`` and
    ``hp_cp_calibration``;
    ``PatternLayer`` reads ``hp_layer_pattern``. All are fields of ``hp_megatron.config``'s classes. The CP methods
    (``delta_cp_method``, ``mla_cp_strategy``) are resolved here: flag, else a ``--cp-comm-type`` the user gave,
    else the mixer's default (``hp_megatron.cp_choice``).
    """
    heads, hidden = args.num_attention_heads, args.hidden_size
    key_heads = args.hp_linear_num_key_heads or heads
    key_dim = args.hp_linear_key_head_dim or hidden // key_heads
    value_heads = args.hp_linear_num_value_heads or key_heads
    if value_heads % key_heads:
        raise ValueError(f"--hp-linear-num-value-heads {value_heads} must be a multiple of the key heads {key_heads}")
    calibration = getattr(args, "hp_cp_calibration", None)
    if calibration and "auto" not in (args.hp_cp_method, args.hp_mla_cp_strategy):
        raise ValueError(f"--hp-cp-calibration {calibration} needs --hp-cp-method auto or --hp-mla-cp-strategy auto "
                         f"(got {args.hp_cp_method!r} / {args.hp_mla_cp_strategy!r})")
    measure = getattr(args, "hp_cp_auto_measure", None)
    if measure is not None and args.hp_cp_method != "auto":
        raise ValueError(f"--hp-cp-auto-measure {measure} needs --hp-cp-method auto (got {args.hp_cp_method!r}); "
                         "only auto times candidates on the layers")
    for row in flag_table():   # every row's own check (argparse ran the positive ones; args built in code did not)
        value = getattr(args, row.dest, None) if row.flag is not None else None
        why = None if value is None else row.problem(value)   # None: not given, the field's default applies
        if why:
            raise ValueError(f"{row.flag} {value!r}: {why}")
    from hp_megatron.config import split_recompute_modules

    split_recompute_modules(args)   # --recompute-modules' hp_* names -> args.hp_recompute_modules
    # every flag-table row with a flag and a config field, then the defaults that follow from the model size
    fields = {row.field: getattr(args, row.dest, row.default) for row in flag_table()
              if row.flag is not None and row.field is not None}
    # Megatron-LM's own --dsa-indexer-* flags (its dest = the field) stand when ours are not given
    for row in DSA_ROWS:
        if getattr(args, row.dest, row.default) == row.default and getattr(args, row.field, None) is not None:
            fields[row.field] = getattr(args, row.field)
    fields.update({
        "hp_recompute_modules": tuple(getattr(args, "hp_recompute_modules", ())),
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": key_dim,
        "linear_value_head_dim": args.hp_linear_value_head_dim or key_dim,
        "hp_cp_calibration": calibration,
        "delta_cp_auto_measure": MEASURE_TOP if measure is None else measure,
        "kv_lora_rank": args.hp_mla_kv_lora_rank or max(hidden // 2, 16),
        "qk_head_dim": args.hp_mla_qk_head_dim or hidden // heads,
        "qk_pos_emb_head_dim": args.hp_mla_qk_pos_emb_head_dim or max(hidden // heads // 2, 8),
        "v_head_dim": args.hp_mla_v_head_dim or hidden // heads,
        "hp_mtp_layer_symbol": getattr(args, "hp_mtp_layer_symbol", None),
    })
    fields.update(resolved_cp_fields(args))
    if getattr(args, "rotary_base", None) is not None:   # --rotary-base: the MLA layers' RoPE base too
        fields["rotary_base"] = float(args.rotary_base)
    return fields


def validate_hp_args(args) -> None:
    """Check the ``--hp-*`` flags against each other and Megatron's parallel sizes, before anything is built.

    Reads ``context_parallel_size``, ``tensor_model_parallel_size``, ``seq_length`` and
    ``num_attention_heads`` from ``args`` (Megatron-LM's names). Raises ValueError naming the flags and
    values; the same checks the layers make later, stated in flag names.
    """
    from hp_megatron.decoder.pattern import validate_pattern

    pattern = args.hp_layer_pattern or ""
    try:
        if args.hp_layer_pattern is not None:
            validate_pattern(pattern, symbols())
    except ValueError:
        modules = f"; {MIXER_MODULE_FLAG} loads a mixer module" if not getattr(args, "hp_mixer_module", None) else ""
        raise ValueError(f"--hp-layer-pattern {args.hp_layer_pattern!r} uses letters outside "
                         f"{''.join(sorted(symbols()))} ({describe_symbols()}{modules})") from None
    check_mixer_support(args)
    fields = hp_config_from_args(args)
    cp = getattr(args, "context_parallel_size", 1) or 1
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    seq = getattr(args, "seq_length", None)
    parts = 2 * cp if args.hp_cp_layout == "zigzag" else cp
    if seq is not None and cp > 1 and seq % parts:
        raise ValueError(f"--seq-length {seq} must be divisible by {parts} ("
                         f"{'2 x ' if parts != cp else ''}--context-parallel-size {cp}, "
                         f"--hp-cp-layout {args.hp_cp_layout})")
    rope = [s for s in symbols_where(lambda e: e.model_rope) if s in pattern]
    if rope and cp > 1 and args.hp_cp_layout != "zigzag":
        raise ValueError(f"attention layers ({', '.join(repr(s) for s in rope)} in --hp-layer-pattern) use megatron's "
                         "rotary embedding, which assumes the zigzag CP layout; got --hp-cp-layout "
                         f"{args.hp_cp_layout}")
    delta = set(symbols_where(lambda e: e.family == "delta"))
    linear = set(pattern) & delta if pattern else delta
    ulysses_degrees = [_check_delta_cp(args, cp, *method) for method in layer_methods(args, "delta_cp_method")]
    for ulysses in ulysses_degrees:
        for flag, heads in (("--hp-linear-num-key-heads", fields["linear_num_key_heads"]),
                            ("--hp-linear-num-value-heads", fields["linear_num_value_heads"])):
            if linear and (heads % tp or (heads // tp) % ulysses):
                raise ValueError(f"GDN/KDA heads {heads} ({flag}, default --num-attention-heads) must be divisible "
                                 f"by --tensor-model-parallel-size {tp} x Ulysses degree {ulysses}")
    mla = set(symbols_where(lambda e: e.family == "mla"))
    for strategy, _, source in layer_methods(args, "mla_cp_strategy") if cp > 1 and set(pattern) & mla else ():
        heads = args.num_attention_heads
        if strategy.endswith("_ulysses") and heads % (tp * cp):
            raise ValueError(f"MLA CP strategy {strategy} (from {source}) needs --num-attention-heads {heads} "
                             f"divisible by --tensor-model-parallel-size {tp} x --context-parallel-size {cp}")


def _check_delta_cp(args, cp: int, method: str, degree, source: str) -> int:
    """The GDN/KDA CP ``method`` with Ulysses ``degree`` (``hp_megatron.cp_choice.layer_methods``; chosen by
    ``source``: ``--hp-cp-method``, ``--cp-comm-type V`` or the default) against the CP size and the group-size /
    Ulysses-degree flags; returns its Ulysses degree."""
    said = f"--hp-cp-method {method}" if source == "--hp-cp-method" else f"GDN/KDA CP method {method} (from {source})"
    if method == "auto":
        check_auto_leaves_free(args.hp_cp_group_size, args.hp_cp_ulysses_degree,
                               flags=("--hp-cp-group-size", "--hp-cp-ulysses-degree"))
    ulysses = cp if method == "ulysses" else (degree or 1)
    if method == "ulysses" and args.hp_cp_ulysses_degree not in (None, cp):
        raise ValueError(f"{said} uses all --context-parallel-size {cp} ranks; drop "
                         f"--hp-cp-ulysses-degree {args.hp_cp_ulysses_degree} or set it to {cp}")
    if cp % ulysses:
        raise ValueError(f"--hp-cp-ulysses-degree {ulysses} must divide --context-parallel-size {cp}")
    state_ranks = cp // ulysses
    if method == "grouped_allgather_p2p":
        if args.hp_cp_group_size is None:
            raise ValueError(f"{said} needs --hp-cp-group-size (ranks per all-gather group, a divisor of "
                             f"{state_ranks})")
        if state_ranks % args.hp_cp_group_size:
            raise ValueError(f"--hp-cp-group-size {args.hp_cp_group_size} must divide the state-passing ranks "
                             f"{state_ranks} (--context-parallel-size {cp} / Ulysses degree {ulysses})")
    elif args.hp_cp_group_size is not None:
        raise ValueError(f"--hp-cp-group-size is only used by --hp-cp-method grouped_allgather_p2p, got it with "
                         f"{said}")
    return ulysses


def check_mixer_support(args, *, decode: bool = False, thd=None) -> None:
    """Refuse what a mixer of ``--hp-layer-pattern`` declares it does not support (``MixerEntry.supports``), before
    anything is built: ``--context-parallel-size`` > 1, packed documents (``thd``; None: the example's
    ``--reset-attention-mask``), generation with a state cache (``decode``), the MTP layers' mixer
    (``--mtp-num-layers`` with ``--hp-mtp-layer-symbol`` or the pattern's only symbol) and ``--hp-backend``; then
    run each used mixer's own ``MixerEntry.check_args(args)``. Raises ``hp_megatron.registry.UnsupportedByMixer``
    (a ValueError, one line; the entry points exit 2). Without a pattern (a spec that fixes its own) nothing is
    checked here."""
    pattern = getattr(args, "hp_layer_pattern", None)
    if not pattern:
        return
    registered = mixers()
    used = [registered[s] for s in dict.fromkeys(pattern) if s in registered]
    mtp_symbol = None
    if getattr(args, "mtp_num_layers", None):
        mtp_symbol = getattr(args, "hp_mtp_layer_symbol", None) or (pattern[0] if len(set(pattern)) == 1 else None)
    refuse_unsupported(used, registered.values(), source=f"--hp-layer-pattern {pattern}",
                       cp_size=getattr(args, "context_parallel_size", 1) or 1,
                       thd=bool(getattr(args, "reset_attention_mask", False)) if thd is None else thd, decode=decode,
                       mtp_symbol=mtp_symbol, backend=getattr(args, "hp_backend", None))
    for entry in used:
        if entry.check_args is not None:
            entry.check_args(args)


def apply_hp_config(config, args):
    """``config`` as its declared class (``hp_megatron.config``) with :func:`hp_config_from_args`'s fields.

    Returns a new :class:`~hp_megatron.config.HybridMLATransformerConfig` when ``config`` is an
    ``MLATransformerConfig`` (Megatron-LM's ``--multi-latent-attention``: its MLA fields keep their flags'
    values), else a :class:`~hp_megatron.config.HybridTransformerConfig`; every megatron field of ``config`` is
    carried over. With ``--hp-hf-config`` the architecture's own fields (``ModelPreset.mixer_fields``) and layer
    pattern win over the flags. Raises ValueError naming a field whose value is out of range.
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from hp_megatron.config import MLA_FIELD_NAMES, hybrid_config

    ours = hp_config_from_args(args)
    if isinstance(config, MLATransformerConfig):
        ours = {name: value for name, value in ours.items() if name not in MLA_FIELD_NAMES}
    if getattr(args, "hp_hf_config", None) is not None:
        preset = getattr(args, "hp_preset", None)   # apply_hf_config_to_args's, when it ran
        if preset is None:
            from hp_megatron.models import preset_from_hf

            preset = preset_from_hf(args.hp_hf_config)
        ours.update(preset.mixer_fields, hp_layer_pattern=preset.pattern)
    return hybrid_config(config, **ours)
