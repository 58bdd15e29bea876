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

from hp_megatron.mixers import (MIXER_MODULE_FLAG, describe_symbols, load_mixer_modules, mixer_modules_in, mixers,
                                mtp_symbols, option_rows, symbols, symbols_where)
from layers.base.choices import BACKENDS, CP_LAYOUTS, ROPE_TYPES
from layers.base.choices import CP_METHOD_CHOICES as CP_METHODS
from layers.base.choices import MLA_CP_STRATEGY_CHOICES as MLA_CP_METHODS
from layers.cp.auto import MEASURE_TOP
from layers.cp.subgroups import check_auto_leaves_free


def _positive(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _non_negative(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def _row_type(row):
    """The argparse ``type`` of a flag-table row: its type, with its check as an ``ArgumentTypeError``."""
    def parse(text):
        value = row.type(text)
        problem = row.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(f"{row.flag} {problem}, got {text}")
        return value
    return parse


def add_row_arguments(group, rows) -> None:
    """One flag per flag-table row (``layers.base.options.OptionRow``): ``store_true`` for a bool."""
    for row in rows:
        if row.type is bool:
            group.add_argument(row.flag, action="store_true", help=row.help)
        else:
            group.add_argument(row.flag, type=_row_type(row), default=row.default, choices=row.choices,
                               help=row.help)


def add_hp_arguments(parser: argparse.ArgumentParser, argv=None) -> argparse.ArgumentParser:
    """Add the ``--hp-*`` flags and return the parser: first ``--hp-mixer-module MODULE`` (repeatable), whose
    modules (read from ``argv``, default ``sys.argv[1:]``) are imported now so that their mixers' symbols and flags
    exist when the rest is added and parsed; then our flags (one group) and one group per registered mixer that
    declares flags of its own (``MixerEntry.options``)."""
    load_mixer_modules(mixer_modules_in(sys.argv[1:] if argv is None else argv))
    g = parser.add_argument_group("hp_megatron (GDN / KDA / MLA layers)")
    g.add_argument(MIXER_MODULE_FLAG, action="append", default=[], metavar="MODULE",
                   help="import MODULE before the flags are checked: it registers mixers of its own "
                        "(hp_megatron.mixers.register_mixer; their pattern symbols and flags); repeatable")
    g.add_argument("--hp-layer-pattern", default=None,
                   help=f"repeating layer pattern over the global layer numbers: {describe_symbols()} "
                        "(e.g. KKKM = Kimi Linear 3:1, GGGA = Qwen3-Next 3:1)")
    g.add_argument("--hp-backend", choices=BACKENDS, default="eager",
                   help="kernel backend of the GDN/KDA mixers: eager (PyTorch), triton (flash-linear-attention), "
                        "ascendc (fla-npu)")
    g.add_argument("--hp-linear", choices=("local", "te"), default="local",
                   help="column/row-parallel linear classes: megatron-core's (local) or Transformer Engine's (te)")
    g.add_argument("--hp-cp-method", choices=CP_METHODS, default="allgather",
                   help="context-parallel method of the GDN/KDA layers; auto: the fastest for this CP group and "
                        "layer shape from a calibrated cost model (docs/cp.md, section 3)")
    g.add_argument("--hp-cp-calibration", default=None, metavar="PATH",
                   help="with --hp-cp-method auto: JSON file caching the CP group's calibration (keyed by world "
                        "layout and hardware); reused when it holds this layout, else measured and saved there")
    g.add_argument("--hp-cp-auto-measure", type=_non_negative, default=None, metavar="N",
                   help="with --hp-cp-method auto: time the cost model's N fastest candidates on each GDN/KDA layer "
                        f"shape at its first forward and take the fastest (default {MEASURE_TOP}; 0: the model "
                        "decides alone)")
    g.add_argument("--hp-cp-layout", choices=CP_LAYOUTS, default="zigzag",
                   help="token layout over CP ranks: zigzag (Megatron's load-balanced split) or contiguous")
    g.add_argument("--hp-cp-group-size", type=_positive, default=None,
                   help="group size g of the grouped_allgather_p2p method (divides the CP size)")
    g.add_argument("--hp-ulysses-degree", type=_positive, default=None,
                   help="hybrid CP: all-to-all over this many ranks, state passing across the rest")
    g.add_argument("--hp-mla-cp", choices=MLA_CP_METHODS, default="latent",
                   help="context-parallel strategy of the MLA layers (auto: from the calibrated cost model)")
    g.add_argument("--hp-linear-num-key-heads", type=_positive, default=None,
                   help="GDN/KDA query/key heads H (default: --num-attention-heads)")
    g.add_argument("--hp-linear-num-value-heads", type=_positive, default=None,
                   help="GDN/KDA value heads HV, a multiple of H (default: H)")
    g.add_argument("--hp-linear-key-head-dim", type=_positive, default=None,
                   help="GDN/KDA key head dim K (default: hidden / heads)")
    g.add_argument("--hp-linear-value-head-dim", type=_positive, default=None,
                   help="GDN/KDA value head dim V (default: K)")
    g.add_argument("--hp-linear-conv-kernel-dim", type=_positive, default=4, help="short convolution width")
    g.add_argument("--hp-kda-lower-bound", type=float, default=None,
                   help="KDA gate lower bound (negative): g = lower_bound * sigmoid(exp(A_log) (g + dt_bias))")
    g.add_argument("--hp-kda-gate-low-rank-dim", type=_positive, default=None,
                   help="KDA forget/output-gate low-rank dim (default: the value head dim, as Kimi Linear)")
    g.add_argument("--hp-kda-safe-gate", action="store_true", help="KDA safe gate (needs a lower bound in [-5, 0))")
    g.add_argument("--hp-mla-q-lora-rank", type=_positive, default=None, help="MLA query LoRA rank (None: no q down-proj)")
    g.add_argument("--hp-mla-kv-lora-rank", type=_positive, default=None, help="MLA KV latent rank (default max(hidden/2, 16))")
    g.add_argument("--hp-mla-qk-head-dim", type=_positive, default=None, help="MLA no-rope q/k head dim")
    g.add_argument("--hp-mla-qk-pos-emb-head-dim", type=_positive, default=None, help="MLA rope q/k head dim")
    g.add_argument("--hp-mla-v-head-dim", type=_positive, default=None, help="MLA value head dim")
    g.add_argument("--hp-hf-config", default=None,
                   help="Hugging Face config.json (or a checkpoint directory holding one) of a supported architecture "
                        "(qwen3_next, deepseek_v3, kimi_linear): the model flags come from it "
                        "(hp_megatron.models.args.apply_hf_config_to_args; docs/models.md)")
    g.add_argument("--hp-mla-rope-type", choices=ROPE_TYPES, default="rope",
                   help="MLA rotary embedding (none = NoPE, as Kimi Linear's MLA layers)")
    g.add_argument("--hp-mtp-layer-kind", choices=mtp_symbols(), default=None,
                   help="the mixer of the multi-token-prediction layers (--mtp-num-layers) under a layer pattern with "
                        "several symbols (M=MLA, A=attention: megatron-core's MTP layer is an attention layer); None: "
                        "the spec's declared kind or the pattern's only symbol")
    for entry in mixers().values():
        if entry.options:
            add_row_arguments(parser.add_argument_group(f"hp_megatron: {entry.title} layers ({entry.symbol})"),
                              entry.options)
    return parser


def hp_config_from_args(args) -> dict:
    """``{config field: value}`` that our layers read, from parsed args (defaults from the model size).

    GDN/KDA read megatron-core 0.16's ``linear_*`` names and our ``delta_*`` / ``kda_*`` names; MLA reads
    ``MLATransformerConfig``'s names and ``mla_cp_strategy``; every mixer reads ``hp_cp_layout`` and
    ``hp_cp_calibration``;
    ``HybridLayer`` reads ``hp_layer_pattern``. All are fields of ``hp_megatron.config``'s classes.
    """
    heads, hidden = args.num_attention_heads, args.hidden_size
    key_heads = args.hp_linear_num_key_heads or heads
    key_dim = args.hp_linear_key_head_dim or hidden // key_heads
    value_heads = args.hp_linear_num_value_heads or key_heads
    if value_heads % key_heads:
        raise ValueError(f"--hp-linear-num-value-heads {value_heads} must be a multiple of the key heads {key_heads}")
    calibration = getattr(args, "hp_cp_calibration", None)
    if calibration and "auto" not in (args.hp_cp_method, args.hp_mla_cp):
        raise ValueError(f"--hp-cp-calibration {calibration} needs --hp-cp-method auto or --hp-mla-cp auto "
                         f"(got {args.hp_cp_method!r} / {args.hp_mla_cp!r})")
    measure = getattr(args, "hp_cp_auto_measure", None)
    if measure is not None and args.hp_cp_method != "auto":
        raise ValueError(f"--hp-cp-auto-measure {measure} needs --hp-cp-method auto (got {args.hp_cp_method!r}); "
                         "only auto times candidates on the layers")
    if args.hp_kda_lower_bound is not None and args.hp_kda_lower_bound >= 0:
        raise ValueError(f"--hp-kda-lower-bound must be negative, got {args.hp_kda_lower_bound}")
    from hp_megatron.config import split_recompute_modules

    split_recompute_modules(args)   # --recompute-modules' hp_* names -> args.hp_recompute_modules
    fields = {
        "hp_layer_pattern": args.hp_layer_pattern,
        "hp_recompute_modules": tuple(getattr(args, "hp_recompute_modules", ())),
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": key_dim,
        "linear_value_head_dim": args.hp_linear_value_head_dim or key_dim,
        "linear_conv_kernel_dim": args.hp_linear_conv_kernel_dim,
        "delta_backend": args.hp_backend,
        "delta_cp_method": args.hp_cp_method,
        "hp_cp_layout": args.hp_cp_layout,
        "delta_cp_group_size": args.hp_cp_group_size,
        "delta_cp_ulysses_degree": args.hp_ulysses_degree,
        "hp_cp_calibration": calibration,
        "delta_cp_auto_measure": MEASURE_TOP if measure is None else measure,
        "kda_lower_bound": args.hp_kda_lower_bound,
        "kda_gate_low_rank_dim": args.hp_kda_gate_low_rank_dim,
        "kda_safe_gate": args.hp_kda_safe_gate,
        "mla_cp_strategy": args.hp_mla_cp,
        "q_lora_rank": args.hp_mla_q_lora_rank,
        "kv_lora_rank": args.hp_mla_kv_lora_rank or max(hidden // 2, 16),
        "qk_head_dim": args.hp_mla_qk_head_dim or hidden // heads,
        "qk_pos_emb_head_dim": args.hp_mla_qk_pos_emb_head_dim or max(hidden // heads // 2, 8),
        "v_head_dim": args.hp_mla_v_head_dim or hidden // heads,
        "rope_type": args.hp_mla_rope_type,
        "hp_mtp_layer_kind": getattr(args, "hp_mtp_layer_kind", None),
    }
    fields.update({row.field: getattr(args, row.dest, row.default) for row in option_rows()})
    if getattr(args, "rotary_base", None) is not None:   # --rotary-base: the MLA layers' RoPE base too
        fields["rotary_base"] = float(args.rotary_base)
    return fields


def validate_hp_args(args) -> None:
    """Check the ``--hp-*`` flags against each other and Megatron's parallel sizes, before anything is built.

    Reads ``context_parallel_size``, ``tensor_model_parallel_size``, ``seq_length`` and
    ``num_attention_heads`` from ``args`` (Megatron-LM's names). Raises ValueError naming the flags and
    values; the same checks the layers make later, stated in flag names.
    """
    from hp_megatron.hybrid_layer import validate_pattern

    pattern = args.hp_layer_pattern or ""
    try:
        if args.hp_layer_pattern is not None:
            validate_pattern(pattern, symbols())
    except ValueError:
        modules = f"; {MIXER_MODULE_FLAG} loads a mixer module" if not getattr(args, "hp_mixer_module", None) else ""
        raise ValueError(f"--hp-layer-pattern {args.hp_layer_pattern!r} uses letters outside "
                         f"{''.join(sorted(symbols()))} ({describe_symbols()}{modules})") from None
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
                         f"rotary embedding, which assumes the zigzag CP layout; got --hp-cp-layout {args.hp_cp_layout}")
    if args.hp_cp_method == "auto":
        check_auto_leaves_free(args.hp_cp_group_size, args.hp_ulysses_degree,
                               flags=("--hp-cp-group-size", "--hp-ulysses-degree"))
    ulysses = cp if args.hp_cp_method == "ulysses" else (args.hp_ulysses_degree or 1)
    if args.hp_cp_method == "ulysses" and args.hp_ulysses_degree not in (None, cp):
        raise ValueError(f"--hp-cp-method ulysses uses all --context-parallel-size {cp} ranks; drop "
                         f"--hp-ulysses-degree {args.hp_ulysses_degree} or set it to {cp}")
    if cp % ulysses:
        raise ValueError(f"--hp-ulysses-degree {ulysses} must divide --context-parallel-size {cp}")
    state_ranks = cp // ulysses
    if args.hp_cp_method == "grouped_allgather_p2p":
        if args.hp_cp_group_size is None:
            raise ValueError("--hp-cp-method grouped_allgather_p2p needs --hp-cp-group-size (ranks per "
                             f"all-gather group, a divisor of {state_ranks})")
        if state_ranks % args.hp_cp_group_size:
            raise ValueError(f"--hp-cp-group-size {args.hp_cp_group_size} must divide the state-passing ranks "
                             f"{state_ranks} (--context-parallel-size {cp} / Ulysses degree {ulysses})")
    elif args.hp_cp_group_size is not None:
        raise ValueError(f"--hp-cp-group-size is only used by --hp-cp-method grouped_allgather_p2p, got it with "
                         f"--hp-cp-method {args.hp_cp_method}")
    delta = set(symbols_where(lambda e: e.family == "delta"))
    linear = set(pattern) & delta if pattern else delta
    for flag, heads in (("--hp-linear-num-key-heads", fields["linear_num_key_heads"]),
                        ("--hp-linear-num-value-heads", fields["linear_num_value_heads"])):
        if linear and (heads % tp or (heads // tp) % ulysses):
            raise ValueError(f"GDN/KDA heads {heads} ({flag}, default --num-attention-heads) must be divisible "
                             f"by --tensor-model-parallel-size {tp} x Ulysses degree {ulysses}")


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
        from hp_megatron.models import preset_from_hf

        preset = preset_from_hf(args.hp_hf_config)
        ours.update(preset.mixer_fields, hp_layer_pattern=preset.pattern)
    return hybrid_config(config, **ours)
