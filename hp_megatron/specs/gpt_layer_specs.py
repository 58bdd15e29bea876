"""Layer specs: one mixer per layer (``get_layer_spec``) or a repeating pattern of mixers (``get_hybrid_layer_spec``).

Every spec is a plain megatron-core ``ModuleSpec`` tree, so any submodule can be swapped by editing it:
``spec.submodules.layer_types["K"].self_attention.submodules.out_proj = MyRowParallelLinear`` (every spec is a
``PatternLayer``; a single-mixer spec has one symbol) or ``spec.submodules.moe_mlp = my_moe_spec``.

MoE: every spec carries megatron-core's ``MoELayer`` (router, token dispatcher, ``SequentialMLP`` experts, shared
experts with the optional shared-expert gate); the layers build it where ``config.num_moe_experts`` and
``config.moe_layer_freq`` say (see ``hp_megatron.decoder.moe_layers``), the dense MLP elsewhere.

Pattern symbols (``SYMBOLS``, the mixer registry ``hp_megatron.registry``): ``G`` GDN, ``K`` KDA, ``M`` MLA, ``A``
standard causal softmax attention, plus any registered mixer (``--hp-mixer-module``).
"""
from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from hp_megatron.decoder.pattern import validate_pattern
from hp_megatron.gpt.layer import PatternLayer, PatternLayerSubmodules
from hp_megatron.registry import mixer_named, mixer_names, symbols, symbols_where
from hp_megatron.specs.providers import get_spec_provider
from layers.base.megatron_compat import bind_moe_router_gemm, dense_mlp_spec



def __getattr__(name):
    """``SYMBOLS`` (``{symbol: mixer name}``), ``MIXERS`` (the mixer names) and ``OWN_POSITIONS`` (the symbols whose
    mixer applies its own positions): live views of the registry (``hp_megatron.registry``)."""
    if name == "SYMBOLS":
        return symbols()
    if name == "MIXERS":
        return mixer_names()
    if name == "OWN_POSITIONS":
        return symbols_where(lambda e: e.own_positions)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _moe_mlp_spec(provider) -> ModuleSpec:
    """megatron-core's MoE layer spec with this provider's linears (SequentialMLP experts)."""
    bind_moe_router_gemm()
    # num_experts is only checked for presence here; the layers read config.num_moe_experts
    return get_moe_module_spec_for_backend(provider, num_experts=0, moe_grouped_gemm=False)


def get_mixer_spec(mixer: str, backend="eager", *, qk_layernorm: bool | str = False, linear: str | None = None,
                   cp_layout: str | None = None) -> ModuleSpec:
    """The ``self_attention`` spec of one registered mixer (``gdn | kda | mla | attn`` or a registered one's name)
    for a backend or provider: the registry entry's spec builder (``hp_megatron.registry``).

    ``cp_layout`` (``zigzag | contiguous``) is written into the mixer's params; None leaves the mixer's own
    default (config ``hp_cp_layout``, set by ``--hp-cp-layout``; zigzag when unset)."""
    entry = mixer_named(mixer)
    provider = get_spec_provider(backend, linear=linear)
    return entry.spec(provider, qk_layernorm=qk_layernorm, cp_layout=cp_layout)


def get_layer_submodules(mixer: str, backend="eager", *, qk_layernorm: bool | str = False, linear: str | None = None,
                         cp_layout: str | None = None) -> TransformerLayerSubmodules:
    """Pre-norm residual layer: RMSNorm -> mixer -> residual, RMSNorm -> MLP -> residual."""
    provider = get_spec_provider(backend, linear=linear)
    norm = provider.layer_norm(rms_norm=True)
    return TransformerLayerSubmodules(
        input_layernorm=norm,
        self_attention=get_mixer_spec(mixer, provider, qk_layernorm=qk_layernorm, cp_layout=cp_layout),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=norm,
        mlp=dense_mlp_spec(MLPSubmodules(linear_fc1=provider.column_parallel_linear(),
                                         linear_fc2=provider.row_parallel_linear())),
        mlp_bda=get_bias_dropout_add,
    )


def get_layer_spec(mixer: str, backend="eager", *, qk_layernorm: bool | str = False, linear: str | None = None,
                   cp_layout: str | None = None) -> ModuleSpec:
    """A layer spec whose ``self_attention`` is one mixer in every layer (a one-symbol ``PatternLayer``, so MoE
    layers follow ``config.num_moe_experts`` / ``moe_layer_freq`` as in every spec here)."""
    return get_hybrid_layer_spec(mixer_named(mixer).symbol, backend, qk_layernorm=qk_layernorm, linear=linear,
                                 cp_layout=cp_layout)


def get_hybrid_layer_spec(pattern: str | None, backend="eager", *, qk_layernorm: bool | str = False,
                          linear: str | None = None, cp_layout: str | None = None,
                          mtp_symbol: str | None = None) -> ModuleSpec:
    """``ModuleSpec(PatternLayer)`` for a repeating layer pattern such as ``"KKKM"`` or ``"GGGA"``.

    Layer ``i`` (global, 1-based) gets the mixer of ``pattern[(i - 1) % len(pattern)]``, resolved when the
    layer is built, so every pipeline / virtual-pipeline stage builds the right types. ``pattern=None``
    holds every symbol and reads the pattern from ``config.hp_layer_pattern`` (``--hp-layer-pattern``)
    when the layers are built. ``qk_layernorm``: q/k RMSNorms in the attention (``A``) layers: True, False, or
    ``"config"``: as ``config.qk_layernorm`` (``--qk-layernorm``) says when the layers are built.
    ``mtp_symbol``: the kind of the multi-token-prediction layers built from this spec
    (``hp_megatron.specs.get_mtp_block_spec``); None: ``config.hp_mtp_layer_symbol``, else the pattern's only symbol
    (both set and different: a ValueError when the MTP layers are built). ``linear``: ``local`` or ``te`` (None: the
    provider's, else ``local``), recorded in the spec for the MTP block's ``eh_proj``.
    """
    known = symbols()
    used = sorted(known) if pattern is None else sorted(set(validate_pattern(pattern, known)))
    if mtp_symbol is not None:
        validate_pattern(mtp_symbol, known)
        if len(mtp_symbol) != 1:
            raise ValueError(f"mtp_symbol must be one layer symbol of {sorted(known)}, got {mtp_symbol!r}")
        used = sorted(set(used) | {mtp_symbol})
    layer_types = {symbol: get_layer_submodules(known[symbol], backend, qk_layernorm=qk_layernorm,
                                                linear=linear, cp_layout=cp_layout)
                   for symbol in used}
    own_positions = symbols_where(lambda e: e.own_positions)
    provider = get_spec_provider(backend, linear)
    return ModuleSpec(module=PatternLayer, params={"pattern": pattern},
                      submodules=PatternLayerSubmodules(layer_types=layer_types, own_positions=own_positions,
                                                       moe_mlp=_moe_mlp_spec(provider), mtp_symbol=mtp_symbol,
                                                       linear=provider.linear_impl))
