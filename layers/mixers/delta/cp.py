"""Context parallelism of the GDN/KDA mixers: the CP context of a forward, and the layer's ``auto`` description.

:func:`cp_context` gives a forward its CP context: built once per micro-batch (THD: cached on
``packed_seq_params``, shared by every layer with the same CP configuration) or once per layer and group (BSHD:
it does not depend on the batch), with communication accounting off unless ``mixer.comm_stats`` is a
``CommStats``. With ``cp_method="auto"`` the configuration is the one the layer chose for that CP group at its
first CP forward (``mixer.cp_auto_choices``), through ``layers.cp.auto``, from :func:`auto_layer`: the layer's
shape and the closures that time it (:func:`forward_backward`, the one timing run of a mixer).
"""
from __future__ import annotations

import torch

from layers.cp import CommStats, build_cp_context
from layers.cp.auto import AutoLayer, auto_tuner
from layers.cp.cost_model import DeltaLayerShape
from layers.cp.sequence import check_packed_tokens, micro_batch_cache
from layers.cp.state_parallel import NATIVE_CP
from layers.cp.subgroups import solo_group


def forward_backward(mixer, x, packed_seq_params, choice=None) -> None:
    """One forward + backward of ``mixer`` on ``x`` (cloned), for timing: parameters frozen (no gradient,
    ``main_grad`` or DDP hook sees it; the weight gradients are skipped), communication accounting off, grad
    enabled (the first forward may run under ``no_grad``: full activation recompute). ``choice``: the
    ``(method, group_size, ulysses_degree)`` the call runs under on ``packed_seq_params``' CP group (None: the
    layer's own)."""
    group = mixer.cp_group_for(packed_seq_params)
    params = [p for p in mixer.parameters() if p.requires_grad]
    stats, mixer.comm_stats = mixer.comm_stats, None
    kept = mixer.cp_auto_choices.get(group)
    if choice is not None:
        mixer.cp_auto_choices[group] = choice
    for p in params:
        p.requires_grad_(False)
    try:
        with torch.enable_grad():
            y, _ = mixer(x.clone().requires_grad_(True), packed_seq_params=packed_seq_params)
            y.float().sum().backward()
    finally:
        for p in params:
            p.requires_grad_(True)
        mixer.comm_stats = stats
        if kept is None:
            mixer.cp_auto_choices.pop(group, None)
        else:
            mixer.cp_auto_choices[group] = kept


def auto_layer(mixer, cp_group, seq_len: int, batch: int, cu_seqlens, hidden_states, packed_seq_params) -> AutoLayer:
    """The mixer's description for ``layers.cp.auto`` at a CP forward: its shape (global ``seq_len`` per row, or
    total packed tokens with ``cu_seqlens``; TP-local heads), its calibration path and measured count, and the
    timing closures (at CP = 1 on a one-rank group; under a candidate on a random input shaped like
    ``hidden_states`` with the micro-batch's ``packed_seq_params``)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    dtype = mixer.in_proj.weight.dtype
    shape = DeltaLayerShape(
        kind=mixer.kind, batch=batch, seq_len=seq_len, heads=mixer.key_heads_local,
        value_heads=mixer.value_heads_local, k_dim=mixer.key_head_dim, v_dim=mixer.value_head_dim,
        layout=mixer.cp_layout, cu_seqlens=None if cu_seqlens is None else tuple(int(c) for c in cu_seqlens),
        hidden=mixer.hidden_size, act_bytes=dtype.itemsize, backend=mixer.backend,
        dtype=str(dtype).replace("torch.", ""), native_summaries=mixer.backend in NATIVE_CP)
    device, alone = hidden_states.device, PackedSeqParams(qkv_format="sbhd", cp_group=solo_group())

    def run_alone(tokens):
        x = torch.randn(tokens, 1, mixer.hidden_size, generator=torch.Generator().manual_seed(0)).to(device, dtype)
        return lambda: forward_backward(mixer, x, alone)

    run_with, measure_top = None, mixer.options["cp_auto_measure"]
    if measure_top > 0:
        x = torch.randn(hidden_states.shape, generator=torch.Generator().manual_seed(0)).to(device,
                                                                                           hidden_states.dtype)

        def run_with(cand):
            choice = (cand.method, cand.group_size, cand.ulysses_degree)
            return lambda: forward_backward(mixer, x, packed_seq_params, choice)

    # under sequence parallelism the input holds 1/tp of the tokens the mixer computes on
    sp = getattr(mixer.config, "sequence_parallel", False)
    return AutoLayer(shape=shape, calibration_path=mixer.options["cp_calibration"], measure_top=measure_top,
                     run_alone=run_alone, run_with=run_with, tokens_per_input_token=mixer.tp_size if sp else 1)


def cp_configuration(mixer, cp_group, seq_len, batch, cu_seqlens, hidden_states, packed_seq_params) -> tuple:
    """``(method, group_size, ulysses_degree)`` of this forward: the mixer's options, or with ``cp_method="auto"``
    its choice for ``cp_group``, made now (collective) if this is the layer's first CP forward on that group."""
    if mixer.cp_method != "auto":
        return mixer.cp_method, mixer.cp_group_size, mixer.cp_ulysses_degree
    if cp_group not in mixer.cp_auto_choices:
        layer = auto_layer(mixer, cp_group, seq_len, batch, cu_seqlens, hidden_states, packed_seq_params)
        choice = auto_tuner().choose(cp_group, layer)
        mixer.cp_auto_choices[cp_group] = (choice.method, choice.group_size, choice.ulysses_degree)
    return mixer.cp_auto_choices[cp_group]


def cp_context(mixer, packed_seq_params, cu, cp_group, cp_size, seq, batch, hidden_states):
    """``(cu_seqlens for the local op, CP context)`` of a forward on ``seq`` local tokens x ``batch`` rows: without
    CP the boundaries ``cu`` and None; under CP None and the context holding the global boundaries."""
    check_packed_tokens(type(mixer).__name__, cu, batch, seq, cp_size)
    if cp_size == 1:
        return cu, None
    method, group_size, degree = cp_configuration(mixer, cp_group, seq * cp_size, batch, cu, hidden_states,
                                                  packed_seq_params)
    key = ("cp_context", cp_group, method, mixer.cp_layout, group_size, degree, mixer.conv_kernel_dim,
           id(mixer.comm_stats))
    cache = micro_batch_cache(packed_seq_params) if cu is not None else mixer.cp_contexts
    ctx = cache.get(key)
    if ctx is None:
        stats = mixer.comm_stats if mixer.comm_stats is not None else CommStats(enabled=False)
        ctx = build_cp_context(cp_group, method=method, layout=mixer.cp_layout, cu_seqlens=cu,
                               group_size=group_size, ulysses_degree=degree, conv_kernel_size=mixer.conv_kernel_dim,
                               stats=stats)
        cache[key] = ctx
    return None, ctx
