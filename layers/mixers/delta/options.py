"""The options of the GDN/KDA mixers: where each is read from, its default, and their checks.

An option comes, in this order of precedence, from a constructor keyword (``ModuleSpec.params``), from a field of
the config (megatron-core 0.16's ``linear_*`` fields, or our own ``hp_cp_layout`` / ``hp_cp_calibration`` /
``delta_*`` / ``kda_*`` fields, declared by ``hp_megatron.config.HybridTransformerConfig``; read with ``getattr``,
so a plain ``TransformerConfig`` works too) and from its default; see :data:`COMMON_OPTIONS` and
``docs/layers.md``. Options that only ``cp_method="auto"`` reads are refused as keywords without it.
"""
from __future__ import annotations

from dataclasses import dataclass

from layers.base.choices import BACKENDS, CP_METHOD_CHOICES
from layers.base.options import SHARED_ROWS, CommTypeRule, OptionRow, keyword_attrs
from layers.cp.auto import MEASURE_TOP
from layers.cp.subgroups import check_auto_leaves_free

# The default when neither our option nor a cp_comm_type the user chose decides (docs/cp.md, "Which CP method"):
# allgather works for every head count and TP x CP layout, is deterministic (no timing at start-up, the same method
# on every machine and CP group) and needs no sub-groups; auto would time candidates on the first forward.
DEFAULT_CP_METHOD = "allgather"
# megatron's --cp-comm-type values -> our CP methods (a2a+p2p: Ulysses over hierarchical_context_parallel_sizes[0])
CP_COMM_TYPE_METHODS = {"p2p": "p2p", "all_gather": "allgather", "a2a": "ulysses", "a2a+p2p": "p2p"}
DELTA_CP_RULE = CommTypeRule(tuple(CP_COMM_TYPE_METHODS.items()), DEFAULT_CP_METHOD,
                             hierarchical_degree="cp_ulysses_degree")

_REQUIRED = object()


@dataclass(frozen=True)
class Option:
    """One mixer option: the config attributes it may be read from and its default."""

    config_attrs: tuple = ()
    default: object = None


# the GDN/KDA rows of the flag table (hp_megatron assembles it): flag, config field, keyword, type, checks
DELTA_ROWS = (
    OptionRow("--hp-backend", "hp_backend", "backend", str, model=True, default="eager", choices=BACKENDS,
              optional=False, help="kernel backend of the GDN/KDA mixers: eager (PyTorch), triton "
                                   "(flash-linear-attention), ascendc (fla-npu)"),
    OptionRow("--hp-cp-method", "delta_cp_method", "cp_method", str, comm_type=DELTA_CP_RULE,
              choices=CP_METHOD_CHOICES, help="context-parallel method of the GDN/KDA layers (not given: from a "
              "--cp-comm-type you give, p2p -> p2p, all_gather -> allgather, a2a -> ulysses, a2a+p2p -> Ulysses x p2p; "
              f"else {DEFAULT_CP_METHOD}); auto: the fastest for this CP group and layer shape from a calibrated cost "
              "model (docs/cp.md, section 3)"),
    OptionRow("--hp-cp-auto-measure", "delta_cp_auto_measure", "cp_auto_measure", int, check="non_negative",
              optional=False, help="with --hp-cp-method auto: time the cost model's N fastest candidates on each "
              f"GDN/KDA layer shape at its first forward and take the fastest (default {MEASURE_TOP}; 0: the model "
              "decides alone)"),
    OptionRow("--hp-cp-group-size", "delta_cp_group_size", "cp_group_size", int, check="positive",
              help="group size g of the grouped_allgather_p2p method (divides the CP size)"),
    OptionRow("--hp-cp-ulysses-degree", "delta_cp_ulysses_degree", "cp_ulysses_degree", int, check="positive",
              help="hybrid CP: all-to-all over this many ranks, state passing across the rest"),
    OptionRow("--hp-linear-num-key-heads", "linear_num_key_heads", "num_key_heads", int, model=True, check="positive",
              preset=True, megatron_field=True, help="GDN/KDA query/key heads H (default: --num-attention-heads)"),
    OptionRow("--hp-linear-num-value-heads", "linear_num_value_heads", "num_value_heads", int, model=True,
              check="positive", preset=True, megatron_field=True,
              help="GDN/KDA value heads HV, a multiple of H (default: H)"),
    OptionRow("--hp-linear-key-head-dim", "linear_key_head_dim", "key_head_dim", int, model=True, check="positive",
              preset=True, megatron_field=True, help="GDN/KDA key head dim K (default: hidden / heads)"),
    OptionRow("--hp-linear-value-head-dim", "linear_value_head_dim", "value_head_dim", int, model=True,
              check="positive", preset=True, megatron_field=True, help="GDN/KDA value head dim V (default: K)"),
    OptionRow("--hp-linear-conv-kernel-dim", "linear_conv_kernel_dim", "conv_kernel_dim", int, model=True, default=4,
              check="positive", preset=True, megatron_field=True, help="short convolution width"),
    OptionRow(None, "linear_conv_bias", "conv_bias", bool, optional=False),
    OptionRow(None, "delta_init_seed", "init_seed", int),
    OptionRow(None, "delta_norm_eps", "norm_eps", float, model=True, check="positive"),
    OptionRow(None, "gated_norm_zero_centered_gamma", None, bool),
)

# GDN's own rows (here, not in gdn.py, so that the flag table is read without importing the layers)
GDN_ROWS = (
    OptionRow("--hp-gdn-allow-neg-eigval", "gdn_allow_neg_eigval", "allow_neg_eigval", bool, model=True,
              optional=False, preset=True,
              help="GDN beta = 2 sigmoid(b), in (0, 2): transitions with negative eigenvalues (OLMo-Hybrid; FLA's "
                   "allow_neg_eigval); computed before the op, which takes beta as given"),
)
GDN_DEFAULTS = {"allow_neg_eigval": False}

# KDA's own rows (here, not in kda.py, so that the flag table is read without importing the layers)
KDA_ROWS = (
    OptionRow("--hp-kda-lower-bound", "kda_lower_bound", "lower_bound", float, model=True, check="negative",
              preset=True, help="KDA gate lower bound (negative): g = lower_bound * sigmoid(exp(A_log) (g + dt_bias))"),
    OptionRow("--hp-kda-gate-low-rank-dim", "kda_gate_low_rank_dim", "gate_low_rank_dim", int, model=True,
              check="positive", preset=True,
              help="KDA forget/output-gate low-rank dim (default: the value head dim, as Kimi Linear)"),
    OptionRow("--hp-kda-safe-gate", "kda_safe_gate", "safe_gate", bool, model=True, optional=False, preset=True,
              help="KDA safe gate (needs a lower bound in [-5, 0))"),
    OptionRow(None, "kda_output_gate_bias", "output_gate_bias", bool, optional=False),
    OptionRow("--hp-kda-full-rank-gates", "kda_full_rank_gates", "full_rank_gates", bool, model=True, optional=False,
              preset=True, help="KDA forget and output gates projected from the hidden state at full rank, as parts "
                                "of in_proj (Ling 3.0's f_proj / g_proj), not through Kimi Linear's low-rank pair"),
)
KDA_DEFAULTS = {
    "gate_low_rank_dim": None,  # None -> value_head_dim (Kimi Linear)
    "lower_bound": None,
    "safe_gate": False,
    "output_gate_bias": False,  # Kimi Linear: False; FLA's layer: True
    "full_rank_gates": False,  # Kimi Linear: low rank; Ling 3.0: full rank
}

_DEFAULTS = {  # keyword -> default when neither the keyword nor a config field gives it
    "num_key_heads": _REQUIRED,
    "num_value_heads": None,  # None -> num_key_heads
    "key_head_dim": _REQUIRED,
    "value_head_dim": None,  # None -> key_head_dim
    "conv_kernel_dim": 4,
    "conv_bias": False,
    "conv_init": None,  # None -> U(-1/sqrt(W), 1/sqrt(W)), nn.Conv1d's default
    "A_init_range": (1.0, 16.0),
    "norm_eps": None,  # None -> config.layernorm_epsilon
    "backend": "eager",
    "cp_method": None,  # None -> cp_comm_type mapping, else DEFAULT_CP_METHOD
    "cp_layout": "zigzag",
    "cp_group_size": None,
    "cp_ulysses_degree": None,
    "cp_calibration": None,  # cp_method="auto": calibration JSON cache path
    "cp_auto_measure": MEASURE_TOP,  # auto: best candidates timed on the layer
    "init_seed": None,  # None -> torch.initial_seed()
}


def options_of(rows, defaults: dict) -> dict:
    """``{keyword: Option}``: each keyword read from the config fields its rows declare, else its default."""
    return {name: Option(keyword_attrs(rows, name), default) for name, default in defaults.items()}


COMMON_OPTIONS = options_of(DELTA_ROWS + SHARED_ROWS, _DEFAULTS)


def resolve_options(table: dict, config, overrides: dict, owner: str) -> dict:
    """Resolve every option of ``table``: keyword override, then config attributes, then the default."""
    values = {}
    for name, opt in table.items():
        if name in overrides and overrides[name] is not None:
            values[name] = overrides[name]
            continue
        value = None
        for attr in opt.config_attrs:
            value = getattr(config, attr, None)
            if value is not None:
                break
        if value is None:
            if opt.default is _REQUIRED:
                where = f" or config.{opt.config_attrs[0]}" if opt.config_attrs else ""
                raise ValueError(f"{owner} needs {name}: pass it in ModuleSpec.params{where}")
            value = opt.default
        values[name] = value
    return values


def positive_int(owner, name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")
    return value


AUTO_ONLY_OPTIONS = ("cp_calibration", "cp_auto_measure")   # read only by cp_method="auto"


def resolve_cp_method(owner: str, opts: dict, cp_comm_type, config) -> tuple:
    """``(method, ulysses_degree, source)`` by :data:`DELTA_CP_RULE`: the ``cp_method`` option (keyword, else
    ``config.delta_cp_method``), else megatron's ``cp_comm_type`` of this layer mapped (``CP_COMM_TYPE_METHODS``;
    ``a2a+p2p`` takes its Ulysses degree from ``config.hierarchical_context_parallel_sizes``), else
    ``DEFAULT_CP_METHOD``; ``source`` says which decided."""
    degree = opts["cp_ulysses_degree"]
    method, source = DELTA_CP_RULE.resolve(opts["cp_method"], cp_comm_type, owner)
    if cp_comm_type == "a2a+p2p" and opts["cp_method"] is None and degree is None:
        sizes = getattr(config, "hierarchical_context_parallel_sizes", None)
        if not sizes:
            raise ValueError("cp_comm_type 'a2a+p2p' needs config.hierarchical_context_parallel_sizes "
                             "(its first entry is the Ulysses degree)")
        degree = int(sizes[0])
    if method not in CP_METHOD_CHOICES:
        raise ValueError(f"{owner}: cp_method must be one of {CP_METHOD_CHOICES}, got {method!r}")
    return method, degree, source


def check_cp_auto_options(owner: str, method: str, opts: dict, overrides: dict) -> None:
    """The options of ``cp_method="auto"``: ``cp_auto_measure`` an int >= 0; with auto, no ``cp_group_size`` /
    ``cp_ulysses_degree`` (it chooses them); without auto, no ``cp_calibration`` / ``cp_auto_measure`` keyword
    (it would be ignored). A config field naming a calibration is not refused: the MLA layers' ``auto`` reads it
    too."""
    measure_top = opts["cp_auto_measure"]
    if isinstance(measure_top, bool) or not isinstance(measure_top, int) or measure_top < 0:
        raise ValueError(f"{owner}: cp_auto_measure must be an int >= 0 (candidates timed on the layer; 0: the "
                         f"cost model alone), got {measure_top!r}")
    if method == "auto":
        check_auto_leaves_free(opts["cp_group_size"], opts["cp_ulysses_degree"])
        return
    given = [name for name in AUTO_ONLY_OPTIONS if overrides.get(name) is not None]
    if given:
        raise ValueError(f"{owner}: {', '.join(given)} only apply to cp_method='auto', got cp_method={method!r}")
