"""The two layer numberings of one model: ``GPTModel`` (layer ``i`` = mixer + MLP) and ``HybridModel`` (one pattern
symbol = one layer: GPT layer ``i`` is the ``i``-th mixer layer and the ``i``-th MLP layer of the hybrid pattern).

* :func:`hybrid_symbol_of`: the ``HybridModel`` symbol of one of our mixers, from its registry entry
  (``MixerEntry.stack_slot``), or megatron-core's own slot ``<name>_layer`` (e.g. ``K`` / ``kda_layer``) when the
  installed megatron-core has one.
* :func:`hybrid_pattern_of`: the hybrid pattern of a GPT model (our ``hp_layer_pattern`` over ``num_layers``, MoE
  layers per ``moe_layer_freq``, ``|`` between the layers of pipeline stages, ``/`` + one MTP layer per depth).
* :func:`delta_slot_mixers`: which of our mixers each layer of a shared slot (``G``: GDN and KDA) takes.
* :func:`gpt_layer_numbers`: the GPT layer each HybridModel layer is half of (what per-GPT-layer settings index).
* :class:`LayerNumbering`: checkpoint / state-dict keys of one numbering in the other (``gpt_to_hybrid`` and
  ``hybrid_to_gpt``), for any architecture: only the layer index and the MTP inner-layer part of a key change.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

PIPE, MTP_SEPARATOR = "|", "/"
MLP_SYMBOLS = ("-", "E")          # HybridModel's dense MLP and MoE layers
MIXER_PARTS = ("input_layernorm", "self_attention")
MLP_PARTS = ("pre_mlp_layernorm", "mlp")


def _slots() -> dict:
    """HybridModel's ``{symbol: HybridStackSubmodules field}`` of the installed megatron-core."""
    from hp_megatron.hybrid_model.stack import SLOTS

    return SLOTS


def hybrid_symbol_of(symbol: str) -> str:
    """The ``HybridModel`` pattern symbol of our mixer ``symbol`` (``G`` -> ``G``, ``K`` -> ``G`` or megatron-core's
    ``K``, ``M`` -> ``+``, ``A`` -> ``*``); ValueError for a mixer that declares no slot."""
    from hp_megatron.registry import mixer

    entry = mixer(symbol)
    by_slot = {slot: s for s, slot in _slots().items()}
    own = f"{entry.name}_layer"        # megatron-core's own slot for this mixer (a newer version's K / kda_layer)
    if own in by_slot and own != entry.stack_slot:
        return by_slot[own]
    if entry.stack_slot not in by_slot:
        raise ValueError(f"mixer {entry.name!r} ({symbol}) declares no HybridModel slot (MixerEntry.stack_slot="
                         f"{entry.stack_slot!r}; HybridModel's slots: {sorted(by_slot)})")
    return by_slot[entry.stack_slot]


def _layer_symbols(pattern: str, num_layers: int) -> str:
    return "".join(pattern[i % len(pattern)] for i in range(num_layers))


def hybrid_pattern_of(gpt_pattern: str, num_layers: int, moe_flags, *, pipeline_stages: int = 1,
                      mtp_symbol: str | None = None, mtp_depth: int = 0) -> str:
    """The ``HybridModel`` pattern of the GPT model of ``gpt_pattern`` (our symbols, repeating over ``num_layers``)
    with MoE MLPs where ``moe_flags`` (one bool per layer) says: each GPT layer is its mixer's symbol then ``-`` or
    ``E``; ``|`` splits the GPT layers evenly over ``pipeline_stages`` (GPTModel's even split); each MTP depth is
    ``/`` + ``mtp_symbol``'s layer + its MLP (MoE when the model has MoE layers, as our GPT MTP layers)."""
    layers = _layer_symbols(gpt_pattern, num_layers)
    flags = list(moe_flags)
    if len(flags) != num_layers:
        raise ValueError(f"moe_flags needs one entry per layer ({num_layers}), got {len(flags)}")
    if num_layers % pipeline_stages:
        raise ValueError(f"num_layers={num_layers} does not split evenly over {pipeline_stages} pipeline stages")
    per_stage = num_layers // pipeline_stages
    parts = []
    for i, (symbol, moe) in enumerate(zip(layers, flags)):
        if i and i % per_stage == 0:
            parts.append(PIPE)
        parts.append(hybrid_symbol_of(symbol) + ("E" if moe else "-"))
    main = "".join(parts)
    if not mtp_depth:
        return main
    if mtp_symbol is None:
        raise ValueError(f"mtp_depth={mtp_depth} needs the MTP layers' mixer symbol (mtp_symbol)")
    mtp = hybrid_symbol_of(mtp_symbol) + ("E" if any(flags) else "-")
    return main + (MTP_SEPARATOR + mtp) * mtp_depth


def split_pattern(pattern: str) -> tuple[str, tuple]:
    """``(main pattern without '|', (MTP depth patterns...))`` of a hybrid pattern."""
    main, *mtp = pattern.split(MTP_SEPARATOR)
    return main.replace(PIPE, ""), tuple(mtp)


def delta_slot_mixers(hybrid_pattern: str, gpt_pattern: str | None, slot_symbol: str = "G") -> dict:
    """``{1-based HybridModel layer number: our mixer symbol}`` for the ``slot_symbol`` layers of the main pattern:
    the ``k``-th of them takes the ``k``-th symbol of ``gpt_pattern`` (repeating) whose mixer lives in that slot
    (``G`` positions of ``GKKG`` -> GDN, KDA, KDA, GDN). Without ``gpt_pattern``: {} (the slot's default mixer)."""
    main, _ = split_pattern(hybrid_pattern)
    positions = [n for n, s in enumerate(main, start=1) if s == slot_symbol]
    if not gpt_pattern or not positions:
        return {}
    ours = [s for s in gpt_pattern if hybrid_symbol_of(s) == slot_symbol]
    if not ours:
        raise ValueError(f"hybrid layer pattern {hybrid_pattern!r} has {slot_symbol!r} layers but the layer pattern "
                         f"{gpt_pattern!r} has no mixer of that slot")
    if len(gpt_pattern) == len([s for s in main if s not in MLP_SYMBOLS]) and len(ours) != len(positions):
        raise ValueError(f"layer pattern {gpt_pattern!r} has {len(ours)} mixers of the {slot_symbol!r} slot, the "
                         f"hybrid layer pattern {hybrid_pattern!r} {len(positions)} {slot_symbol!r} layers")
    return {n: ours[k % len(ours)] for k, n in enumerate(positions)}


def gpt_layer_numbers(hybrid_pattern: str) -> dict:
    """``{1-based HybridModel layer number: 1-based GPT layer number}`` of the main pattern: the ``i``-th mixer layer
    and the ``i``-th MLP layer are GPT layer ``i``'s halves (MTP parts are not numbered)."""
    main, _ = split_pattern(hybrid_pattern)
    numbers, mixers, mlps = {}, 0, 0
    for n, symbol in enumerate(main, start=1):
        if symbol in MLP_SYMBOLS:
            mlps += 1
            numbers[n] = mlps
        else:
            mixers += 1
            numbers[n] = mixers
    return numbers


_LAYER_KEY = re.compile(r"^(?P<head>(?:.*\.)?decoder\.layers\.)(?P<index>\d+)\.(?P<part>[^.]+)(?P<rest>\..*)$")
_MTP_KEY = re.compile(r"^(?P<head>(?:.*\.)?mtp\.layers\.\d+\.)(?P<inner>transformer_layer|mtp_model_layer)\."
                      r"(?P<layers>layers\.(?P<index>\d+)\.)?(?P<part>[^.]+)(?P<rest>\..*)$")


@dataclass(frozen=True)
class LayerNumbering:
    """The GPT <-> HybridModel key mapping of one model, from its hybrid pattern (with ``/`` MTP parts): GPT layer
    ``i``'s ``input_layernorm`` / ``self_attention`` keys are the ``i``-th mixer layer's, its
    ``pre_mlp_layernorm`` / ``mlp`` keys the ``i``-th MLP layer's; ``decoder.final_layernorm`` is
    ``decoder.final_norm``; an MTP layer's inner ``transformer_layer`` (``mtp_model_layer``) is split the same way
    over ``mtp_model_layer.layers.<j>``. Every other key is the same in both."""

    hybrid_pattern: str

    def __post_init__(self):
        main, mtp = split_pattern(self.hybrid_pattern)
        for part in (main,) + mtp:
            mixers = [j for j, s in enumerate(part) if s not in MLP_SYMBOLS]
            mlps = [j for j, s in enumerate(part) if s in MLP_SYMBOLS]
            if len(mixers) != len(mlps):
                raise ValueError(f"hybrid layer pattern {self.hybrid_pattern!r}: {part!r} has {len(mixers)} mixer "
                                 f"and {len(mlps)} MLP layers; a GPT layer is one of each")

    def _positions(self, part: str):
        return ([j for j, s in enumerate(part) if s not in MLP_SYMBOLS],
                [j for j, s in enumerate(part) if s in MLP_SYMBOLS])

    @property
    def num_gpt_layers(self) -> int:
        return len(self._positions(split_pattern(self.hybrid_pattern)[0])[0])

    def gpt_to_hybrid(self, key: str, mtp_inner: str = "mtp_model_layer") -> str:
        """The HybridModel key of a GPTModel state-dict / checkpoint key."""
        main, mtp = split_pattern(self.hybrid_pattern)
        found = _LAYER_KEY.match(key)
        if found and found["part"] in MIXER_PARTS + MLP_PARTS:
            mixers, mlps = self._positions(main)
            index = int(found["index"])
            if index >= len(mixers):
                raise ValueError(f"{key}: GPT layer {index} is past the {len(mixers)} layers of "
                                 f"{self.hybrid_pattern!r}")
            j = (mixers if found["part"] in MIXER_PARTS else mlps)[index]
            return f"{found['head']}{j}.{found['part']}{found['rest']}"
        found = _MTP_KEY.match(key)
        if found and found["layers"] is None and found["part"] in MIXER_PARTS + MLP_PARTS:
            mixers, mlps = self._positions(mtp[0] if mtp else "")
            if not mixers:
                raise ValueError(f"{key}: an MTP key, but {self.hybrid_pattern!r} has no MTP part ('/')")
            j = (mixers if found["part"] in MIXER_PARTS else mlps)[0]
            return f"{found['head']}{mtp_inner}.layers.{j}.{found['part']}{found['rest']}"
        return re.sub(r"(^|\.)decoder\.final_layernorm\.", r"\1decoder.final_norm.", key)

    def hybrid_to_gpt(self, key: str, mtp_inner: str | None = None) -> str:
        """The GPTModel key of a HybridModel key (``mtp_inner``: the GPT MTP layer's inner name; default
        ``layers.base.megatron_compat.mtp_inner_layer_name()``, the state-dict name)."""
        main, mtp = split_pattern(self.hybrid_pattern)
        found = _LAYER_KEY.match(key)
        if found and found["part"] in MIXER_PARTS + MLP_PARTS:
            mixers, mlps = self._positions(main)
            positions = mixers if found["part"] in MIXER_PARTS else mlps
            return f"{found['head']}{positions.index(int(found['index']))}.{found['part']}{found['rest']}"
        found = _MTP_KEY.match(key)
        if found and found["layers"] is not None:
            if mtp_inner is None:
                from layers.base.megatron_compat import mtp_inner_layer_name

                mtp_inner = mtp_inner_layer_name()
            return f"{found['head']}{mtp_inner}.{found['part']}{found['rest']}"
        return re.sub(r"(^|\.)decoder\.final_norm\.", r"\1decoder.final_layernorm.", key)
