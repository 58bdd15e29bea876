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
``-``   ``mlp_layer``               RMSNorm -> megatron-core's ``MLP`` (``--ffn-hidden-size``, ``--swiglu``)
``E``   ``moe_layer``               RMSNorm -> megatron-core's ``MoELayer`` (``SequentialMLP`` experts)
``M``   ``mamba_layer``             none: refused (``hp_megatron.hybrid_model.stack.check_slots``)
``D``   ``dsa_layer``               RMSNorm -> our DSA (``layers.mixers.mla.dsa``: MLA over the indexer's top-k tokens)
======  ==========================  ===========================================================================

KDA has no symbol of its own in ``HybridModel`` (its ``Symbols`` are fixed): ``g_mixer="kda"`` builds a stack spec
whose ``gdn_layer`` slot is our KDA, so ``G`` means KDA under that spec (``kda_hybrid_stack_spec``); a model with
both GDN and KDA layers is not expressible with one pattern. The decoder is ``hp_megatron.hybrid_model.stack.HybridStack``
(final norm ``RMSNorm``). Multi-token prediction (a ``/`` part of the pattern) needs ``mtp_block_spec``, which
these specs do not set (``HybridModel`` then refuses the pattern).
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
    """The names of the registered mixers that may fill HybridModel's ``G`` slot (``MixerEntry.stack_slot``)."""
    return tuple(mixers()[s].name for s in symbols_where(lambda e: e.stack_slot == "gdn_layer"))


def _megatron_hybrid():
    """megatron-core's HybridModel pieces; RuntimeError naming the version where it has none (before 0.19)."""
    try:
        from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules
        from megatron.core.ssm.mlp_layer import MLPLayer
        from megatron.core.transformer.transformer_layer import MoETransformerLayer
    except ImportError as err:
        from megatron.core.package_info import __version__

        raise RuntimeError(f"stack specs are for megatron-core's HybridModel (megatron.core.models.hybrid, "
                           f"megatron-core 0.19+); the installed megatron-core {__version__} has none ({err})"
                           ) from err
    return HybridStackSubmodules, MLPLayer, MoETransformerLayer


def _mixer_layer(mixer: str, provider, qk_layernorm, cp_layout) -> ModuleSpec:
    from hp_megatron.hybrid_model.stack import HybridStackLayer

    return ModuleSpec(module=HybridStackLayer, params={"own_positions": mixer_named(mixer).own_positions},
                      submodules=TransformerLayerSubmodules(
                          input_layernorm=provider.layer_norm(rms_norm=True),
                          self_attention=get_mixer_spec(mixer, provider, qk_layernorm=qk_layernorm,
                                                        cp_layout=cp_layout),
                          self_attn_bda=get_bias_dropout_add))


def get_hybrid_stack_spec(backend="eager", *, g_mixer: str = "gdn", qk_layernorm: bool | str = "config",
                          linear: str | None = None, cp_layout: str | None = None) -> ModuleSpec:
    """``ModuleSpec(HybridStack)`` with our layers in ``HybridModel``'s slots (module docstring).

    ``backend``: ``eager | triton | ascendc`` or a spec provider (``hp_megatron.specs.providers``); ``g_mixer``: the
    mixer of the ``G`` slot, ``gdn`` or ``kda``; ``qk_layernorm``: the attention layers' q/k RMSNorms (True, False
    or ``"config"``: per ``config.qk_layernorm``); ``cp_layout``: written into the mixers' params (None: their
    default, ``config.hp_cp_layout``)."""
    entry = mixer_named(g_mixer)
    refuse_without_slot(entry, mixers().values(), "g_mixer (the mixer of HybridModel's 'G' slot)")
    if entry.stack_slot != "gdn_layer":
        raise ValueError(f"g_mixer (the mixer of the 'G' slot) must be one of {g_mixers()}, got {g_mixer!r} (it "
                         f"fills HybridModel's {entry.stack_slot})")
    HybridStackSubmodules, MLPLayer, MoETransformerLayer = _megatron_hybrid()
    from hp_megatron.hybrid_model.stack import HybridStack

    provider = get_spec_provider(backend, linear=linear)
    norm = provider.layer_norm(rms_norm=True)
    mlp = dense_mlp_spec(MLPSubmodules(linear_fc1=provider.column_parallel_linear(),
                                       linear_fc2=provider.row_parallel_linear()))
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        gdn_layer=_mixer_layer(g_mixer, provider, qk_layernorm, cp_layout),
        attention_layer=_mixer_layer("attn", provider, qk_layernorm, cp_layout),
        mla_layer=_mixer_layer("mla", provider, qk_layernorm, cp_layout),
        dsa_layer=_mixer_layer("dsa", provider, qk_layernorm, cp_layout),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm, mlp=mlp, mlp_bda=get_bias_dropout_add)),
        moe_layer=ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm, mlp=_moe_mlp_spec(provider), mlp_bda=get_bias_dropout_add)),
    ))


# the module-level stack specs of hp_megatron.specs: name -> (backend, g_mixer)
STACK_SPECS = {f"{prefix}hybrid_stack{suffix}_spec": (backend, g_mixer)
               for prefix, g_mixer in (("", "gdn"), ("kda_", "kda"))
               for backend, suffix in (("eager", ""), ("triton", "_triton"), ("ascendc", "_ascendc"))}


def ready_stack_spec(name: str) -> ModuleSpec:
    """The module-level stack spec ``name`` of :data:`STACK_SPECS` (attention q/k norms per ``--qk-layernorm``)."""
    backend, g_mixer = STACK_SPECS[name]
    return get_hybrid_stack_spec(backend, g_mixer=g_mixer)
