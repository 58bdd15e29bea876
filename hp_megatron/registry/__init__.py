"""The mixer registry (registrations; the mixer classes live in ``layers.mixers``): the registry
(``hp_megatron.registry.entries``) and the built-in mixers, one module each (``gdn`` G, ``kda`` K, ``mla`` M,
``attention`` A, ``dsa`` D), registered when this package is imported.

A new mixer: one module that calls :func:`register_mixer` with a :class:`MixerEntry` (docs/architecture.md, "How to
add a mixer"); load it with ``--hp-mixer-module MODULE`` or import it before building specs.
"""
from hp_megatron.registry.entries import (
    MIXER_MODULE_FLAG, MixerEntry, check_hf_symbols, conversion_architectures, conversion_rules_of, describe_symbols,
    load_mixer_modules, mixer, mixer_modules_in, mixer_named, mixer_names, mixers, mtp_symbols, option_rows,
    register_conversion_rules, register_mixer, symbols, symbols_where)
from hp_megatron.registry.support import MixerSupport, UnsupportedByMixer, refuse_unsupported, refuse_without_slot
from hp_megatron.registry import gdn, kda, mla, attention, dsa  # noqa: E402,F401  (registration order: G K M A D)

__all__ = [
    "MIXER_MODULE_FLAG",
    "MixerEntry",
    "MixerSupport",
    "UnsupportedByMixer",
    "check_hf_symbols",
    "conversion_architectures",
    "conversion_rules_of",
    "describe_symbols",
    "load_mixer_modules",
    "mixer",
    "mixer_modules_in",
    "mixer_named",
    "mixer_names",
    "mixers",
    "mtp_symbols",
    "option_rows",
    "register_conversion_rules",
    "refuse_unsupported",
    "refuse_without_slot",
    "register_mixer",
    "symbols",
    "symbols_where",
]
