"""Delta-rule kinds: one descriptor per gated delta rule (GDN, KDA) and the registry every layer reads.

A kind is the recurrence ``S_t = (I - b_t k_t k_t^T) D_t S_{t-1} + b_t k_t v_t^T``, ``o_t = scale S_t^T q_t``
(D_t = exp(g_t) the decay) with what the ops, the CP engine, its calibration and cost model, and the decode
path need to know of it. Every kind keeps the state ``[N, HV, K, V]`` fp32 and is linear in it, so its segment
summary (what context parallelism exchanges) is affine, ``S_out = M S_in + E`` with M ``[K, K]`` per value
head (``layers/ops/summary.py``); a recurrence without that form is not a delta-rule kind.

A kind declares:
- ``op``: its chunked op's function name in ``layers.ops``, in every backend module (``layers/ops/backends.py``:
  the eager backend's generic math included) and in flash-linear-attention's public API;
- ``gate_per_channel``: the log decay g (and the gate dt_bias) per value head, ``[..., HV]`` with D_t = exp(g_t) I
  (GDN), or per key channel, ``[..., HV, K]`` with D_t = Diag(exp(g_t)) (KDA);
- ``gate``: the in-kernel gate (``use_gate_in_kernel``) ``(g, A_log, dt_bias, lower_bound) -> g`` fp32
  (``layers/ops/gates.py``); ``lower_bound_gate``: the gate also has the ``lower_bound * sigmoid`` form (keywords
  ``lower_bound`` / ``safe_gate``; A_log may then be None); without it A_log is required;
- ``kernels``: the vendor kernels per backend (triton: FLA ``module:function`` paths; ascendc: fla-npu operator
  names and the API group of ``layers/ops/ascendc/runtime.API`` that holds them); tests/ops/test_kinds.py and
  tests/backends/test_fla_pins.py check they exist.

Code that differs per kind reads these attributes; a backend's per-kind glue (different vendor kernel sequences)
sits in a table keyed by descriptor and is found with :meth:`DeltaKind.pick`, which refuses a kind the backend
does not serve. ``delta_kind(name)`` is the lookup; no other module compares kind names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

from layers.ops.gates import gdn_gate, kda_gate


@dataclass(frozen=True, eq=False)   # eq=False: compared and hashed by identity (one registered object per kind)
class DeltaKind:
    """One delta-rule kind (module doc); registered with :func:`register`, looked up with :func:`delta_kind`."""

    name: str
    op: str
    gate_per_channel: bool
    gate: Callable
    lower_bound_gate: bool
    kernels: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def __post_init__(self):
        frozen = MappingProxyType({b: MappingProxyType(dict(names)) for b, names in self.kernels.items()})
        object.__setattr__(self, "kernels", frozen)

    @property
    def label(self) -> str:
        """The name in messages: ``GDN``."""
        return self.name.upper()

    def gate_shape(self, HV: int, K: int) -> tuple:
        """Per-token shape of g: ``(HV,)`` or ``(HV, K)``."""
        return (HV, K) if self.gate_per_channel else (HV,)

    def gate_width(self, HV: int, K: int) -> int:
        """Elements of g per token (and of dt_bias): HV or HV * K."""
        return HV * K if self.gate_per_channel else HV

    def dt_bias_shape(self, HV: int, K: int) -> tuple:
        """Shape of the in-kernel gate's dt_bias: ``(HV,)`` or ``(HV * K,)`` (value heads outermost)."""
        return (self.gate_width(HV, K),)

    def state_shape(self, N: int, HV: int, K: int, V: int) -> tuple:
        """Shape of the recurrent state of N sequences (fp32): ``(N, HV, K, V)``."""
        return (N, HV, K, V)

    def decay(self, g):
        """The state's decay factor exp(g) from g ``[..., HV]`` or ``[..., HV, K]``, broadcastable against states
        ``[..., HV, K, V]``: ``[..., HV, 1, 1]`` or ``[..., HV, K, 1]``."""
        e = g.exp()
        return e[..., None] if self.gate_per_channel else e[..., None, None]

    def backend_op(self, impl):
        """The backend module ``impl``'s function for this kind's op (ValueError if it has none)."""
        fn = getattr(impl, self.op, None)
        if fn is None:
            raise ValueError(f"backend module {impl.__name__} has no {self.op} (delta-rule kind {self.name!r})")
        return fn

    def kernel(self, backend: str, role: str) -> str:
        """The vendor kernel name of ``role`` on ``backend`` (ValueError naming what the kind declares)."""
        names = self.kernels.get(backend, {})
        if role not in names:
            raise ValueError(f"delta-rule kind {self.name!r} names no {role!r} kernel for backend={backend!r} "
                             f"(it names {sorted(names)})")
        return names[role]

    def pick(self, table: Mapping, who: str):
        """``table[self]``: a backend's code for this kind; ValueError naming the kinds ``who`` serves otherwise."""
        try:
            return table[self]
        except KeyError:
            raise ValueError(f"{who} has no kernels for delta-rule kind {self.name!r} (it serves "
                             f"{', '.join(k.name for k in table)})") from None


_REGISTRY: dict[str, DeltaKind] = {}


def register(kind: DeltaKind) -> DeltaKind:
    """Add ``kind`` to the registry (ValueError if its name is taken); returns it."""
    if not isinstance(kind, DeltaKind):
        raise TypeError(f"register takes a DeltaKind, got {type(kind).__name__}")
    if kind.name in _REGISTRY:
        raise ValueError(f"delta-rule kind {kind.name!r} is already registered")
    _REGISTRY[kind.name] = kind
    return kind


def known_kinds() -> tuple[str, ...]:
    """Names of the registered kinds, in registration order."""
    return tuple(_REGISTRY)


def delta_kind(kind) -> DeltaKind:
    """The registered descriptor of ``kind`` (a name or a registered DeltaKind); ValueError naming the known kinds."""
    name = kind.name if isinstance(kind, DeltaKind) else kind
    found = _REGISTRY.get(name) if isinstance(name, str) else None
    if found is None or (isinstance(kind, DeltaKind) and found is not kind):
        raise ValueError(f"unknown delta-rule kind {name!r}; known kinds: {', '.join(_REGISTRY)}")
    return found


def _gdn_gate(g, A_log, dt_bias, lower_bound=None):
    return gdn_gate(g, A_log, dt_bias)   # GDN has no lower_bound form (the ops refuse one)


GDN = register(DeltaKind(
    name="gdn", op="chunk_gated_delta_rule", gate_per_channel=False, gate=_gdn_gate, lower_bound_gate=False,
    kernels={
        "triton": {"chunk": "fla.ops.gated_delta_rule:chunk_gated_delta_rule",
                   "step": "fla.ops.gated_delta_rule:fused_recurrent_gated_delta_rule",
                   "gate_cumsum": "fla.ops.gated_delta_rule.gate:gdn_gate_chunk_cumsum"},
        "ascendc": {"api": "gdn", "chunk": "chunk_gated_delta_rule_fwd", "step_api": "decode_gdn",
                    "step": "recurrent_gated_delta_rule"},
    }))

KDA = register(DeltaKind(
    name="kda", op="chunk_kda", gate_per_channel=True, gate=kda_gate, lower_bound_gate=True,
    kernels={
        "triton": {"chunk": "fla.ops.kda:chunk_kda", "step": "fla.ops.kda:fused_recurrent_kda",
                   "gate_cumsum": "fla.ops.kda.gate:kda_gate_chunk_cumsum"},
        "ascendc": {"api": "kda", "chunk": "chunk_kda_fwd_prepare", "step_api": "decode_kda",
                    "step": "recurrent_kda"},
    }))
