"""``method="auto"``: the fastest CP configuration for this CP group, chosen from the calibrated cost model.

A mixer with an ``auto`` CP method describes itself in an :class:`AutoLayer` (its shape for the cost model and,
for GDN/KDA, closures that run one forward + backward of the layer) and asks an :class:`AutoTuner` (the
process's: :func:`auto_tuner`) to :meth:`~AutoTuner.choose` at its first CP forward; this module reads nothing
else of the mixer.

``AutoTuner.decide(group, shape)`` (collective over the CP group) predicts every valid configuration of the layer
shape (``layers.cp.cost_model``: GDN/KDA methods incl. grouped with each group size and the Ulysses hybrids; MLA
strategies) from the group's calibration (``layers.cp.calibration``) and on group rank 0 ranks them; rank 0's
``Decision`` is broadcast, so every rank uses the same one. Decisions are kept per (CP group, shape,
calibration): layers of the same shape decide once, and one log line per decision (printed on global rank 0,
kept in ``AutoTuner.log``) names the choice, its predicted time and the runner-up::

    [hp_megatron cp auto] GDN B=1 T=4096 H=4 HV=4 K=64 V=64 zigzag, P=4: ulysses 12.3 ms fwd+bwd
    (comm 1.1 + compute 11.2); runner-up allgather 14.0 ms (+14%); 9 candidates

A GDN/KDA layer (``AutoLayer.run_with``) then has the model's ``measure_top`` fastest candidates (default
``MEASURE_TOP``, option ``cp_auto_measure``, ``--hp-cp-auto-measure``; 0: the model decides alone) timed on
itself: forward + backward on a random input of the micro-batch's shape, every rank at once, the slowest rank's
median, and the fastest is taken. The model prices every configuration from its parts and is within about
0.6-1.4x of a measured layer; measuring settles the near-ties among its best few, where that error decides. The
log line then adds the measured times::

    ...; runner-up p2p 38.90 ms (+0%); 8 candidates; timed on the layer: ulysses 47.3, p2p 55.7, allgather
    54.1 ms -> ulysses

``rank_candidates`` is the pure choice (no communication), used by the tests on synthetic calibrations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from layers.cp.calibration import (calibrate_gemm, calibrate_kernel, fit_line, group_device, layout_key,
                                   load_or_calibrate, persist, time_concurrently)
from layers.cp.collectives import broadcast_from_rank0, group_size
from layers.cp.cost_model import (Calibration, Candidate, DeltaLayerShape, MLALayerShape, delta_candidates,
                                  delta_flops, mla_candidates, predict_delta, predict_mla, projection_flops)

LOG_PREFIX = "[hp_megatron cp auto]"
MEASURE_TOP = 3                    # candidates a GDN/KDA layer times on itself (the model's fastest); 0: model only
MEASURE_REPEATS = 7                # timed forward + backward calls per measured candidate (round-robin)
REST_TOKENS = (128, 512)           # input tokens of the layer's own runs at CP = 1 (the "rest" fit)


@dataclass(frozen=True)
class AutoLayer:
    """What a layer with an ``auto`` CP method tells :class:`AutoTuner` about itself.

    shape: a ``DeltaLayerShape`` or ``MLALayerShape`` (global tokens of the micro-batch, TP-local heads).
    calibration_path: JSON cache of the group's calibration (``--hp-cp-calibration``) or None.
    measure_top: how many of the model's fastest candidates ``run_with`` times (0: the model alone).
    run_alone(n) -> run: ``run()`` is one forward + backward of the layer at CP = 1 (a one-rank group) on n random
        input tokens, parameters frozen; None: the rest of the layer is priced from its projections' FLOPs.
    run_with(candidate) -> run: ``run()`` is one forward + backward under ``candidate`` on the CP group, on a random
        input shaped like the micro-batch's, parameters frozen and accounting off (collective).
    tokens_per_input_token: tokens the layer computes on per input token (the TP size under sequence parallelism).
    """

    shape: object
    calibration_path: Optional[str] = None
    measure_top: int = 0
    run_alone: Optional[Callable] = None
    run_with: Optional[Callable] = None
    tokens_per_input_token: int = 1


@dataclass(frozen=True)
class Decision:
    """The chosen candidate, its prediction, and the full ranking ``[(candidate, prediction dict)]``."""

    shape: object
    world_size: int
    choice: Candidate
    predicted: dict
    ranking: tuple
    measured: tuple = ()           # ((candidate, seconds), ...): the model's best few timed on the layer

    @property
    def runner_up(self):
        return self.ranking[1] if len(self.ranking) > 1 else None

    def log_line(self) -> str:
        best, p = self.ranking[0]
        line = (f"{LOG_PREFIX} {self.shape.describe()}, P={self.world_size}: {best.label} "
                f"{p['total'] * 1e3:.2f} ms fwd+bwd (comm {p['comm'] * 1e3:.2f} + compute {p['compute'] * 1e3:.2f})")
        if self.runner_up is None:
            return line + "; the only valid candidate"
        cand, pred = self.runner_up
        line += (f"; runner-up {cand.label} {pred['total'] * 1e3:.2f} ms "
                 f"(+{100 * (pred['total'] / p['total'] - 1):.0f}%); {len(self.ranking)} candidates")
        if self.measured:
            times = ", ".join(f"{c.label} {t * 1e3:.1f}" for c, t in self.measured)
            line += f"; timed on the layer: {times} ms -> {self.choice.label}"
        return line

    def with_measurements(self, measured) -> "Decision":
        """This decision with ``measured`` = [(candidate, seconds)] and the fastest of them as the choice."""
        measured = tuple(measured)
        choice = min(measured, key=lambda ct: ct[1])[0]
        predicted = next(pred for cand, pred in self.ranking if cand == choice)
        return Decision(shape=self.shape, world_size=self.world_size, choice=choice, predicted=predicted,
                        ranking=self.ranking, measured=measured)


def rank_candidates(shape, world_size: int, calibration: Calibration) -> Decision:
    """Predict every valid candidate of ``shape`` on ``world_size`` ranks and rank them, fastest first (ties:
    the earlier candidate of the enumeration)."""
    if isinstance(shape, DeltaLayerShape):
        cands = delta_candidates(world_size, shape.heads, shape.value_heads)
        predict = predict_delta
    elif isinstance(shape, MLALayerShape):
        cands = mla_candidates(world_size, shape.heads)
        predict = predict_mla
    else:
        raise TypeError(f"shape must be a DeltaLayerShape or MLALayerShape, got {type(shape).__name__}")
    scored = [(c, predict(shape, world_size, c, calibration)) for c in cands]
    ranking = tuple(sorted(scored, key=lambda cp: cp[1]["total"]))
    best, pred = ranking[0]
    return Decision(shape=shape, world_size=world_size, choice=best, predicted=pred, ranking=ranking)


def calibration_line(calibration: Calibration, source: str) -> str:
    fits = ", ".join(f"{name} alpha={f.alpha * 1e6:.1f} us/step beta={f.beta / 1e9:.2f} GB/s "
                     f"(resid {100 * f.residual:.0f}%)" for name, f in calibration.collectives.items())
    sync = calibration.sync
    sync = "" if sync is None else (f"; sync {sync.alpha * 1e6:.0f} us + {100 / sync.beta:.1f}% of the phase "
                                    f"before it (resid {100 * sync.residual:.0f}%)")
    return (f"{LOG_PREFIX} calibration [{calibration.key}] {source}: {fits}; fold gamma="
            f"{calibration.fold_flops / 1e9:.1f} GFLOP/s{sync}")


def _ensure_kernel(calibration: Calibration, group, shape) -> bool:
    """Measure the kernel fits ``shape`` needs if missing; True if something was measured (collective)."""
    if shape.kernel in calibration.kernels:
        return False
    dtype = getattr(torch, shape.dtype)
    if isinstance(shape, DeltaLayerShape):
        calibrate_kernel(calibration, group, kind=shape.kind, backend=shape.backend, k_dim=shape.k_dim,
                         v_dim=shape.v_dim, dtype=dtype)
    else:
        calibrate_gemm(calibration, group, shape.kernel, dtype)
    return True


def calibrate_layer(calibration: Calibration, group, layer: AutoLayer) -> bool:
    """Add ``calibration.kernels[shape.layer_key] = {"rest": fit}`` for a GDN/KDA ``layer``: its own forward +
    backward at CP = 1 (``layer.run_alone``) on ``REST_TOKENS`` input tokens, run on every rank of ``group`` at
    once (``time_concurrently``: the slowest rank's time), minus the calibrated op time, per token (collective).
    The parameters are frozen in those runs, so the weight gradients they skip are added back from the
    projections' FLOPs at the gemm fit. True if something was measured."""
    shape = layer.shape
    if layer.run_alone is None or shape.layer_key in calibration.kernels:
        return False
    fits = calibration.kernels[shape.kernel]
    times = time_concurrently([layer.run_alone(n) for n in REST_TOKENS], group, group_device(group))
    points = []
    for n, t in zip(REST_TOKENS, times):
        tokens = n * layer.tokens_per_input_token
        t += fits["gemm"].seconds(projection_flops(shape, tokens))                # the skipped weight gradients
        t -= fits["op"].seconds(3 * delta_flops(tokens, shape.value_heads, shape.k_dim, shape.v_dim))
        points.append((tokens, max(t, 1e-6)))
    calibration.kernels[shape.layer_key] = {"rest": fit_line([n for n, _ in points], [t for _, t in points])}
    return True


class AutoTuner:
    """The state of ``auto`` in one process: calibrations per world layout, decisions per (CP group, shape,
    calibration, measured count), and the log lines (``log``; printed on global rank 0).

    Every method that measures or decides is collective over the CP group passed in."""

    def __init__(self):
        self.calibrations: dict = {}       # layout key -> Calibration
        self.decisions: dict = {}          # (group ranks, shape, id(calibration), measure_top) -> Decision
        self.log: list = []

    def clear(self) -> None:
        """Forget every calibration, decision and log line (the next ``choose`` loads or measures anew)."""
        self.calibrations.clear()
        self.decisions.clear()
        self.log.clear()

    def _log(self, line: str) -> None:
        self.log.append(line)
        if dist.get_rank() == 0:
            print(line, flush=True)

    def calibration(self, group, path: Optional[str] = None) -> tuple[Calibration, str]:
        """``(calibration, source)`` of ``group``'s world layout: the kept one (source ``"kept"``), else loaded from
        ``path`` or measured (``load_or_calibrate``; then kept and logged)."""
        group = dist.GroupMember.WORLD if group is None else group
        key = layout_key(group)
        if key in self.calibrations:
            return self.calibrations[key], "kept"
        calibration, source = load_or_calibrate(group, path, key)
        self.calibrations[key] = calibration
        self._log(calibration_line(calibration, source))
        return calibration, source

    def decide(self, group, shape, *, calibration: Calibration, measure=None, measure_top: int = 0) -> Decision:
        """The decision for ``shape`` on ``group`` (None = WORLD) from ``calibration``, identical on every rank
        (collective unless kept). ``measure(candidates) -> seconds`` (collective, the same numbers on every rank):
        the ``measure_top`` fastest predicted candidates are timed with it and the fastest measured is chosen."""
        group = dist.GroupMember.WORLD if group is None else group
        measure_top = measure_top if measure is not None else 0
        key = (tuple(dist.get_process_group_ranks(group)), shape, id(calibration), measure_top)
        if key in self.decisions:
            return self.decisions[key]
        _ensure_kernel(calibration, group, shape)
        decision = broadcast_from_rank0(lambda: rank_candidates(shape, group_size(group), calibration), group)
        if measure_top > 0 and len(decision.ranking) > 1:
            # a fixed count (not a margin): every CP group of this size times as many layer calls, so collectives
            # outside the CP group (TP all-gathers inside the mixer) stay matched across groups
            top = [cand for cand, _ in decision.ranking[:measure_top]]
            seconds = measure(top)
            decision = broadcast_from_rank0(lambda: decision.with_measurements(zip(top, seconds)), group)
        self.decisions[key] = decision
        self._log(decision.log_line())
        return decision

    def choose(self, group, layer: AutoLayer) -> Candidate:
        """The candidate for ``layer`` on its CP ``group``: the group's calibration (with the kernel fits and the
        layer's own rest-of-layer fit it needs, saved to ``layer.calibration_path`` when measured), the model's
        ranking, and the ``layer.measure_top`` best timed with ``layer.run_with``. Collective over the group."""
        group = dist.GroupMember.WORLD if group is None else group
        calibration, _ = self.calibration(group, layer.calibration_path)
        if _ensure_kernel(calibration, group, layer.shape) | calibrate_layer(calibration, group, layer):
            persist(calibration, group, layer.calibration_path)
        measure = None
        if layer.run_with is not None:
            def measure(candidates):
                return time_concurrently([layer.run_with(c) for c in candidates], group, group_device(group),
                                         repeats=MEASURE_REPEATS, min_window=0.0)
        return self.decide(group, layer.shape, calibration=calibration, measure=measure,
                           measure_top=layer.measure_top).choice


_PROCESS_TUNER = AutoTuner()


def auto_tuner() -> AutoTuner:
    """This process's tuner: the one every layer with an ``auto`` CP method decides through, so layers of one
    shape share a decision and a process calibrates once per world layout."""
    return _PROCESS_TUNER
