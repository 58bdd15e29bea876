"""The mixer registry: pattern symbol -> :class:`MixerEntry` (mixer class, spec builder, config rows, CP-auto field,
what it supports: ``hp_megatron.registry.support``), read by the specs, the config checks, the flags, the MTP block
and the model presets.

A mixer is registered by a module that calls :func:`register_mixer` at import; the built-in ones
(``hp_megatron.registry.gdn`` / ``kda`` / ``mla`` / ``attention``) are imported by the package ``hp_megatron.registry``
itself, a third-party one by :func:`load_mixer_modules` (the flag ``--hp-mixer-module MODULE`` of every entry point,
handled before the pattern is checked). The mixer classes themselves live in ``layers.mixers`` (or anywhere).
"""
from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Optional

from hp_megatron.registry.megatron_fields import megatron_config_fields
from hp_megatron.registry.support import STACK_SLOTS, MixerSupport
from layers.base.options import SHARED_ROWS, OptionRow

MIXER_MODULE_FLAG = "--hp-mixer-module"


@dataclass(frozen=True)
class MixerEntry:
    """One mixer of the layer patterns.

    * ``symbol``: its one-letter pattern symbol (``--hp-layer-pattern``); ``name``: its spec name (``get_layer_spec``,
      the ready specs ``hp_megatron.specs.<name>_spec``, also for a registered mixer); ``title``: how messages name
      it (``"GDN"``).
    * ``spec(provider, *, qk_layernorm, cp_layout) -> ModuleSpec``: the ``self_attention`` spec of a layer, from a
      spec provider (``hp_megatron.specs.providers``); ``module``: ``"package.module:Class"`` of the mixer class.
    * ``options``: the mixer's flag-table rows (``layers.base.options.OptionRow``; flags, config fields, checks).
    * ``supports``: what it supports (:class:`~hp_megatron.registry.support.MixerSupport`: CP methods or none, THD,
      decode, MTP, backends), read by every entry point before a model is built; ``check_args(args)``: an optional
      argument-time check of its own (e.g. its heads against ``args.tensor_model_parallel_size``), run by
      ``hp_megatron.arguments.validate_hp_args`` when the pattern uses the mixer; it raises a one-line ValueError
      naming the flags.
    * ``family``: ``"delta"`` (GDN/KDA: linear heads checked against TP x Ulysses), ``"mla"``, ``"attention"`` or
      the mixer's own word; ``model_rope``: it reads the model's rotary tables (RoPE; zigzag under CP);
      ``own_positions``: it computes its own positions, so the model's rotary tables are dropped for it;
      ``stack_slot``: the ``HybridStackSubmodules`` slot of megatron-core's ``HybridModel`` it may fill
      (``hp_megatron.registry.support.STACK_SLOTS``; None: it cannot be a HybridModel layer).
    * ``mtp``: read-only view of ``supports.mtp`` (megatron-core's MTP layer can be this mixer); passing
      ``mtp=`` (the field of earlier releases) still works and sets ``supports.mtp``, with a DeprecationWarning.
    * ``cp_auto_field``: the config field whose value ``"auto"`` picks the CP method from the cost model
      (``layers.cp.auto``), None when the mixer has no ``auto``.

    A mixer's HF conversion rules in an architecture are registered by the architecture's module (or the mixer's),
    not here: :func:`register_conversion_rules`.
    """

    symbol: str
    name: str
    title: str
    spec: Callable
    module: str
    options: tuple = ()
    family: str = ""
    model_rope: bool = False
    own_positions: bool = False
    mtp: Optional[bool] = None
    stack_slot: Optional[str] = None
    cp_auto_field: Optional[str] = None
    supports: MixerSupport = MixerSupport()
    check_args: Optional[Callable] = None

    def __post_init__(self):
        if not (isinstance(self.symbol, str) and len(self.symbol) == 1 and self.symbol.isalpha()):
            raise ValueError(f"MixerEntry.symbol must be one letter, got {self.symbol!r}")
        if not (isinstance(self.name, str) and self.name.isidentifier()):
            raise ValueError(f"MixerEntry.name must be an identifier, got {self.name!r}")
        if not callable(self.spec):
            raise TypeError(f"MixerEntry {self.name}: spec must be callable, got {self.spec!r}")
        bad = [r for r in self.options if not isinstance(r, OptionRow)]
        if bad:
            raise TypeError(f"MixerEntry {self.name}: options must be OptionRow objects, got {bad!r}")
        if not isinstance(self.supports, MixerSupport):
            raise TypeError(f"MixerEntry {self.name}: supports must be a MixerSupport, got {self.supports!r}")
        if self.check_args is not None and not callable(self.check_args):
            raise TypeError(f"MixerEntry {self.name}: check_args must be callable or None, got {self.check_args!r}")
        if self.stack_slot is not None and self.stack_slot not in STACK_SLOTS:
            raise ValueError(f"MixerEntry {self.name}: stack_slot must be one of {STACK_SLOTS} or None, got "
                             f"{self.stack_slot!r}")
        if self.mtp is not None:   # the bool of earlier releases: folded into supports
            if self.supports.mtp and not self.mtp:
                raise ValueError(f"MixerEntry {self.name}: mtp={self.mtp} contradicts supports.mtp=True; give "
                                 "supports only")
            warnings.warn(f"MixerEntry {self.name}: mtp= is deprecated; declare supports=MixerSupport(mtp=...)",
                          DeprecationWarning, stacklevel=3)
            object.__setattr__(self, "supports", replace(self.supports, mtp=bool(self.mtp)))
        object.__setattr__(self, "mtp", self.supports.mtp)

    def mixer_class(self) -> type:
        """The mixer class named by ``module`` (imported now)."""
        return resolve(self.module)


_REGISTRY: dict = {}


def resolve(reference: str):
    """The object of ``"package.module:attribute"``."""
    module, _, attr = reference.partition(":")
    return getattr(importlib.import_module(module), attr)


def register_mixer(entry: MixerEntry) -> MixerEntry:
    """Add ``entry``; registering the same entry again is a no-op. ValueError naming the clash for: a taken symbol
    or name; a row whose flag or config field another mixer (or hp_megatron's shared rows, or ``--hp-mixer-module``)
    declares differently (a row may be shared as it is: GDN and KDA share the delta rows); a row whose field is
    megatron-core's own config field (``TransformerConfig`` / ``MLATransformerConfig``) without
    ``OptionRow.megatron_field`` (it would overwrite megatron's value, and the fields megatron derives from it would
    go stale)."""
    if not isinstance(entry, MixerEntry):
        raise TypeError(f"register_mixer needs a MixerEntry, got {type(entry).__name__}")
    known = _REGISTRY.get(entry.symbol)
    if known == entry:
        return entry
    if known is not None:
        raise ValueError(f"mixer symbol {entry.symbol!r} is taken by {known.name!r} ({known.module})")
    for other in _REGISTRY.values():
        if other.name == entry.name:
            raise ValueError(f"mixer name {entry.name!r} is taken by symbol {other.symbol!r} ({other.module})")
    megatron = megatron_config_fields()
    unmarked = sorted(r.field for r in entry.options if r.field in megatron and not r.megatron_field)
    if unmarked:
        raise ValueError(f"mixer {entry.name!r}: config fields {unmarked} are megatron-core's own (TransformerConfig"
                         "); a row that sets one declares OptionRow(megatron_field=True), else give it a field of "
                         "the mixer's own")
    marked = sorted(r.field or str(r.flag) for r in entry.options if r.megatron_field and r.field not in megatron)
    if marked:
        raise ValueError(f"mixer {entry.name!r}: rows {marked} declare megatron_field=True, but megatron-core's "
                         "config has no such field")
    owners = [(other.name, other.options) for other in _REGISTRY.values()]
    owners.append(("hp_megatron (shared rows)", SHARED_ROWS))
    for owner, rows in owners:
        clash = sorted({str(name) for r in entry.options if r not in rows for o in rows
                        for name in {r.flag, r.field} & {o.flag, o.field} if name is not None})
        if clash:
            raise ValueError(f"mixer {entry.name!r}: {clash} already belong to {owner!r} (declared differently)")
    if any(r.flag == MIXER_MODULE_FLAG for r in entry.options):
        raise ValueError(f"mixer {entry.name!r}: {MIXER_MODULE_FLAG} is hp_megatron's own flag")
    _REGISTRY[entry.symbol] = entry
    return entry


def mixers() -> dict:
    """``{symbol: MixerEntry}`` of every registered mixer, in registration order."""
    return dict(_REGISTRY)


def mixer(symbol: str) -> MixerEntry:
    """The entry of ``symbol``; ValueError naming the known symbols."""
    if symbol not in _REGISTRY:
        raise ValueError(f"no mixer is registered under symbol {symbol!r}; known: {describe_symbols()}")
    return _REGISTRY[symbol]


def mixer_named(name: str) -> MixerEntry:
    """The entry whose ``name`` is ``name``; ValueError naming the known names."""
    for entry in _REGISTRY.values():
        if entry.name == name:
            return entry
    raise ValueError(f"mixer must be one of {mixer_names()}, got {name!r}")


def symbols() -> dict:
    """``{symbol: name}`` of the registered mixers."""
    return {s: e.name for s, e in _REGISTRY.items()}


def mixer_names() -> tuple:
    return tuple(e.name for e in _REGISTRY.values())


def describe_symbols() -> str:
    """``"G=GDN, K=KDA, M=MLA, A=attention"`` for messages and help texts."""
    return ", ".join(f"{s}={e.title}" for s, e in _REGISTRY.items())


def symbols_where(predicate) -> tuple:
    """The registered symbols whose entry satisfies ``predicate(entry)``."""
    return tuple(s for s, e in _REGISTRY.items() if predicate(e))


def mtp_symbols() -> tuple:
    """The symbols megatron-core's MTP layer can be (``MixerSupport.mtp``: layers whose spec has a causal attention
    mask type), sorted."""
    return tuple(sorted(symbols_where(lambda e: e.supports.mtp)))


def option_rows() -> tuple:
    """Every registered mixer's flag-table rows (a shared row once), in registration order."""
    return tuple(dict.fromkeys(r for e in _REGISTRY.values() for r in e.options))


_CONVERSION: dict = {}   # (architecture, symbol) -> rules function


def register_conversion_rules(architecture: str, symbol: str, rules: Callable) -> Callable:
    """Register the HF conversion rules of mixer ``symbol`` in ``architecture``:
    ``rules(mcore_prefix, hf_layer_prefix, hf, preset) -> [TensorRule]`` (``mcore_prefix``: the layer's
    ``...self_attention.``; ``hf_layer_prefix``: the HF decoder layer's ``model.layers.<i>.``; ``hf``: config.json as
    a dict; ``preset``: the architecture's ``ModelPreset``). Called by the architecture's module at import (imports
    go models -> registry); the same function again is a no-op, another one a ValueError. Returns ``rules``."""
    entry = mixer(symbol)
    if not callable(rules):
        raise TypeError(f"conversion rules of {entry.name!r} in {architecture}: expected a callable, got {rules!r}")
    known = _CONVERSION.get((architecture, symbol))
    if known is not None and known is not rules:
        raise ValueError(f"{architecture}: mixer {entry.name!r} ({symbol}) already has conversion rules "
                         f"({known.__module__}.{known.__qualname__})")
    _CONVERSION[(architecture, symbol)] = rules
    return rules


def conversion_architectures(symbol: str) -> list:
    """The architectures mixer ``symbol`` has conversion rules for, sorted."""
    return sorted(arch for arch, s in _CONVERSION if s == symbol)


def conversion_rules_of(architecture: str, symbol: str):
    """The conversion-rule function of mixer ``symbol`` in ``architecture`` (:func:`register_conversion_rules`);
    ValueError naming the architectures the mixer has rules for."""
    entry = mixer(symbol)
    if (architecture, symbol) not in _CONVERSION:
        raise ValueError(f"{architecture}: mixer {entry.name!r} ({symbol}) has no conversion rules for it; it has "
                         f"them for {conversion_architectures(symbol) or 'no architecture'}")
    return _CONVERSION[(architecture, symbol)]


def check_hf_symbols(architecture: str, layer_symbols: Mapping[str, str]) -> Mapping[str, str]:
    """An architecture's ``{HF layer type: pattern symbol}`` map, checked against the registry (ValueError naming
    the symbols no mixer is registered under); returned unchanged."""
    unknown = sorted(set(layer_symbols.values()) - set(_REGISTRY))
    if unknown:
        raise ValueError(f"{architecture}: layer symbols {unknown} have no registered mixer ({describe_symbols()})")
    return layer_symbols


def mixer_modules_in(argv) -> list:
    """The modules named by ``--hp-mixer-module MODULE`` / ``--hp-mixer-module=MODULE`` in ``argv``, in order."""
    argv, found = list(argv), []
    for i, arg in enumerate(argv):
        if arg == MIXER_MODULE_FLAG and i + 1 < len(argv):
            found.append(argv[i + 1])
        elif arg.startswith(MIXER_MODULE_FLAG + "="):
            found.append(arg.split("=", 1)[1])
    return found


def load_mixer_modules(modules) -> None:
    """Import each module (which registers its mixers); ImportError naming the flag and the module."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise ImportError(f"{MIXER_MODULE_FLAG} {name}: cannot import it ({err})") from err
