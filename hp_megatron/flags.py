"""The flag table: one :class:`layers.base.options.OptionRow` per parameter (flag, config field, mixer keyword, type,
whether it defines the model, default, help, choices, checks), assembled from hp_megatron's own rows and the
registered mixers' rows (``MixerEntry.options``: ``layers.mixers.delta.options``, ``layers.mixers.mla.options``, a
third-party mixer's module).

Derived from it: the argparse groups of ``hp_megatron.arguments.add_hp_arguments`` and the field values of
``hp_config_from_args``, the config checks of ``hp_megatron.config.check_hybrid_fields``, the model flags the
example's checkpoints store (``hp_megatron.training.model_args.model_arg_names``), the flags ``--hp-hf-config``
decides (``preset`` rows) and docs/usage.md's flag table (:func:`markdown_table`, checked by tests/repo).
"""
from __future__ import annotations

from hp_megatron.registry import MIXER_MODULE_FLAG, describe_symbols, mixers, mtp_symbols
from layers.base.options import SHARED_ROWS, OptionRow

LINEAR_IMPLS = ("local", "te")


def global_rows() -> tuple:
    """hp_megatron's own rows (the pattern, the linears, the CP layout and calibration every mixer reads, the HF
    config, the MTP layer kind); the symbols in their help and choices are the registry's at the time of the call."""
    return (
        OptionRow("--hp-layer-pattern", "hp_layer_pattern", None, str, model=True,
                  help=f"repeating layer pattern over the global layer numbers: {describe_symbols()} "
                       "(e.g. KKKM = Kimi Linear 3:1, GGGA = Qwen3-Next 3:1)"),
        OptionRow("--hp-linear", None, None, str, model=True, default="local", choices=LINEAR_IMPLS,
                  help="column/row-parallel linear classes: megatron-core's (local) or Transformer Engine's (te)"),
        *SHARED_ROWS,
        OptionRow("--hp-hf-config", None, None, str,
                  help="Hugging Face config.json (or a checkpoint directory holding one) of a supported architecture "
                       "(hp_megatron.models.ARCHITECTURES: qwen3_next, qwen3_5*, deepseek_v3, kimi_linear...): the "
                       "model flags come from it (hp_megatron.models.args.apply_hf_config_to_args; docs/models.md)"),
        OptionRow("--hp-post-norm-layers", "hp_post_norm_symbols", None, str, model=True, preset=True,
                  help="layer symbols whose layers are post-norm: h + norm(mixer(h)), h + norm(mlp(h)) (OLMo 3; "
                       "OLMo-Hybrid: A); dense MLPs only"),
        OptionRow("--hp-qk-norm-scope", "hp_qk_norm_scope", None, str, model=True, default="head",
                  choices=("head", "projection"), optional=False, preset=True,
                  help="the q/k RMSNorms of A layers (--qk-layernorm) over each head (megatron-core's) or over the "
                       "whole q / k projection (OLMo 2 / 3, OLMo-Hybrid; TP all-reduces the sum of squares)"),
        OptionRow("--hp-mtp-layer-symbol", "hp_mtp_layer_symbol", None, str, model=True, choices=mtp_symbols(),
                  preset=True,
                  help="the mixer of the multi-token-prediction layers (--mtp-num-layers) under a layer pattern with "
                       "several symbols (M=MLA, A=attention: megatron-core's MTP layer is an attention layer); None: "
                       "the spec's declared kind or the pattern's only symbol; a spec declaring another kind is an "
                       "error"),
    )


def flag_groups() -> list:
    """``[(group title, rows)]``: hp_megatron's rows, then each registered mixer's rows not listed before."""
    groups, listed = [("hp_megatron (layer pattern, linears, CP layout, presets)", global_rows())], set()
    listed.update((r.flag, r.field) for r in groups[0][1])
    own = {name for r in groups[0][1] for name in (r.flag, r.field) if name is not None}
    for entry in mixers().values():
        rows = []
        for row in entry.options:   # a row shared by several mixers (GDN and KDA: the delta rows) is listed once
            taken = sorted({row.flag, row.field} & own - {None}) if row not in groups[0][1] else []
            if taken:
                raise ValueError(f"mixer {entry.name!r}: {taken} belong to hp_megatron's own flag table rows")
            if (row.flag, row.field) not in listed:
                listed.add((row.flag, row.field))
                rows.append(row)
        if rows:
            groups.append((f"hp_megatron: {entry.title} layers ({entry.symbol})", rows))
    return groups


def flag_table() -> tuple:
    """Every row, in :func:`flag_groups` order."""
    return tuple(row for _, rows in flag_groups() for row in rows)


def model_flag_dests() -> tuple:
    """The ``args`` names of the flags that define the model (``OptionRow.model``)."""
    return tuple(row.dest for row in flag_table() if row.model and row.flag is not None)


def given_on_command_line(argv, flag: str) -> bool:
    """Whether ``flag`` (``--name``, or its args dest ``name_with_underscores``) is on ``argv`` (``--name V`` or
    ``--name=V``; Megatron-LM and the example turn abbreviations off)."""
    if not flag.startswith("--"):
        flag = "--" + flag.replace("_", "-")
    return any(arg == flag or arg.startswith(flag + "=") for arg in argv)


def preset_flag_fields() -> dict:
    """``{args name: config field}`` of the flags ``--hp-hf-config``'s architecture decides (``OptionRow.preset``)."""
    return {row.dest: row.field for row in flag_table() if row.preset and row.flag is not None}


def markdown_table() -> str:
    """docs/usage.md's table of the ``--hp-*`` flags: flag, config field, mixer keyword, type, model, default,
    meaning."""
    lines = ["| flag | config field | mixer keyword | type | model | default | meaning |",
             "|---|---|---|---|---|---|---|",
             f"| `{MIXER_MODULE_FLAG} MODULE` (repeatable) | | | str | | | import MODULE first: it registers mixers of "
             "its own (`hp_megatron.registry.register_mixer`), whose pattern symbols and flags then exist "
             "(docs/architecture.md, \"How to add a mixer\") |"]
    for row in flag_table():
        if row.flag is None:
            continue
        flag = f"`{row.flag}`" + (f" `{{{','.join(row.choices)}}}`" if row.choices else "")
        default = "" if row.default is None else f"`{row.default}`"
        if row.comm_type is not None:   # hp_megatron.cp_choice: not given -> --cp-comm-type, else the rule's default
            default = f"not given: `--cp-comm-type` if given, else `{row.comm_type.default}`"
        if row.type is bool and row.default is True:   # argparse.BooleanOptionalAction: on by default
            flag += f" / `--no-{row.flag[2:]}`"
        cells = [flag, f"`{row.field}`" if row.field else "", f"`{row.keyword}`" if row.keyword else "",
                 row.type.__name__, "yes" if row.model else "", default, row.help.replace("|", "\\|")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
