"""The options of the GDN/KDA mixers: where each is read from, its default, and their checks.

An option comes, in this order of precedence, from a constructor keyword (``ModuleSpec.params``), from a field of
the config (megatron-core 0.16's ``linear_*`` fields, or our own ``hp_cp_layout`` / ``hp_cp_calibration`` /
``delta_*`` / ``kda_*`` fields, declared by ``hp_megatron.config.HybridTransformerConfig``; read with ``getattr``,
so a plain ``TransformerConfig`` works too) and from its default; see :data:`COMMON_OPTIONS` and
``docs/layers.md``. Options that only ``cp_method="auto"`` reads are refused as keywords without it.
"""
from __future__ import annotations

from dataclasses import dataclass

from layers.base.choices import CP_METHOD_CHOICES as CP_METHODS
from layers.cp.auto import MEASURE_TOP
from layers.cp.subgroups import check_auto_leaves_free

DEFAULT_CP_METHOD = "allgather"
# megatron's --cp-comm-type values -> our CP methods (used when no method is configured explicitly)
CP_COMM_TYPE_METHODS = {"p2p": "p2p", "all_gather": "allgather", "a2a": "ulysses", "a2a+p2p": "p2p"}

_REQUIRED = object()


@dataclass(frozen=True)
class Option:
    """One mixer option: the config attributes it may be read from and its default."""

    config_attrs: tuple = ()
    default: object = None


COMMON_OPTIONS = {
    "num_key_heads": Option(("linear_num_key_heads",), _REQUIRED),
    "num_value_heads": Option(("linear_num_value_heads",), None),  # None -> num_key_heads
    "key_head_dim": Option(("linear_key_head_dim",), _REQUIRED),
    "value_head_dim": Option(("linear_value_head_dim",), None),  # None -> key_head_dim
    "conv_kernel_dim": Option(("linear_conv_kernel_dim",), 4),
    "conv_bias": Option(("linear_conv_bias",), False),
    "conv_init": Option((), None),  # None -> U(-1/sqrt(W), 1/sqrt(W)), nn.Conv1d's default
    "A_init_range": Option((), (1.0, 16.0)),
    "norm_eps": Option((), None),  # None -> config.layernorm_epsilon
    "backend": Option(("delta_backend",), "eager"),
    "cp_method": Option(("delta_cp_method",), None),  # None -> cp_comm_type mapping, else DEFAULT_CP_METHOD
    "cp_layout": Option(("hp_cp_layout",), "zigzag"),
    "cp_group_size": Option(("delta_cp_group_size",), None),
    "cp_ulysses_degree": Option(("delta_cp_ulysses_degree",), None),
    "cp_calibration": Option(("hp_cp_calibration",), None),  # cp_method="auto": calibration JSON cache path
    "cp_auto_measure": Option(("delta_cp_auto_measure",), MEASURE_TOP),  # auto: best candidates timed on the layer
    "init_seed": Option(("delta_init_seed",), None),  # None -> torch.initial_seed()
}


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
    """``(method, ulysses_degree)``: the ``cp_method`` option, else megatron's ``cp_comm_type`` mapped
    (``CP_COMM_TYPE_METHODS``; ``a2a+p2p`` takes its Ulysses degree from
    ``config.hierarchical_context_parallel_sizes``), else ``DEFAULT_CP_METHOD``."""
    method, degree = opts["cp_method"], opts["cp_ulysses_degree"]
    if method is None and cp_comm_type is not None:
        if cp_comm_type not in CP_COMM_TYPE_METHODS:
            raise ValueError(f"{owner}: cp_comm_type must be one of {sorted(CP_COMM_TYPE_METHODS)}, got "
                             f"{cp_comm_type!r}")
        method = CP_COMM_TYPE_METHODS[cp_comm_type]
        if cp_comm_type == "a2a+p2p" and degree is None:
            sizes = getattr(config, "hierarchical_context_parallel_sizes", None)
            if not sizes:
                raise ValueError("cp_comm_type 'a2a+p2p' needs config.hierarchical_context_parallel_sizes "
                                 "(its first entry is the Ulysses degree)")
            degree = int(sizes[0])
    method = method or DEFAULT_CP_METHOD
    if method not in CP_METHODS:
        raise ValueError(f"{owner}: cp_method must be one of {CP_METHODS}, got {method!r}")
    return method, degree


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
