"""``method="auto"``: the fastest CP configuration for this CP group, chosen from the calibrated cost model.

``decide(group, shape)`` (collective over the CP group) loads or measures the group's calibration
(``layers.cp.calibration``), predicts every valid configuration of the layer shape (``layers.cp.cost_model``:
GDN/KDA methods incl. grouped with each group size and the Ulysses hybrids; MLA strategies), and on group
rank 0 ranks them; rank 0's ``Decision`` is broadcast, so every rank uses the same one. Decisions are cached
per (CP group, shape, calibration file): layers of the same shape decide once, and one log line per decision
(printed on global rank 0) names the choice, its predicted time and the runner-up::

    [hp_megatron cp auto] GDN B=1 T=4096 H=4 HV=4 K=64 V=64 zigzag, P=4: ulysses 12.3 ms fwd+bwd
    (comm 1.1 + compute 11.2); runner-up allgather 14.0 ms (+14%); 9 candidates

A GDN/KDA mixer (``resolve_for_mixer``) then times the model's ``measure_top`` fastest candidates (default
``MEASURE_TOP``, option ``cp_auto_measure``, ``--hp-cp-auto-measure``; 0: the model decides alone) on itself:
forward + backward on a random input of the micro-batch's shape, every rank at once, the slowest rank's median,
and takes the fastest. The model prices every configuration from its parts and is within about 0.6-1.4x of
a measured layer; measuring settles the near-ties among its best few, where that error decides. The log line then
adds the measured times::

    ...; runner-up p2p 38.90 ms (+0%); 8 candidates; timed on the layer: ulysses 47.3, p2p 55.7, allgather
    54.1 ms -> ulysses

``rank_candidates`` is the pure choice (no communication), used by the tests on synthetic calibrations.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from layers.cp.collectives import group_size
from layers.cp.cost_model import (Calibration, Candidate, DeltaLayerShape, MLALayerShape, delta_candidates,
                                  mla_candidates, predict_delta, predict_mla)

LOG_PREFIX = "[hp_megatron cp auto]"
MEASURE_TOP = 3                    # candidates a mixer times on itself (the model's fastest); 0: model only
MEASURE_REPEATS = 7                # timed forward + backward calls per measured candidate (round-robin)
_DECISIONS: dict = {}
LOG: list = []                     # every log line this process printed (or would print on global rank 0)


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


def _log(line: str) -> None:
    LOG.append(line)
    if dist.get_rank() == 0:
        print(line, flush=True)


def _ensure_kernel(calibration, group, shape) -> bool:
    """Measure the kernel fits ``shape`` needs if missing; True if something was measured (collective)."""
    import torch

    from layers.cp.calibration import calibrate_gemm, calibrate_kernel

    if shape.kernel in calibration.kernels:
        return False
    dtype = getattr(torch, shape.dtype)
    if isinstance(shape, DeltaLayerShape):
        calibrate_kernel(calibration, group, kind=shape.kind, backend=shape.backend, k_dim=shape.k_dim,
                         v_dim=shape.v_dim, dtype=dtype)
    else:
        calibrate_gemm(calibration, group, shape.kernel, dtype)
    return True


def _group_calibration(group, path):
    from layers.cp.calibration import load_or_calibrate

    calibration, source = load_or_calibrate(group, path)
    if source != "cached":
        _log(calibration_line(calibration, source))
    return calibration


def _ensure_layer(calibration, group, mixer, shape) -> bool:
    if shape.layer_key in calibration.kernels:
        return False
    calibrate_mixer(calibration, group, mixer, shape)
    return True


def decide(group, shape, *, calibration: Calibration | None = None, calibration_path: str | None = None,
           measure=None, measure_top: int = 0) -> Decision:
    """The decision for ``shape`` on ``group`` (None = WORLD), identical on every rank (collective, except
    when cached). ``calibration``: use this one instead of loading/measuring the group's (``calibration_path``
    or a fresh measurement). ``measure(candidates) -> seconds`` (collective, the same numbers on every rank):
    the ``measure_top`` fastest predicted candidates are timed with it and the fastest measured is chosen."""
    from layers.cp.calibration import broadcast_from_rank0, persist

    group = dist.GroupMember.WORLD if group is None else group
    measure_top = measure_top if measure is not None else 0
    key = (tuple(dist.get_process_group_ranks(group)), shape,
           calibration_path if calibration is None else id(calibration), measure_top)
    if key in _DECISIONS:
        return _DECISIONS[key]
    if calibration is None:
        calibration = _group_calibration(group, calibration_path)
        if _ensure_kernel(calibration, group, shape):
            persist(calibration, group, calibration_path)
    else:
        _ensure_kernel(calibration, group, shape)
    decision = broadcast_from_rank0(lambda: rank_candidates(shape, group_size(group), calibration), group)
    if measure_top > 0 and len(decision.ranking) > 1:
        # a fixed count (not a margin): every CP group of this size times as many layer calls, so collectives
        # outside the CP group (TP all-gathers inside the mixer) stay matched across groups
        top = [cand for cand, _ in decision.ranking[:measure_top]]
        seconds = measure(top)
        decision = broadcast_from_rank0(lambda: decision.with_measurements(zip(top, seconds)), group)
    _DECISIONS[key] = decision
    _log(decision.log_line())
    return decision


def auto_context_kwargs(group, layer, layout: str, *, calibration=None, group_size=None,
                        ulysses_degree=None) -> dict:
    """``build_cp_context``'s hook for ``method="auto"``: the chosen ``method``, ``group_size``,
    ``ulysses_degree`` for the ``DeltaLayerShape`` ``layer``. ``calibration``: a ``Calibration``, a JSON path
    (``--hp-cp-calibration``) or None (measure once per process)."""
    if not isinstance(layer, DeltaLayerShape):
        raise ValueError("method='auto' needs auto_layer=DeltaLayerShape(...) (the layer's heads, head dims and "
                         f"tokens) to predict the methods; got {layer!r}")
    if group_size is not None or ulysses_degree is not None:
        raise ValueError(f"method='auto' chooses group_size and ulysses_degree itself; got group_size={group_size}"
                         f", ulysses_degree={ulysses_degree}")
    if layer.layout != layout:
        raise ValueError(f"auto_layer.layout={layer.layout!r} differs from layout={layout!r}")
    if isinstance(calibration, Calibration):
        d = decide(group, layer, calibration=calibration)
    else:
        d = decide(group, layer, calibration_path=calibration)
    return d.choice.context_kwargs()


def calibrate_mixer(calibration: Calibration, group, mixer, shape: DeltaLayerShape) -> None:
    """Add ``calibration.kernels[shape.layer_key] = {"rest": fit}``: the mixer's own forward + backward at CP = 1
    (a one-rank CP group passed through ``PackedSeqParams.cp_group``) on 128 and 512 tokens, run on every rank
    of ``group`` at once (``time_concurrently``: the slowest rank's time), minus the calibrated op time, per
    token (collective).

    The parameters are frozen meanwhile (``requires_grad`` off), so no gradient, main_grad or DDP hook sees
    the timing runs; the weight gradients it skips are added back from the projections' FLOPs at the gemm fit."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from layers.cp.calibration import fit_line, group_device, time_concurrently
    from layers.cp.cost_model import delta_flops, projection_flops
    from layers.cp.subgroups import solo_group

    if shape.layer_key in calibration.kernels:
        return
    packed = PackedSeqParams(qkv_format="sbhd", cp_group=solo_group())
    # under sequence parallelism the input holds 1/tp of the tokens the mixer computes on
    per_input_token = mixer.tp_size if getattr(mixer.config, "sequence_parallel", False) else 1
    weight = mixer.in_proj.weight
    params = [p for p in mixer.parameters() if p.requires_grad]
    op, gemm = calibration.kernels[shape.kernel]["op"], calibration.kernels[shape.kernel]["gemm"]
    gen = torch.Generator().manual_seed(0)
    sizes, calls = (128, 512), []
    for n in sizes:
        x = torch.randn(n, 1, shape.hidden, generator=gen).to(weight.device, weight.dtype)

        def run(x=x):
            with torch.enable_grad():        # the first forward may run under no_grad (full activation recompute)
                y, _ = mixer(x.clone().requires_grad_(True), packed_seq_params=packed)
                y.float().sum().backward()
        calls.append(run)
    for p in params:
        p.requires_grad_(False)
    try:
        times = time_concurrently(calls, group, group_device(group))
    finally:
        for p in params:
            p.requires_grad_(True)
    points = []
    for n, t in zip(sizes, times):
        tokens = n * per_input_token
        t += gemm.seconds(projection_flops(shape, tokens))                 # the skipped weight gradients
        t -= op.seconds(3 * delta_flops(tokens, shape.value_heads, shape.k_dim, shape.v_dim))
        points.append((tokens, max(t, 1e-6)))
    calibration.kernels[shape.layer_key] = {"rest": fit_line([n for n, _ in points], [t for _, t in points])}


def measure_on_mixer(mixer, cp_group, hidden_states, packed_seq_params, repeats: int = MEASURE_REPEATS):
    """``measure(candidates) -> seconds`` for ``decide``: the mixer's own forward + backward under each candidate on
    a random input shaped like ``hidden_states`` with the micro-batch's ``packed_seq_params``, every rank of
    ``cp_group`` at once (``time_concurrently``: a warm-up, then ``repeats`` barrier-started calls, the slowest
    rank's median). Parameters are frozen and communication accounting is off meanwhile (no gradient, hook or
    ``comm_stats`` sees the timing runs)."""
    import torch

    from layers.cp.calibration import group_device, time_concurrently

    def measure(candidates):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(hidden_states.shape, generator=gen).to(hidden_states.device, hidden_states.dtype)

        def run(cand):
            _keep_choice(mixer, cp_group, (cand.method, cand.group_size, cand.ulysses_degree))
            with torch.enable_grad():        # the first forward may run under no_grad (full activation recompute)
                y, _ = mixer(x.clone().requires_grad_(True), packed_seq_params=packed_seq_params)
                y.float().sum().backward()
        params = [p for p in mixer.parameters() if p.requires_grad]
        stats, mixer.comm_stats = mixer.comm_stats, None
        for p in params:
            p.requires_grad_(False)
        try:
            return time_concurrently([lambda c=c: run(c) for c in candidates], cp_group, group_device(cp_group),
                                     repeats=repeats, min_window=0.0)
        finally:
            for p in params:
                p.requires_grad_(True)
            mixer.comm_stats = stats
            mixer._cp_auto_choices.pop(cp_group, None)
    return measure


def auto_choice(module, cp_group):
    """What a layer with an ``auto`` CP method keeps for ``cp_group`` (the group object its forward used; None =
    WORLD): a GDN/KDA mixer's ``(method, group_size, ulysses_degree)``, an MLA layer's strategy; None before its
    first CP forward on that group. One per group: megatron's hybrid CP hands micro-batches CP groups of several
    sizes (``PackedSeqParams.cp_group``), and a choice for one size may not be valid on another."""
    return getattr(module, "_cp_auto_choices", {}).get(cp_group)


def _keep_choice(module, cp_group, choice) -> None:
    if not hasattr(module, "_cp_auto_choices"):
        module._cp_auto_choices = {}
    module._cp_auto_choices[cp_group] = choice


def resolve_for_mixer(mixer, cp_group, seq_len: int, batch: int, cu_seqlens, hidden_states=None,
                      packed_seq_params=None) -> tuple:
    """(method, group_size, ulysses_degree) for a GDN/KDA mixer with ``cp_method="auto"``, decided at its first
    CP forward (global ``seq_len`` per row, or total packed tokens with ``cu_seqlens``) and kept for the life of
    the module: later micro-batches reuse it without communication. With ``hidden_states`` (the forward's
    input) and the mixer option ``cp_auto_measure`` > 0, the model's best few are timed on the mixer itself
    (``measure_on_mixer``). Kept per CP group (``auto_choice``)."""
    chosen = auto_choice(mixer, cp_group)
    if chosen is not None:
        return chosen
    dtype = mixer.in_proj.weight.dtype
    shape = DeltaLayerShape(
        kind=mixer.kind, batch=batch, seq_len=seq_len, heads=mixer.key_heads_local,
        value_heads=mixer.value_heads_local, k_dim=mixer.key_head_dim, v_dim=mixer.value_head_dim,
        layout=mixer.cp_layout, cu_seqlens=None if cu_seqlens is None else tuple(int(c) for c in cu_seqlens),
        hidden=mixer.hidden_size, act_bytes=dtype.itemsize, backend=mixer.backend,
        dtype=str(dtype).replace("torch.", ""), native_summaries=mixer.backend in ("triton", "ascendc"))
    from layers.cp.calibration import persist

    path = mixer.options.get("cp_calibration")
    if mixer.cp_group_size is not None or mixer.cp_ulysses_degree is not None:
        raise ValueError(f"cp_method='auto' chooses group_size and ulysses_degree itself; got group_size="
                         f"{mixer.cp_group_size}, ulysses_degree={mixer.cp_ulysses_degree}")
    calibration = _group_calibration(cp_group, path)
    if _ensure_kernel(calibration, cp_group, shape) | _ensure_layer(calibration, cp_group, mixer, shape):
        persist(calibration, cp_group, path)
    top = mixer.options["cp_auto_measure"]
    measure = None if hidden_states is None else measure_on_mixer(mixer, cp_group, hidden_states, packed_seq_params)
    choice = decide(cp_group, shape, calibration=calibration, measure=measure, measure_top=top).choice
    _keep_choice(mixer, cp_group, (choice.method, choice.group_size, choice.ulysses_degree))
    return auto_choice(mixer, cp_group)


def resolve_for_mla(mla, cp_group, seq_len: int, batch: int) -> str:
    """The CP strategy of an MLA layer with ``cp_strategy="auto"``, decided at its first CP forward and kept.
    The calibration file is the config's ``delta_cp_calibration`` (``--hp-cp-calibration``). Kept per CP group
    (``auto_choice``)."""
    chosen = auto_choice(mla, cp_group)
    if chosen is not None:
        return chosen
    d, dtype = mla.dims, mla.linear_kv_up_proj.weight.dtype
    shape = MLALayerShape(batch=batch, seq_len=seq_len, heads=d.heads, qk_head_dim=d.qk, qk_pos_emb_head_dim=d.pe,
                          v_head_dim=d.v, kv_lora_rank=d.kv_lora_rank, layout=mla.cp_layout, act_bytes=dtype.itemsize,
                          dtype=str(dtype).replace("torch.", ""))
    path = getattr(mla.config, "delta_cp_calibration", None)
    _keep_choice(mla, cp_group, decide(cp_group, shape, calibration_path=path).choice.method)
    return auto_choice(mla, cp_group)
