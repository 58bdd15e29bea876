"""The declared config dataclasses of hp_megatron's layers, extending megatron-core's as its own subclasses do.

* :class:`HybridTransformerConfig` (``TransformerConfig``): our fields (:class:`HybridFields`) and the MLA
  layer's dimension / rotary fields (:class:`MLAFields`, taken from ``MLATransformerConfig``'s own field list)
  without ``multi_latent_attention``, so ``GPTModel`` keeps the rotary embedding that ``A`` layers need.
* :class:`HybridMLATransformerConfig` (``MLATransformerConfig``): our fields on megatron's MLA config
  (Megatron-LM's ``--multi-latent-attention``).

``__post_init__`` runs megatron's checks, then checks our fields against ``layers.base.choices`` (ValueError naming
the field and the value). :func:`hybrid_config` turns a built megatron config into the matching declared class.
The layers themselves read these fields with ``getattr``, so a plain ``TransformerConfig`` plus
``ModuleSpec.params`` works too; ``docs/usage.md`` has the field table.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, make_dataclass
from typing import Optional

from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from hp_megatron.decoder.pattern import validate_pattern
from hp_megatron.registry import mixers, option_rows, symbols
from layers.base.choices import RECOMPUTE_MODULES
from layers.cp.auto import MEASURE_TOP

# MLATransformerConfig's own fields that the MLA layer reads; multi_latent_attention stays off (GPTModel would drop
# its rotary embedding), cache_mla_latents is inference-only, normalization is a TransformerConfig field already
_MLA_ONLY_FIELDS = tuple(f for f in fields(MLATransformerConfig)
                         if f.name not in TransformerConfig.__dataclass_fields__
                         and f.name not in ("multi_latent_attention", "cache_mla_latents"))

MLAFields = make_dataclass(
    "MLAFields", [(f.name, f.type, field(default=f.default)) for f in _MLA_ONLY_FIELDS])
MLAFields.__module__ = __name__
MLAFields.__doc__ = ("MLATransformerConfig's MLA fields (same names, types, defaults and meaning) on a config whose "
                     "multi_latent_attention is off: " + ", ".join(f.name for f in _MLA_ONLY_FIELDS) + ".")
MLA_FIELD_NAMES = tuple(f.name for f in _MLA_ONLY_FIELDS)


@dataclass
class HybridFields:
    """hp_megatron's own config fields (a mixin of the two config classes; not usable alone).

    ``None`` means "not set": the layer then uses its ``ModuleSpec.params`` keyword or its default. The GDN/KDA
    shapes are megatron-core's own ``linear_*`` fields of ``TransformerConfig``.
    """

    hp_layer_pattern: Optional[str] = None
    """Layer symbols repeated over the global layer numbers: G=GDN, K=KDA, M=MLA, A=softmax attention
    (``--hp-layer-pattern``; read by ``PatternLayer`` specs without a pattern of their own)."""

    hp_mtp_layer_symbol: Optional[str] = None
    """The layer symbol of the multi-token-prediction layers (``--mtp-num-layers``) of a ``PatternLayer`` spec whose
    pattern has several symbols and declares no MTP kind itself (e.g. ``"A"`` for Qwen3-Next, ``"M"`` for
    DeepSeek-V3; the presets set it). MTP layers have this fixed kind, not the one the pattern gives their layer
    number."""

    hp_post_norm_symbols: Optional[str] = None
    """Layer symbols whose layers are post-norm, ``h + norm(mixer(h))`` and ``h + norm(mlp(h))`` (OLMo 3; OLMo-Hybrid:
    ``"A"``; ``--hp-post-norm-layers``; ``hp_megatron.decoder.post_norm``); None: every layer pre-norm."""

    hp_swiglu_limits: Optional[tuple] = None
    """Per-layer SwiGLU clip of the routed experts and dense MLPs, ``min(silu(gate), L) * clamp(up, -L, L)``, one
    number per layer (0: none; Ling 3.0's ``expert_swiglu_limit_list``; ``hp_megatron.decoder.swiglu_limits``)."""

    hp_shared_swiglu_limits: Optional[tuple] = None
    """The same for the shared experts (Ling 3.0's ``share_expert_swiglu_limit_list``)."""

    hp_qk_norm_scope: str = "head"
    """What the q/k RMSNorms of ``A`` layers normalise: each ``head`` (megatron-core's ``qk_layernorm``) or the whole
    ``projection`` (OLMo 2 / 3; ``--hp-qk-norm-scope``; ``hp_megatron.decoder.qk_norm.ProjectionRMSNorm``)."""

    hp_cp_layout: str = "zigzag"
    """Token layout over the CP ranks of every mixer (GDN, KDA, MLA, attention) and the data path: ``zigzag``
    (Megatron's load-balanced split) or ``contiguous`` (``--hp-cp-layout``)."""

    hp_backend: str = "eager"
    """GDN/KDA kernel backend: ``eager``, ``triton`` (flash-linear-attention) or ``ascendc`` (fla-npu)."""

    delta_cp_method: Optional[str] = None
    """GDN/KDA context-parallel method: ``p2p``, ``allgather``, ``grouped_allgather_p2p``, ``recursive_doubling``,
    ``ulysses`` or ``auto`` (cost model); None: from megatron's ``cp_comm_type``, else ``allgather``."""

    delta_cp_group_size: Optional[int] = None
    """Ranks per all-gather group of ``grouped_allgather_p2p`` (divides the state-passing ranks)."""

    delta_cp_ulysses_degree: Optional[int] = None
    """Hybrid CP: all-to-all over this many ranks, state passing across the rest."""

    hp_cp_calibration: Optional[str] = None
    """With the GDN/KDA CP method or the MLA CP strategy ``auto``: JSON file caching the CP group's calibration
    (``--hp-cp-calibration``; an error without either ``auto``)."""

    delta_cp_auto_measure: int = MEASURE_TOP
    """With the CP method ``auto``: how many of the cost model's fastest candidates a GDN/KDA layer times on
    itself before choosing (0: the model decides alone; another value than the default is an error without
    ``delta_cp_method="auto"``)."""

    delta_init_seed: Optional[int] = None
    """Base seed of the GDN/KDA layout-independent initialisation (None: ``torch.initial_seed()``)."""

    delta_norm_eps: Optional[float] = None
    """Epsilon of the GDN/KDA output norm (None: ``layernorm_epsilon``; OLMo-Hybrid: 1e-5, FLA's default, beside
    ``rms_norm_eps`` 1e-6)."""

    linear_conv_bias: bool = False
    """Bias in the GDN/KDA short convolution."""

    gdn_allow_neg_eigval: bool = False
    """GDN beta = 2 sigmoid(b) in (0, 2) (OLMo-Hybrid's ``linear_allow_neg_eigval``); False: sigmoid(b)."""

    kda_gate_low_rank_dim: Optional[int] = None
    """KDA forget/output-gate low-rank dim (None: the value head dim, as Kimi Linear)."""

    kda_lower_bound: Optional[float] = None
    """KDA gate lower bound (negative): ``g = lower_bound * sigmoid(exp(A_log) (g + dt_bias))``; None: log-sigmoid
    gate."""

    kda_safe_gate: bool = False
    """KDA safe gate (needs ``kda_lower_bound`` in [-5, 0))."""

    kda_full_rank_gates: bool = False
    """KDA forget / output gates at full rank, parts of ``in_proj`` (Ling 3.0's ``f_proj`` / ``g_proj``); False: Kimi
    Linear's low-rank ``gate_down_proj`` + up-projections."""

    kda_output_gate_bias: bool = False
    """Bias of the KDA output-gate up-projection (Kimi Linear: False; FLA's layer: True)."""

    gated_norm_zero_centered_gamma: Optional[bool] = None
    """GDN/KDA output norm stores ``weight - 1`` (None: follow ``layernorm_zero_centered_gamma``; Qwen3-Next:
    False, its GDN norm is plain while its other norms are zero-centred)."""

    mla_output_gate: bool = False
    """MLA head-wise sigmoid output gate (Ling 3.0's ``g_proj``: ``linear_gate_proj.weight [heads, hidden]``)."""

    mla_cp_strategy: Optional[str] = None
    """MLA context-parallel strategy: ``latent``, ``latent_ulysses``, ``expanded_ulysses`` or ``auto``; None: from
    megatron's ``cp_comm_type``, else ``latent``."""

    hp_recompute_modules: tuple = ()
    """Our parts recomputed in backward when ``recompute_granularity`` is ``"selective"``
    (``layers.base.choices.RECOMPUTE_MODULES``): ``--recompute-modules``' ``hp_*`` names, moved here from
    ``recompute_modules`` before megatron-core checks its own names (:func:`split_recompute_modules`)."""

    def __post_init__(self):
        split_recompute_modules(self)  # megatron-core refuses names it does not know
        super().__post_init__()  # megatron-core's checks (the next class in the MRO)
        check_hybrid_fields(self)


# megatron-core 0.16's TransformerConfig.recompute_modules names (its __post_init__ refuses any other)
MEGATRON_RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
# megatron-core 0.19's names for what our layers recompute as their own parts: its GatedDeltaNet's output norm is
# the gated norm of our GDN / KDA (a user of megatron-core's GDN keeps their flag)
RECOMPUTE_ALIASES = {"gdn_norm_out": "hp_gated_norm"}


def split_recompute_modules(holder) -> None:
    """Move our names (``layers.base.choices.RECOMPUTE_MODULES``) from ``holder.recompute_modules`` to
    ``holder.hp_recompute_modules``, leaving megatron-core's; ``holder`` is a config or Megatron-LM's parsed
    args; megatron-core 0.19's ``gdn_norm_out`` becomes our ``hp_gated_norm`` (:data:`RECOMPUTE_ALIASES`). A name of
    neither raises a one-line ValueError naming the accepted ones. Only our names given: megatron-core recomputes
    none of its modules (its default ``["core_attn"]`` applies only to no names)."""
    names = getattr(holder, "recompute_modules", None)
    if names is None:
        return
    names = [RECOMPUTE_ALIASES.get(n, n) for n in names]
    unknown = [n for n in names if n not in MEGATRON_RECOMPUTE_MODULES + RECOMPUTE_MODULES]
    if unknown:
        raise ValueError(f"--recompute-modules {' '.join(unknown)}: unknown; accepted: megatron-core's "
                         f"{' '.join(MEGATRON_RECOMPUTE_MODULES)}; hp_megatron's {' '.join(RECOMPUTE_MODULES)} "
                         f"({' '.join(f'{a} = {b}' for a, b in RECOMPUTE_ALIASES.items())})")
    ours = tuple(n for n in names if n in RECOMPUTE_MODULES)
    holder.recompute_modules = [n for n in names if n not in RECOMPUTE_MODULES]
    holder.hp_recompute_modules = tuple(dict.fromkeys(tuple(getattr(holder, "hp_recompute_modules", None) or ())
                                                      + ours))


# the fields whose checks are hand-written below (they read the registry's symbols) or megatron-core's own
_OWN_CHECKS = ("hp_layer_pattern", "hp_mtp_layer_symbol")


def _checked_rows(config) -> tuple:
    """The flag-table rows (``hp_megatron.flags``) whose config field :func:`check_hybrid_fields` checks: our fields
    (:class:`HybridFields`), ``rope_type`` (a choice of our MLA layer) and the registered mixers' own fields (not
    fields of the config class); megatron-core's other fields are megatron-core's to check."""
    from hp_megatron.flags import flag_table

    declared = type(config).__dataclass_fields__ if hasattr(type(config), "__dataclass_fields__") else {}
    return tuple(row for row in flag_table() if row.field is not None and row.field not in _OWN_CHECKS
                 and (row.field in HYBRID_FIELD_NAMES or row.field == "rope_type" or row.field not in declared))


def check_hybrid_fields(config) -> None:
    """ValueError naming the field and its value when one of our fields (or ``rope_type``, or a registered mixer's
    field) is out of range: the flag table's types, choices and checks, then the pattern, the MTP kind, the
    recompute names and the fields only ``auto`` reads."""
    owner = type(config).__name__
    for row in _checked_rows(config):
        value = getattr(config, row.field, row.default)
        problem = row.problem(value)
        if problem:
            raise ValueError(f"{owner}.{row.field} {problem}, got {value!r}")
    check_auto_fields(config)
    bad = [n for n in config.hp_recompute_modules or () if n not in RECOMPUTE_MODULES]
    if bad:
        raise ValueError(f"{owner}.hp_recompute_modules {bad}: unknown; accepted: {' '.join(RECOMPUTE_MODULES)}")
    if config.hp_layer_pattern is not None:
        try:
            validate_pattern(config.hp_layer_pattern, symbols())
        except ValueError as err:
            raise ValueError(f"{owner}.hp_layer_pattern {config.hp_layer_pattern!r}: {err}") from None
    unknown = sorted(set(config.hp_post_norm_symbols or "") - set(symbols()))
    if unknown:
        raise ValueError(f"{owner}.hp_post_norm_symbols {config.hp_post_norm_symbols!r}: unknown symbols {unknown}; "
                         f"known: {sorted(symbols())}")
    kind = config.hp_mtp_layer_symbol
    if kind is not None and kind not in symbols():
        raise ValueError(f"{owner}.hp_mtp_layer_symbol must be one of {sorted(symbols())} or None, got {kind!r}")


@dataclass
class HybridTransformerConfig(HybridFields, MLAFields, TransformerConfig):
    """megatron-core ``TransformerConfig`` with hp_megatron's fields and the MLA layer's fields (``MLAFields``;
    ``multi_latent_attention`` stays False, so ``GPTModel`` builds the rotary embedding of ``A`` layers)."""


@dataclass
class HybridMLATransformerConfig(HybridFields, MLATransformerConfig):
    """megatron-core ``MLATransformerConfig`` (``multi_latent_attention`` on) with hp_megatron's fields."""


HYBRID_FIELD_NAMES = tuple(f.name for f in fields(HybridFields))


def hybrid_config(config: TransformerConfig, **overrides):
    """The declared class of ``config`` (:class:`HybridMLATransformerConfig` for an ``MLATransformerConfig``, else
    :class:`HybridTransformerConfig`) holding every field of ``config``, then ``overrides``; the fields the
    class adds start at their defaults.

    A field-wise copy into the subclass, as ``copy.copy`` makes (megatron's ``__post_init__`` is not run again:
    it is not idempotent, e.g. ``enable_cuda_graph`` sets ``cuda_graph_impl`` and then refuses it); only our
    fields are checked (:func:`check_hybrid_fields`). A registered mixer's own config field
    (``MixerEntry.options``, e.g. of a mixer loaded by ``--hp-mixer-module``) is accepted as an attribute. An
    override or attribute that is neither raises TypeError naming it.
    """
    if not isinstance(config, TransformerConfig):
        raise TypeError(f"hybrid_config needs a megatron TransformerConfig, got {type(config).__name__}")
    cls = HybridMLATransformerConfig if isinstance(config, MLATransformerConfig) else HybridTransformerConfig
    known = {**cls.__dataclass_fields__, **{row.field: row for row in option_rows()}}
    carried = vars(config)
    for what, names in (("override", overrides), (f"{type(config).__name__} attribute", carried)):
        unknown = sorted(set(names) - set(known))
        if unknown:
            raise TypeError(f"{cls.__name__} has no field(s) {unknown} ({what})")
    hybrid = cls.__new__(cls)
    hybrid.__dict__.update({f.name: f.default if f.default is not MISSING else f.default_factory()
                            for f in fields(cls) if f.name not in carried})
    hybrid.__dict__.update(carried)
    hybrid.__dict__.update(overrides)
    check_hybrid_fields(hybrid)
    return hybrid


def check_auto_fields(config) -> None:
    """The fields only ``auto`` reads are refused without it (they would be ignored): ``hp_cp_calibration`` needs
    ``delta_cp_method`` or ``mla_cp_strategy`` ``"auto"``; ``delta_cp_auto_measure`` other than its default needs
    ``delta_cp_method="auto"``."""
    owner = type(config).__name__
    auto_fields = tuple(dict.fromkeys(e.cp_auto_field for e in mixers().values() if e.cp_auto_field))
    if config.hp_cp_calibration is not None and "auto" not in (getattr(config, f, None) for f in auto_fields):
        raise ValueError(f"{owner}.hp_cp_calibration {config.hp_cp_calibration!r} needs delta_cp_method or "
                         f"mla_cp_strategy 'auto' (got {config.delta_cp_method!r} / {config.mla_cp_strategy!r})")
    if config.delta_cp_auto_measure != MEASURE_TOP and config.delta_cp_method != "auto":
        raise ValueError(f"{owner}.delta_cp_auto_measure={config.delta_cp_auto_measure} needs delta_cp_method "
                         f"'auto' (got {config.delta_cp_method!r})")
