"""Cost model of the CP methods: alpha-beta-gamma times from the closed forms of docs/cp.md.

A ``Calibration`` holds, per collective type (``all_gather``, ``send_recv``: every rank exchanging at once,
``all_to_all``, ``relay``: one hand-over between two ranks while the others wait), a fitted line
t = alpha * steps + bytes / beta (alpha in s per sequential step, beta in bytes/s per rank, ``bytes`` received
per rank), the FLOP/s of the fp32 fold matmuls (gamma) and, per kernel shape, the fitted time of the delta-rule
op, of the generic CP path's augmented pass (or a native summary pass) and of the dense projections (also
``LinearFit``s). ``layers.cp.calibration`` measures one on a CP group.

``delta_candidates`` lists every valid CP configuration of a GDN/KDA layer (each state method, grouped with
each group size, each Ulysses degree dividing the heads, the hybrids); ``predict_delta`` gives the forward +
backward time of one layer per rank under a configuration: the exchange (from ``state_scan_comm``), the
sequential folds, the Ulysses all-to-alls and the compute of the slowest rank in the layout (its chunk-padded
local pieces; for the state methods the generic path's V+K-wide pass, or the native summary pass).
``mla_candidates`` / ``predict_mla`` do the same for the MLA strategies. ``benchmarks/cp_comm.py`` evaluates
``state_exchange_seconds`` with fixed constants.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from layers.cp.accounting import state_scan_comm
from layers.ops.kinds import delta_kind

COLLECTIVES = ("all_gather", "send_recv", "all_to_all", "relay")
STATE_SCAN_METHODS = ("p2p", "allgather", "grouped_allgather_p2p", "recursive_doubling")
CHUNK = 64                            # chunk length of the delta-rule kernels (pieces are padded to it)


@dataclass(frozen=True)
class LinearFit:
    """t = alpha * steps + x / beta, fitted on measured times; ``residual`` = RMS relative error. Collectives:
    alpha s per sequential step, x bytes received per rank, beta bytes/s; kernels: alpha s per call, x FLOPs
    (or tokens for the rest of a layer), beta FLOP/s (tokens/s)."""

    alpha: float
    beta: float
    residual: float = 0.0

    def seconds(self, amount: float, steps: float = 1.0) -> float:
        return self.alpha * steps + amount / self.beta


@dataclass
class Calibration:
    """Fitted machine constants of one CP group (see the module docstring); ``key`` names the world layout and
    hardware it was measured on; ``kernels`` maps ``kernel_key(...)`` to the op and projection fits."""

    collectives: dict
    fold_flops: float
    key: str = ""
    kernels: dict = field(default_factory=dict)
    sync: LinearFit | None = None     # straggler cost of a synchronization after x s of compute; None: priced 0

    def fit(self, collective: str) -> LinearFit:
        if collective not in self.collectives:
            raise ValueError(f"calibration has no fit for {collective!r}; it has {sorted(self.collectives)}")
        return self.collectives[collective]

    def to_json(self) -> dict:
        return {"key": self.key, "fold_flops": self.fold_flops,
                "collectives": {k: asdict(v) for k, v in self.collectives.items()},
                "kernels": {k: {n: asdict(f) for n, f in v.items()} for k, v in self.kernels.items()},
                "sync": None if self.sync is None else asdict(self.sync)}

    @classmethod
    def from_json(cls, d: dict) -> "Calibration":
        return cls(collectives={k: LinearFit(**v) for k, v in d["collectives"].items()},
                   fold_flops=float(d["fold_flops"]), key=d.get("key", ""),
                   kernels={k: {n: LinearFit(**f) for n, f in v.items()} for k, v in d.get("kernels", {}).items()},
                   sync=None if d.get("sync") is None else LinearFit(**d["sync"]))

    def sync_seconds(self, syncs: int, compute: float) -> float:
        """Straggler cost of ``syncs`` synchronizations that split ``compute`` seconds into syncs + 1 phases."""
        if self.sync is None or syncs == 0:
            return 0.0
        return syncs * self.sync.seconds(compute / (syncs + 1))


def kernel_key(kind: str, backend: str, k_dim: int, v_dim: int, dtype: str) -> str:
    """Key of a kernel fit: the op and its shape-defining parameters."""
    return f"{kind}/{backend}/K{k_dim}/V{v_dim}/{dtype}"


# -- layer shapes and candidate configurations ----------------------------------------------------------------
@dataclass(frozen=True)
class DeltaLayerShape:
    """What the model needs of a GDN/KDA layer under CP: global tokens and boundaries, TP-local heads.

    kind: a delta-rule kind's name (``layers.ops.kinds``; part of the kernel key).
    seq_len: global T per row (BSHD) or total packed tokens (THD, ``cu_seqlens`` then given, batch 1).
    heads / value_heads: H / HV on this TP rank; hidden: model width (projections); act_bytes: bytes per
    activation element (what Ulysses moves); native_summaries: the backend writes summaries from its own
    factors (triton, ascendc) instead of running the generic extra pass.
    """

    kind: str
    batch: int
    seq_len: int
    heads: int
    value_heads: int
    k_dim: int
    v_dim: int
    layout: str = "zigzag"
    cu_seqlens: tuple | None = None
    hidden: int = 0
    act_bytes: int = 4
    backend: str = "eager"
    dtype: str = "float32"
    native_summaries: bool = False

    def __post_init__(self):
        delta_kind(self.kind)   # ValueError naming the known kinds
        if self.value_heads % self.heads:
            raise ValueError(f"value_heads={self.value_heads} must be a multiple of heads={self.heads}")

    @property
    def kernel(self) -> str:
        return kernel_key(self.kind, self.backend, self.k_dim, self.v_dim, self.dtype)

    @property
    def layer_key(self) -> str:
        """Key of the fit of the rest of the layer (projections, conv, norm, gates) per local token."""
        return f"{self.kernel}/H{self.heads}/HV{self.value_heads}/hidden{self.hidden}/layer"

    def describe(self) -> str:
        docs = "" if self.cu_seqlens is None else f", {len(self.cu_seqlens) - 1} docs"
        return (f"{self.kind.upper()} B={self.batch} T={self.seq_len}{docs} H={self.heads} HV={self.value_heads} "
                f"K={self.k_dim} V={self.v_dim} {self.layout}")


@dataclass(frozen=True)
class Candidate:
    """One CP configuration: the ``build_cp_context`` keywords ``method``, ``group_size``, ``ulysses_degree``."""

    method: str
    group_size: int | None = None
    ulysses_degree: int | None = None

    @property
    def label(self) -> str:
        if self.method == "ulysses":
            return "ulysses"
        name = self.method if self.group_size is None else f"{self.method}(g={self.group_size})"
        return name if self.ulysses_degree is None else f"ulysses{self.ulysses_degree} x {name}"

    def context_kwargs(self) -> dict:
        return {"method": self.method, "group_size": self.group_size, "ulysses_degree": self.ulysses_degree}


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def delta_candidates(world_size: int, heads: int, value_heads: int) -> list:
    """Every valid configuration on P ranks: Ulysses degrees U | P with U | H and U | HV; for Q = P / U > 1 every
    state method and grouped_allgather_p2p with each group size 1 < g < Q (g = 1, Q equal p2p, allgather)."""
    out = []
    for U in _divisors(world_size):
        if heads % U or value_heads % U:
            continue
        Q = world_size // U
        hybrid = U if U > 1 else None
        if Q == 1:
            out.append(Candidate("ulysses"))
            continue
        for method in STATE_SCAN_METHODS:
            if method == "grouped_allgather_p2p":
                out += [Candidate(method, g, hybrid) for g in _divisors(Q) if 1 < g < Q]
            else:
                out.append(Candidate(method, None, hybrid))
    return out


# -- the closed forms -----------------------------------------------------------------------------------------
def state_exchange_seconds(method: str, layout: str, P: int, *, num_chains: int, heads: int, k_dim: int,
                           v_dim: int, calibration: Calibration, group_size: int | None = None) -> float:
    """Forward time of one state scan on P ranks (the backward is the same scan reversed: same time).

    p2p: every hand-over is one message of one state while the other ranks wait (the ``relay`` fit), and the
    walk applies all L maps; allgather: one all-gather of the maps (ceil(log2 P) steps) and up to L - 1 folds;
    grouped: the all-gather over g ranks, the relayed hand-overs between groups and L - 1 folds; recursive
    doubling: ceil(log2 L) rounds in which every rank exchanges with a partner at once (the ``send_recv``
    fit), each composing n maps.
    """
    if P == 1:
        return 0.0
    n = 2 if layout == "zigzag" else 1
    L = n * P
    D, HV, K, V = num_chains, heads, k_dim, v_dim
    costs = [state_scan_comm(method, layout, P, r, num_chains=D, heads=HV, k_dim=K, v_dim=V,
                             group_size=group_size) for r in range(P)]
    recv, steps = max(c["bytes_received"] for c in costs), costs[0]["steps"]
    f_apply = 2 * D * HV * K * K * V / calibration.fold_flops          # X <- M X + E, one position
    f_compose = 2 * D * HV * K * K * (K + V) / calibration.fold_flops  # (M2 M1, M2 E1 + E2)
    s = D * HV * K * V * 4
    ag, sr, relay = calibration.fit("all_gather"), calibration.fit("send_recv"), calibration.fit("relay")
    if method == "p2p":
        return steps * relay.seconds(s) + L * f_apply
    if method == "allgather":
        return ag.seconds(recv, math.ceil(math.log2(P))) + (L - 1) * f_apply
    if method == "grouped_allgather_p2p":
        g = group_size
        gather = (g - 1) * n * D * HV * K * (K + V) * 4
        hops = steps - (g > 1)                  # sequential state hand-overs between groups
        t = hops * relay.seconds(s) + (L - 1) * f_apply
        return t + (ag.seconds(gather, math.ceil(math.log2(g))) if g > 1 else 0.0)
    if method == "recursive_doubling":
        return sr.seconds(recv, steps) + steps * n * f_compose
    raise ValueError(f"unknown state method {method!r}")


def delta_flops(tokens: float, heads: int, k_dim: int, v_dim: int, chunk: int = CHUNK) -> float:
    """Forward FLOPs of the chunked delta rule on ``tokens`` (chunk-padded) tokens and ``heads`` value heads:
    per token, the intra-chunk products (q k^T, k k^T, T k, T v: 2C(3K + V)) and the state terms (W S, the
    update K^T V_new, the output q S: 6 K V)."""
    return tokens * heads * (2 * chunk * (3 * k_dim + v_dim) + 6 * k_dim * v_dim)


def _padded(pieces, chunk: int = CHUNK) -> int:
    return sum(-(-int(p) // chunk) * chunk for p in pieces if p > 0)


def _eager_chunk(pieces) -> int:
    """The eager kernels' chunk for these pieces."""
    from layers.ops.eager.chunking import chunk_size_for

    return chunk_size_for(max((int(p) for p in pieces), default=1), CHUNK)


def _rank_pieces(shape: DeltaLayerShape, Q: int, layout: str) -> list:
    """Lengths of the local pieces of each of the Q state ranks (a list per rank, chunk padding not applied)."""
    import torch

    from layers.cp.plan import build_chain_plan

    if Q == 1:
        if shape.cu_seqlens is None:
            return [[shape.seq_len] * shape.batch]
        cu = list(shape.cu_seqlens)
        return [[b - a for a, b in zip(cu[:-1], cu[1:])]]
    cu = None if shape.cu_seqlens is None else torch.tensor(shape.cu_seqlens, dtype=torch.int64)
    out = []
    for q in range(Q):
        plan = build_chain_plan(Q, q, layout, batch=shape.batch, seq_len=shape.seq_len, cu_seqlens=cu)
        lcu = plan.local_cu_seqlens.tolist()
        out.append([b - a for a, b in zip(lcu[:-1], lcu[1:])])
    return out


def _num_chains(shape: DeltaLayerShape, layout: str) -> int:
    if shape.cu_seqlens is None:
        return shape.batch
    return len(shape.cu_seqlens) - 1 if layout == "zigzag" else 1


def projection_flops(shape: DeltaLayerShape, tokens: float) -> float:
    """Forward FLOPs of the layer's dense projections on ``tokens`` local tokens (the same for every method)."""
    H, HV, K, V = shape.heads, shape.value_heads, shape.k_dim, shape.v_dim
    per_channel_gate = HV * K if delta_kind(shape.kind).gate_per_channel else 0   # KDA's gate up-projection
    width = 2 * H * K + 2 * HV * V + 2 * HV + per_channel_gate
    return 2 * tokens * shape.hidden * (width + HV * V)


def _kernel_fit(fits: dict, name: str, shape) -> LinearFit:
    if name not in fits:
        raise ValueError(f"calibration of {shape.kernel} has no {name!r} fit (it has {sorted(fits)}); "
                         "calibrate it with layers.cp.calibration.calibrate_kernel")
    return fits[name]


def predict_delta(shape: DeltaLayerShape, world_size: int, cand: Candidate, calibration: Calibration) -> dict:
    """Predicted forward + backward seconds of one layer per rank: ``{"total", "comm", "compute"}``.

    Compute = the slowest state rank's chunk-padded local pass at the calibrated kernel rates (for state methods
    on the generic path one pass with values [v | 0_K] on the "augmented" fit; with native summaries the op
    pass plus half a summary pass), plus the rest of the layer on the local tokens (the measured ``layer_key``
    fit when the calibration has one, else the projections' FLOPs); comm = the state scan forward and backward,
    for Ulysses two all-to-all rounds per pass (the 5 inputs packed, the output), and the straggler cost of
    every synchronization (``Calibration.sync_seconds``: conv halo, state scan, all-to-alls; the compute split
    evenly between them).
    """
    P = world_size
    U = P if cand.method == "ulysses" else (cand.ulysses_degree or 1)
    Q = P // U
    HVu, Hu = shape.value_heads // U, shape.heads // U
    inner = shape.layout if Q > 1 else "contiguous"
    fits = calibration.kernels.get(shape.kernel)
    if fits is None:
        raise ValueError(f"calibration has no kernel fit for {shape.kernel}; calibrate it first "
                         "(layers.cp.calibration.calibrate_kernel)")
    op, gemm = fits["op"], fits["gemm"]
    pieces = _rank_pieces(shape, Q, inner)
    native = shape.native_summaries

    def worst_flops(width):   # forward FLOPs of the slowest rank's pass at value width ``width``
        # the eager kernels chunk by the smallest power of two that holds the longest piece (at most CHUNK)
        chunks = [CHUNK if native else _eager_chunk(p) for p in pieces]
        return max(delta_flops(_padded(p, c), HVu, shape.k_dim, width, chunk=c) for p, c in zip(pieces, chunks))

    width = shape.v_dim + shape.k_dim                                              # values [v | 0_K]
    if Q > 1 and not native:                   # the generic path: one op pass of width V+K gives both
        compute = _kernel_fit(fits, "augmented", shape).seconds(3 * worst_flops(width))   # forward + backward
    else:
        compute = op.seconds(3 * worst_flops(shape.v_dim))
        if Q > 1:                              # native summaries: about half a pass of width V+K
            compute += _kernel_fit(fits, "summary", shape).seconds(3 * worst_flops(width) / 2)
    tokens_local = shape.batch * shape.seq_len / P
    rest = calibration.kernels.get(shape.layer_key)
    if rest is not None:                    # measured: the layer at CP = 1 minus its op, per token
        compute += rest["rest"].seconds(tokens_local)
    elif shape.hidden:                      # else the projections alone
        compute += gemm.seconds(3 * projection_flops(shape, tokens_local))
    comm = 0.0
    if Q > 1:
        comm += 2 * state_exchange_seconds(cand.method, inner, Q, num_chains=_num_chains(shape, inner), heads=HVu,
                                           k_dim=shape.k_dim, v_dim=shape.v_dim, calibration=calibration,
                                           group_size=cand.group_size)
    if U > 1:
        gate = delta_kind(shape.kind).gate_width(HVu * U, shape.k_dim)
        width_in = 2 * Hu * U * shape.k_dim + HVu * U * shape.v_dim + gate + HVu * U
        width_out = HVu * U * shape.v_dim
        a2a = calibration.fit("all_to_all")
        per = (U - 1) / U * tokens_local * shape.act_bytes
        one_pass = a2a.seconds(per * width_in, 1) + a2a.seconds(per * width_out, 1)   # inputs packed: one
        comm += 2 * one_pass
    # synchronizations, forward + backward: the conv halo, the state scan, Ulysses' two all-to-alls
    comm += calibration.sync_seconds(2 + 2 * (Q > 1) + 4 * (U > 1), compute)
    return {"total": comm + compute, "comm": comm, "compute": compute}


# -- MLA ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MLALayerShape:
    """An MLA layer under CP: global T per row (batch rows) and TP-local heads; dims as MLATransformerConfig."""

    batch: int
    seq_len: int
    heads: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    layout: str = "zigzag"
    act_bytes: int = 4
    dtype: str = "float32"

    @property
    def kernel(self) -> str:
        return f"mla/gemm/{self.dtype}"

    def describe(self) -> str:
        return (f"MLA B={self.batch} T={self.seq_len} heads={self.heads} qk={self.qk_head_dim}+"
                f"{self.qk_pos_emb_head_dim} v={self.v_head_dim} r={self.kv_lora_rank} {self.layout}")


def mla_candidates(world_size: int, heads: int) -> list:
    """``latent`` always; the Ulysses strategies when P divides the heads."""
    out = [Candidate("latent")]
    if heads % world_size == 0:
        out += [Candidate("latent_ulysses"), Candidate("expanded_ulysses")]
    return out


def predict_mla(shape: MLALayerShape, world_size: int, cand: Candidate, calibration: Calibration) -> dict:
    """Forward + backward seconds per rank: the K/V expansion each strategy repeats, causal attention of the
    slowest rank (contiguous ``latent`` ranks are unbalanced: the last one sees (2P-1)/P of the mean keys),
    and the exchange of ``layers.cp.mla.mla_comm_bytes`` (all-gather of the latent, all-to-alls of heads), plus
    the straggler cost of each collective (``Calibration.sync_seconds``)."""
    from layers.cp.mla import mla_comm_bytes

    P, B, T, H = world_size, shape.batch, shape.seq_len, shape.heads
    dq, dv, r = shape.qk_head_dim + shape.qk_pos_emb_head_dim, shape.v_head_dim, shape.kv_lora_rank
    fits = calibration.kernels.get(shape.kernel)
    if fits is None:
        raise ValueError(f"calibration has no kernel fit for {shape.kernel}; calibrate it first")
    gemm = fits["gemm"]
    n = B * T // P
    dims = dict(heads=H, qk_head_dim=shape.qk_head_dim, qk_pos_emb_head_dim=shape.qk_pos_emb_head_dim,
                v_head_dim=dv, kv_lora_rank=r, element_size=shape.act_bytes)
    expand_tokens, heads_here = {"latent": (B * T, H), "latent_ulysses": (B * T, H // P),
                                 "expanded_ulysses": (n, H)}[cand.method]
    expand = 2 * expand_tokens * r * heads_here * (shape.qk_head_dim + dv)
    imbalance = (2 * P - 1) / P if cand.method == "latent" and shape.layout == "contiguous" else 1.0
    attention = 2 * B * H * (dq + dv) * T * T / (2 * P) * imbalance
    compute = gemm.seconds(3 * (expand + attention))
    total_bytes = mla_comm_bytes(cand.method, world_size=P, tokens_per_rank=n, **dims)
    ag, a2a = calibration.fit("all_gather"), calibration.fit("all_to_all")
    latent = (P - 1) * n * (r + shape.qk_pos_emb_head_dim) * shape.act_bytes
    steps = math.ceil(math.log2(P))
    if cand.method == "latent":
        comm = 2 * ag.seconds(latent, steps)
    elif cand.method == "latent_ulysses":
        comm = 2 * (ag.seconds(latent, steps) + a2a.seconds(total_bytes["forward"] - latent, 2))
    else:
        comm = 2 * a2a.seconds(total_bytes["forward"], 4)
    syncs = {"latent": 1, "latent_ulysses": 3, "expanded_ulysses": 4}[cand.method]     # collectives per pass
    comm += calibration.sync_seconds(2 * syncs, compute)
    return {"total": comm + compute, "comm": comm, "compute": compute}
