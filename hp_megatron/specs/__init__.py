"""Layer specs for megatron-core's GPT builder: GDN, KDA, MLA and attention layers, alone or as a hybrid.

Functions (build a spec for any backend):
  ``get_layer_spec(mixer, backend="eager")``        mixer in ``gdn | kda | mla | attn``
  ``get_hybrid_layer_spec(pattern, backend="eager")``  e.g. ``"KKKM"`` (Kimi Linear), ``"GGGA"`` (Qwen3-Next)
  ``EagerSpecProvider``, ``TritonSpecProvider``, ``AscendCSpecProvider``  (megatron ``BackendSpecProvider`` shape)

Ready module-level specs, for Megatron-LM's ``--spec hp_megatron.specs NAME`` (which imports the object
and does not call it); each exists for the three backends (suffix ``_triton`` / ``_ascendc``):

  ``kimi_linear_spec``  pattern KKKM     ``qwen3_next_spec``  pattern GGGA
  ``gdn_spec`` ``kda_spec`` ``mla_spec`` ``attn_spec``  one mixer in every layer
  ``<name>_spec``  the same for a mixer registered later (``--hp-mixer-module``; ``MixerEntry.name``), built on
                   first access (``--spec hp_megatron.specs toy_ema_spec``)
  ``hybrid_spec``  the pattern of ``--hp-layer-pattern`` (``config.hp_layer_pattern``), read at build time

Their attention (``A``) layers get q/k RMSNorms when ``--qk-layernorm`` (``config.qk_layernorm``) is set, as
Qwen3-Next's attention has (with ``--attention-output-gate`` for its output gate).

Stack specs for megatron-core's ``HybridModel`` (megatron-core 0.19+, Megatron-LM's ``pretrain_hybrid.py --spec
hp_megatron.specs NAME --hybrid-layer-pattern ...``; ``hp_megatron.specs.hybrid_stack_specs``), built when first used:

  ``hybrid_stack_spec``  ``G`` our GDN, ``*`` attention, ``+`` our MLA, ``-`` MLP, ``E`` MoE
  ``kda_hybrid_stack_spec``  the same with our KDA in the ``G`` slot (HybridModel has no KDA symbol)

each also with suffix ``_triton`` / ``_ascendc`` before ``_spec`` (``hybrid_stack_triton_spec``).

Every spec builds megatron-core MoE layers where ``--num-experts`` / ``--moe-layer-freq`` ask for them
(``hp_megatron.decoder.moe_layers``); real architectures from HF config.json files: ``hp_megatron.models``.
"""
from hp_megatron.gpt.layer import PatternLayer, PatternLayerSubmodules
from layers.mixers.attention.context_parallel import ContextParallelDotProductAttention
from hp_megatron.specs.hybrid_stack_specs import STACK_SPECS, get_hybrid_stack_spec, ready_stack_spec
from hp_megatron.registry import mixer_names, symbols
from hp_megatron.specs.gpt_layer_specs import (get_hybrid_layer_spec, get_layer_spec, get_layer_submodules,
                                               get_mixer_spec)
from hp_megatron.specs.providers import (AscendCSpecProvider, EagerSpecProvider, TritonSpecProvider,
                                         get_spec_provider)

READY_PATTERNS = {"kimi_linear": "KKKM", "qwen3_next": "GGGA"}
READY_MTP_SYMBOLS = {"qwen3_next": "A"}  # the kind of the MTP layers (Qwen3-Next's: gated attention + MoE)
_SUFFIX = {"eager": "", "triton": "_triton", "ascendc": "_ascendc"}


BUILTIN_MIXERS = ("gdn", "kda", "mla", "attn")  # the ready one-mixer specs; a registered mixer: get_layer_spec
# the pattern-less specs (every registered symbol, pattern from --hp-layer-pattern): built on first access, so that
# mixers registered by --hp-mixer-module before the model is built are in them
LAZY_SPECS = {f"hybrid{suffix}_spec": backend for backend, suffix in _SUFFIX.items()}


def _ready_specs():
    specs = {}
    for backend, suffix in _SUFFIX.items():
        for name, pattern in READY_PATTERNS.items():
            specs[f"{name}{suffix}_spec"] = get_hybrid_layer_spec(pattern, backend, qk_layernorm="config",
                                                                    mtp_symbol=READY_MTP_SYMBOLS.get(name))
        for mixer in BUILTIN_MIXERS:
            specs[f"{mixer}{suffix}_spec"] = get_layer_spec(mixer, backend, qk_layernorm="config")
    return specs


_ready_specs_dict = _ready_specs()
READY_SPECS = sorted([*_ready_specs_dict, *LAZY_SPECS])
globals().update(_ready_specs_dict)
del _ready_specs_dict

def _registered_mixer_spec(name: str):
    """``(mixer name, backend)`` when ``name`` is ``<registered mixer><backend suffix>_spec``, else None."""
    for backend, suffix in _SUFFIX.items():
        mixer = name[:-len(suffix + "_spec")] if name.endswith(suffix + "_spec") else None
        if mixer and mixer in mixer_names() and mixer not in BUILTIN_MIXERS:
            return mixer, backend
    return None


def __getattr__(name):
    """Built on first access, then module globals (Megatron-LM's ``import_module`` reads ``vars(module)`` after its
    ``from``-import has touched the name): the stack specs of ``STACK_SPECS`` (``hybrid_stack_spec`` ...; they need
    megatron-core's HybridModel, 0.19+, and ``import hp_megatron.specs`` works on every supported version) and the
    pattern-less ``hybrid*_spec`` of :data:`LAZY_SPECS` (every mixer registered by then), the one-mixer
    ``<name>_spec`` of a mixer registered after this module was imported. ``SYMBOLS`` / ``MIXERS``:
    the registry's ``{symbol: name}`` and names, read now."""
    if name == "SYMBOLS":
        return symbols()
    if name == "MIXERS":
        return mixer_names()
    if name in LAZY_SPECS:
        spec = globals()[name] = get_hybrid_layer_spec(None, LAZY_SPECS[name], qk_layernorm="config")
        return spec
    registered = _registered_mixer_spec(name)
    if registered is not None:
        mixer, backend = registered
        spec = globals()[name] = get_layer_spec(mixer, backend, qk_layernorm="config")
        return spec
    if name not in STACK_SPECS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    spec = globals()[name] = ready_stack_spec(name)
    return spec


__all__ = ["AscendCSpecProvider", "ContextParallelDotProductAttention", "EagerSpecProvider", "PatternLayer",
           "PatternLayerSubmodules", "MIXERS", "READY_SPECS", "STACK_SPECS", "SYMBOLS", "TritonSpecProvider",
           "get_hybrid_layer_spec", "get_hybrid_stack_spec", "get_layer_spec", "get_layer_submodules",
           "get_mixer_spec", "get_spec_provider", *READY_SPECS]
