"""What a registered mixer supports (:class:`MixerSupport`, ``MixerEntry.supports``) and the one refusal every entry
point gives for a combination it does not (:func:`refuse_unsupported`, :class:`UnsupportedByMixer`).

The example (``examples/pretrain``), the Megatron-LM launchers and ``python -m hp_megatron.generate`` call
:func:`refuse_unsupported` with the run's settings before any model is built, and print its message as one line with
exit status 2; the spec builders raise the same ``ValueError`` when asked to build what a mixer declares it cannot
run (``hp_megatron.specs``). A leaf of the registry: it imports nothing of megatron-core or torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from layers.base.choices import BACKENDS

# the HybridStackSubmodules slots of megatron-core's HybridModel a mixer layer may fill (megatron-core 0.19's
# hybrid_block.py; mamba_layer / dsa_layer exist there too, but no registered mixer of ours fills them yet)
STACK_SLOTS = ("gdn_layer", "attention_layer", "mla_layer", "mamba_layer", "dsa_layer")


class UnsupportedByMixer(ValueError):
    """A run asks a mixer for something it declares it does not support (``MixerEntry.supports``); the message is
    one line naming the mixer, the setting and the mixers that do support it. The command-line entry points exit
    with status 2 on it (a usage error: the combination cannot run)."""


@dataclass(frozen=True)
class MixerSupport:
    """What a mixer supports, declared at registration and read before anything is built.

    * ``cp_methods``: the context-parallel methods it runs (names of its own CP flag's choices, e.g. GDN's
      ``p2p`` ... ``auto``); ``()``: no context parallelism (``--context-parallel-size`` > 1 is refused).
    * ``thd``: packed sequences (megatron's ``PackedSeqParams`` with ``qkv_format="thd"``; the example's
      ``--reset-attention-mask``).
    * ``decode``: generation with a state cache (megatron-core's ``StaticInferenceContext``:
      ``layers.shared.inference``; ``python -m hp_megatron.generate``).
    * ``mtp``: megatron-core's multi-token-prediction layer can be this mixer (its spec's params hold the causal
      ``attn_mask_type`` megatron's MTP layer reads).
    * ``backends``: the ``--hp-backend`` values (``layers.base.choices.BACKENDS``) it runs under; a mixer with one
      implementation declares ``("eager",)`` and the others are refused, not silently run as eager.
    """

    cp_methods: tuple = ()
    thd: bool = False
    decode: bool = False
    mtp: bool = False
    backends: tuple = ("eager",)

    def __post_init__(self):
        for name in ("cp_methods", "backends"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
                raise TypeError(f"MixerSupport.{name} must be a tuple of names, got {value!r}")
        unknown = [b for b in self.backends if b not in BACKENDS]
        if unknown or not self.backends:
            raise ValueError(f"MixerSupport.backends must be a non-empty subset of {BACKENDS}, got {self.backends!r}")
        for name in ("thd", "decode", "mtp"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"MixerSupport.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def cp(self) -> bool:
        """Whether it runs under context parallelism at all."""
        return bool(self.cp_methods)


def _who(entries, what) -> str:
    """``"G=GDN, K=KDA"``: the mixers of ``entries`` for which ``what(entry)`` holds (or ``"none"``)."""
    return ", ".join(f"{e.symbol}={e.title}" for e in entries if what(e)) or "none"


def refuse_unsupported(used: Iterable, registered: Iterable, *, source: str, cp_size: int = 1, thd: bool = False,
                       decode: bool = False, mtp_symbol: Optional[str] = None, backend: Optional[str] = None) -> None:
    """Raise :class:`UnsupportedByMixer` (one line) when a mixer of ``used`` (``MixerEntry``s of the run's layers;
    ``source`` says where they come from, e.g. ``"--hp-layer-pattern TM"``) does not support the run: context
    parallelism (``cp_size`` > 1), packed sequences (``thd``), generation with a state cache (``decode``), the MTP
    layers' mixer (``mtp_symbol``, an entry of ``registered``) or the kernel ``backend``. ``registered``: every
    registered entry, named as the alternatives in the message."""
    used, registered = list(used), list(registered)
    for entry in used:
        s = entry.supports
        where = f"{entry.title} ({entry.symbol} in {source})"
        if cp_size > 1 and not s.cp:
            raise UnsupportedByMixer(f"{where} has no context-parallel implementation (MixerSupport.cp_methods is "
                                     f"empty); got --context-parallel-size {cp_size}; mixers with CP: "
                                     f"{_who(registered, lambda e: e.supports.cp)}")
        if thd and not s.thd:
            raise UnsupportedByMixer(f"{where} does not take packed sequences (THD; MixerSupport.thd is False), which "
                                     f"--reset-attention-mask asks for; mixers with THD: "
                                     f"{_who(registered, lambda e: e.supports.thd)}")
        if decode and not s.decode:
            raise UnsupportedByMixer(f"{where} has no generation path with a state cache (MixerSupport.decode is "
                                     f"False), which generation needs; mixers with decode: "
                                     f"{_who(registered, lambda e: e.supports.decode)}")
        if backend is not None and backend not in s.backends:
            raise UnsupportedByMixer(f"{where} runs under --hp-backend {' / '.join(s.backends)} only "
                                     f"(MixerSupport.backends); got --hp-backend {backend}")
    if mtp_symbol is not None:
        entry = next((e for e in registered if e.symbol == mtp_symbol), None)
        if entry is not None and not entry.supports.mtp:
            raise UnsupportedByMixer(f"{entry.title} ({mtp_symbol}, the multi-token-prediction layers' mixer of "
                                     f"{source}) cannot be megatron-core's MTP layer (MixerSupport.mtp is False); "
                                     f"mixers with MTP: {_who(registered, lambda e: e.supports.mtp)} "
                                     "(--hp-mtp-layer-symbol)")


def refuse_without_slot(entry, registered: Iterable, what: str) -> None:
    """:class:`UnsupportedByMixer` when ``entry`` declares no ``HybridModel`` slot (``MixerEntry.stack_slot``);
    ``what`` names the request (``"g_mixer"``); the message lists the registered mixers that have one."""
    if entry.stack_slot is None:
        slots = ", ".join(f"{e.name} ({e.stack_slot})" for e in registered if e.stack_slot) or "none"
        raise UnsupportedByMixer(f"{what}: mixer {entry.name!r} declares no slot of megatron-core's HybridModel "
                                 f"(MixerEntry.stack_slot is None); mixers with a slot: {slots}")
