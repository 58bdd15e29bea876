"""Stack specs for megatron-core's ``HybridModel`` (megatron-core 0.19+; Megatron-LM's ``pretrain_hybrid.py
--spec hp_megatron.specs NAME --hybrid-layer-pattern ...``) with our layers in its slots.

``HybridModel`` takes the layer order from its pattern and each layer from a slot of the stack spec
(``HybridStackSubmodules``); every layer is either a mixer or an MLP, each pre-norm and residual:

======  ==========================  ===========================================================================
symbol  slot                        our layer (``get_hybrid_stack_spec``)
======  ==========================  ===========================================================================
``G``   ``gdn_layer``               RMSNorm -> our GDN (``layers.mixers.delta.gdn``); with ``g_mixer="kda"`` our KDA
``*``   ``attention_layer``         RMSNorm -> causal softmax attention (``ContextParallelDotProductAttention``,
                                    q/k RMSNorms per ``--qk-layernorm``), the model's RoPE
``+``   ``mla_layer``               RMSNorm -> our MLA (``layers.mixers.mla.layer``; its own rotary embedding)
``-``   ``mlp_layer``               RMSNorm -> megatron-core's ``MLP`` (``--ffn-hidden-size``, ``--swiglu``); its GPT
                                    layer's SwiGLU limits / post-norm (``hybrid_model.stack.HybridMLPLayer``)
``E``   ``moe_layer``               RMSNorm -> megatron-core's ``MoELayer`` (``SequentialMLP`` experts); SwiGLU limits
``M``   ``mamba_layer``             none: refused (``hp_megatron.hybrid_model.stack.check_slots``)
``D``   ``dsa_layer``               RMSNorm -> our DSA (``layers.mixers.mla.dsa``: MLA over the indexer's top-k tokens)
======  ==========================  ===========================================================================

Slots come from the registry: each mixer's ``MixerEntry.stack_slot`` (or megatron-core's own slot
``<name>_layer`` where an installed version has one, e.g. ``K`` / ``kda_layer``:
``hp_megatron.hybrid_model.numbering.hybrid_symbol_of``). A slot several of our mixers declare (``G``: GDN and KDA)
holds all of them; ``g_mixer`` is the one its layers take by default and ``slot_mixers`` (``{HybridModel layer
number: our symbol}``, ``numbering.delta_slot_mixers``) picks per layer, so one model holds GDN and KDA layers
(``hp_megatron.model_builders.hybrid_model`` derives it from ``config.hp_layer_pattern``). The decoder is
``hp_megatron.hybrid_model.stack.HybridStack`` (final norm ``RMSNorm``). Multi-token prediction (a ``/`` part of
the pattern), with ``mtp=True``: ``mtp_block_spec`` is megatron-core's MTP block of
``hp_megatron.decoder.mtp.GlobalShiftMTPLayer`` layers (the inner layers are the pattern's, built by megatron-core
from these slots; the losses are ``hp_megatron.hybrid_model.model.MTPHybridModel``'s, whose token shift works under
CP and on CPU). The module-level stack specs (Megatron-LM's ``--spec``) set none: megatron-core's ``HybridModel``
refuses ``/`` patterns with them rather than mix its ``roll_tensor`` losses with our shift.
"""
from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from hp_megatron.registry import mixer_named, mixers, refuse_without_slot, symbols_where
from hp_megatron.specs.gpt_layer_specs import _moe_mlp_spec, get_mixer_spec
from hp_megatron.specs.providers import get_spec_provider
from layers.base.megatron_compat import dense_mlp_spec


def g_mixers() -> tuple:
    """The names of the registered mixers that declare HybridModel's ``G`` slot (``MixerEntry.stack_slot``; read
    without megatron-core's HybridModel, which 0.16 lacks)."""
    return tuple(e.name for e in mixers().values() if e.stack_slot == "gdn_layer")


def _megatron_hybrid():
    """megatron-core's HybridModel pieces; RuntimeError naming the version where it has none (before 0.19)."""
    try:
        from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules
    except ImportError as err:
        from megatron.core.package_info import __version__

        raise RuntimeError(f"stack specs are for megatron-core's HybridModel (megatron.core.models.hybrid, "
                           f"megatron-core 0.19+); the installed megatron-core {__version__} has none ({err})"
                           ) from err
    return HybridStackSubmodules


def slot_symbols() -> dict:
    """``{HybridStackSubmodules field: (our mixer symbols in registration order)}`` of every registered mixer that
    declares a HybridModel slot."""
    from hp_megatron.hybrid_model.numbering import hybrid_symbol_of
    from hp_megatron.hybrid_model.stack import SLOTS

    out: dict = {}
    for symbol in symbols_where(lambda e: e.stack_slot is not None):
        out.setdefault(SLOTS[hybrid_symbol_of(symbol)], []).append(symbol)
    return {slot: tuple(found) for slot, found in out.items()}


def _mixer_layer(default: str, slot_mixers, provider, qk_layernorm, cp_layout) -> ModuleSpec:
    """The layer spec of a mixer slot: ``default`` (our symbol) or, per layer, ``slot_mixers``' symbol."""
    from hp_megatron.hybrid_model.stack import HybridStackLayer
    from hp_megatron.registry import mixer

    def mixer_spec(symbol):
        return get_mixer_spec(mixer(symbol).name, provider, qk_layernorm=qk_layernorm, cp_layout=cp_layout)

    params = {"own_positions": mixer(default).own_positions, "symbol": default}
    if slot_mixers and set(slot_mixers.values()) != {default}:
        if any(mixer(s).own_positions != params["own_positions"] for s in slot_mixers.values()):
            raise ValueError(f"the mixers of one HybridModel slot {sorted(set(slot_mixers.values()))} differ in "
                             "whether they take the model's rotary tables")
        params.update(mixer_by_layer=dict(slot_mixers),
                      mixer_specs={s: mixer_spec(s) for s in sorted(set(slot_mixers.values()))})
    return ModuleSpec(module=HybridStackLayer, params=params, submodules=TransformerLayerSubmodules(
        input_layernorm=provider.layer_norm(rms_norm=True), self_attention=mixer_spec(default),
        self_attn_bda=get_bias_dropout_add))


def hybrid_mtp_block_spec(provider):
    """megatron-core's MTP block spec of :class:`GlobalShiftMTPLayer` layers for ``HybridModel``: our norms and
    ``eh_proj``; the inner layers are built by megatron-core from the stack's slots and the ``/`` pattern."""
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlockSubmodules

    from hp_megatron.decoder.mtp import GlobalShiftMTPLayer
    from layers.base.megatron_compat import mtp_layer_submodules

    norm = provider.layer_norm(rms_norm=True)
    layer = ModuleSpec(module=GlobalShiftMTPLayer, submodules=mtp_layer_submodules(
        enorm=norm, hnorm=norm, eh_proj=provider.column_parallel_linear(), layer=None, layer_norm=norm))
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer])


def get_hybrid_stack_spec(backend="eager", *, g_mixer: str = "gdn", qk_layernorm: bool | str = "config",
                          linear: str | None = None, cp_layout: str | None = None,
                          slot_mixers: dict | None = None, mtp: bool = False) -> ModuleSpec:
    """``ModuleSpec(HybridStack)`` with our layers in ``HybridModel``'s slots (module docstring) and the MTP block.

    ``backend``: ``eager | triton | ascendc`` or a spec provider (``hp_megatron.specs.providers``); ``g_mixer``: the
    default mixer of the ``G`` slot, ``gdn`` or ``kda``; ``slot_mixers``: ``{HybridModel layer number: our symbol}``
    for layers of a shared slot (GDN and KDA layers in one model); ``qk_layernorm``: the attention layers' q/k
    RMSNorms (True, False or ``"config"``: per ``config.qk_layernorm``); ``cp_layout``: written into the mixers'
    params (None: their default, ``config.hp_cp_layout``); ``mtp``: set ``mtp_block_spec`` (for
    ``MTPHybridModel``, whose losses are ours; megatron-core's ``HybridModel`` would compute them with
    ``roll_tensor``, so the module-level specs Megatron-LM imports leave it unset and ``/`` patterns are refused)."""
    from hp_megatron.registry import mixer

    entry = mixer_named(g_mixer)
    refuse_without_slot(entry, mixers().values(), "g_mixer (the mixer of HybridModel's 'G' slot)")
    if entry.stack_slot != "gdn_layer":
        raise ValueError(f"g_mixer (the mixer of the 'G' slot) must be one of {g_mixers()}, got {g_mixer!r} (it "
                         f"fills HybridModel's {entry.stack_slot})")
    HybridStackSubmodules = _megatron_hybrid()
    from hp_megatron.hybrid_model.stack import HybridMLPLayer, HybridMoELayer, HybridStack

    provider = get_spec_provider(backend, linear=linear)
    norm = provider.layer_norm(rms_norm=True)
    mlp = dense_mlp_spec(MLPSubmodules(linear_fc1=provider.column_parallel_linear(),
                                       linear_fc2=provider.row_parallel_linear()))
    slot_mixers = dict(slot_mixers or {})
    mixer_slots = {}
    for slot, ours in slot_symbols().items():
        default = next((s for s in ours if mixer(s).name == g_mixer), ours[0])
        mine = {n: s for n, s in slot_mixers.items() if s in ours}
        mixer_slots[slot] = _mixer_layer(default, mine, provider, qk_layernorm, cp_layout)
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        **mixer_slots,
        mlp_layer=ModuleSpec(module=HybridMLPLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm, mlp=mlp, mlp_bda=get_bias_dropout_add)),
        moe_layer=ModuleSpec(module=HybridMoELayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm, mlp=_moe_mlp_spec(provider), mlp_bda=get_bias_dropout_add)),
        mtp_block_spec=hybrid_mtp_block_spec(provider) if mtp else None,
    ))


# the module-level stack specs of hp_megatron.specs: name -> (backend, g_mixer)
STACK_SPECS = {f"{prefix}hybrid_stack{suffix}_spec": (backend, g_mixer)
               for prefix, g_mixer in (("", "gdn"), ("kda_", "kda"))
               for backend, suffix in (("eager", ""), ("triton", "_triton"), ("ascendc", "_ascendc"))}


def ready_stack_spec(name: str) -> ModuleSpec:
    """The module-level stack spec ``name`` of :data:`STACK_SPECS` (attention q/k norms per ``--qk-layernorm``)."""
    backend, g_mixer = STACK_SPECS[name]
    return get_hybrid_stack_spec(backend, g_mixer=g_mixer)
