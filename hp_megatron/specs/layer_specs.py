"""Layer specs: one mixer per layer (``get_layer_spec``) or a repeating pattern of mixers (``get_hybrid_layer_spec``).

Every spec is a plain megatron-core ``ModuleSpec`` tree, so any submodule can be swapped by editing it:
``spec.submodules.layer_types["K"].self_attention.submodules.out_proj = MyRowParallelLinear`` (every spec is a
``HybridLayer``; a single-mixer spec has one symbol) or ``spec.submodules.moe_mlp = my_moe_spec``.

MoE: every spec carries megatron-core's ``MoELayer`` (router, token dispatcher, ``SequentialMLP`` experts, shared
experts with the optional shared-expert gate); the layers build it where ``config.num_moe_experts`` and
``config.moe_layer_freq`` say (see ``hp_megatron.hybrid_layer``), the dense MLP elsewhere.

Pattern symbols (``SYMBOLS``): ``G`` GDN, ``K`` KDA, ``M`` MLA, ``A`` standard causal softmax attention.
"""
from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from hp_megatron.hybrid_layer import HybridLayer, HybridLayerSubmodules, QKNormFromConfig, validate_pattern
from hp_megatron.specs.providers import get_spec_provider
from layers.base.megatron_compat import bind_moe_router_gemm, dense_mlp_spec

MIXERS = ("gdn", "kda", "mla", "attn")
SYMBOLS = {"G": "gdn", "K": "kda", "M": "mla", "A": "attn"}
OWN_POSITIONS = ("M",)  # MLA applies its own rotary embedding (or none); G/K ignore positions


def _qk_norm(provider, qk_layernorm):
    """The attention's q/k norm spec: ``qk_layernorm`` True, False, or "config" (``QKNormFromConfig``)."""
    if qk_layernorm == "config":
        return QKNormFromConfig(provider.layer_norm(rms_norm=True, for_qk=True))
    if not isinstance(qk_layernorm, bool):
        raise ValueError(f"qk_layernorm must be True, False or 'config' (follow config.qk_layernorm when the layer "
                         f"is built), got {qk_layernorm!r}")
    return provider.layer_norm(rms_norm=True, for_qk=True) if qk_layernorm else IdentityOp


def _attention_spec(provider, qk_layernorm, cp_layout) -> ModuleSpec:
    norm = _qk_norm(provider, qk_layernorm)
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=provider.column_parallel_linear(),
            core_attention=ModuleSpec(module=provider.core_attention(),
                                      params={"backend": provider.attention_backend,
                                              **({} if cp_layout is None else {"layout": cp_layout})}),
            linear_proj=provider.row_parallel_linear(),
            q_layernorm=norm,
            k_layernorm=norm,
        ),
    )


def _delta_mixer_spec(mixer: str, provider, cp_layout) -> ModuleSpec:
    from layers.mixers.delta.mixer import DeltaMixerSubmodules
    from layers.mixers.delta.gdn import GatedDeltaNet
    from layers.mixers.delta.kda import KimiDeltaAttention

    params = {"backend": provider.mixer_backend}
    if cp_layout is not None:
        params["cp_layout"] = cp_layout
    return ModuleSpec(
        module=GatedDeltaNet if mixer == "gdn" else KimiDeltaAttention,
        params=params,
        submodules=DeltaMixerSubmodules(
            in_proj=provider.column_parallel_linear(),
            out_norm=provider.gated_norm(),
            out_proj=provider.row_parallel_linear(),
        ),
    )


def _mla_spec(provider, cp_layout) -> ModuleSpec:
    from layers.mixers.mla.layer import MLASelfAttentionSubmodules, MultiLatentAttention

    norm = provider.layer_norm(rms_norm=True, for_qk=True)
    column, row = provider.column_parallel_linear(), provider.row_parallel_linear()
    return ModuleSpec(
        module=MultiLatentAttention,
        params={"attn_mask_type": AttnMaskType.causal, **({} if cp_layout is None else {"cp_layout": cp_layout})},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=column,
            linear_q_down_proj=column,
            linear_q_up_proj=column,
            linear_kv_down_proj=column,
            linear_kv_up_proj=column,
            core_attention=provider.latent_core_attention(),
            linear_proj=row,
            q_layernorm=norm,
            kv_layernorm=norm,
        ),
    )


def _moe_mlp_spec(provider) -> ModuleSpec:
    """megatron-core's MoE layer spec with this provider's linears (SequentialMLP experts)."""
    bind_moe_router_gemm()
    # num_experts is only checked for presence here; the layers read config.num_moe_experts
    return get_moe_module_spec_for_backend(provider, num_experts=0, moe_grouped_gemm=False)


def get_mixer_spec(mixer: str, backend="eager", *, qk_layernorm: bool | str = False, linear: str = "local",
                   cp_layout: str | None = None) -> ModuleSpec:
    """The ``self_attention`` spec of one mixer (``gdn | kda | mla | attn``) for a backend or provider.

    ``cp_layout`` (``zigzag | contiguous``) is written into the mixer's params; None leaves the mixer's own
    default (config ``hp_cp_layout``, set by ``--hp-cp-layout``; zigzag when unset)."""
    if mixer not in MIXERS:
        raise ValueError(f"mixer must be one of {MIXERS}, got {mixer!r}")
    provider = get_spec_provider(backend, linear=linear)
    if mixer == "attn":
        return _attention_spec(provider, qk_layernorm, cp_layout)
    if mixer == "mla":
        return _mla_spec(provider, cp_layout)
    return _delta_mixer_spec(mixer, provider, cp_layout)


def get_layer_submodules(mixer: str, backend="eager", *, qk_layernorm: bool | str = False, linear: str = "local",
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


def get_layer_spec(mixer: str, backend="eager", *, qk_layernorm: bool | str = False, linear: str = "local",
                   cp_layout: str | None = None) -> ModuleSpec:
    """A layer spec whose ``self_attention`` is one mixer in every layer (a one-symbol ``HybridLayer``, so MoE
    layers follow ``config.num_moe_experts`` / ``moe_layer_freq`` as in every spec here)."""
    symbol = {name: sym for sym, name in SYMBOLS.items()}.get(mixer)
    if symbol is None:
        raise ValueError(f"mixer must be one of {MIXERS}, got {mixer!r}")
    return get_hybrid_layer_spec(symbol, backend, qk_layernorm=qk_layernorm, linear=linear, cp_layout=cp_layout)


def get_hybrid_layer_spec(pattern: str | None, backend="eager", *, qk_layernorm: bool | str = False,
                          linear: str = "local", cp_layout: str | None = None,
                          mtp_symbol: str | None = None) -> ModuleSpec:
    """``ModuleSpec(HybridLayer)`` for a repeating layer pattern such as ``"KKKM"`` or ``"GGGA"``.

    Layer ``i`` (global, 1-based) gets the mixer of ``pattern[(i - 1) % len(pattern)]``, resolved when the
    layer is built, so every pipeline / virtual-pipeline stage builds the right types. ``pattern=None``
    holds every symbol and reads the pattern from ``config.hp_layer_pattern`` (``--hp-layer-pattern``)
    when the layers are built. ``qk_layernorm``: q/k RMSNorms in the attention (``A``) layers: True, False, or
    ``"config"``: as ``config.qk_layernorm`` (``--qk-layernorm``) says when the layers are built.
    ``mtp_symbol``: the kind of the multi-token-prediction layers built from this spec
    (``hp_megatron.specs.get_mtp_block_spec``); None: ``config.hp_mtp_layer_kind``, else the pattern's only symbol.
    """
    symbols = sorted(SYMBOLS) if pattern is None else sorted(set(validate_pattern(pattern, SYMBOLS)))
    if mtp_symbol is not None:
        validate_pattern(mtp_symbol, SYMBOLS)
        if len(mtp_symbol) != 1:
            raise ValueError(f"mtp_symbol must be one layer symbol of {sorted(SYMBOLS)}, got {mtp_symbol!r}")
        symbols = sorted(set(symbols) | {mtp_symbol})
    layer_types = {symbol: get_layer_submodules(SYMBOLS[symbol], backend, qk_layernorm=qk_layernorm,
                                                linear=linear, cp_layout=cp_layout)
                   for symbol in symbols}
    return ModuleSpec(module=HybridLayer, params={"pattern": pattern},
                      submodules=HybridLayerSubmodules(layer_types=layer_types, own_positions=OWN_POSITIONS,
                                                       moe_mlp=_moe_mlp_spec(get_spec_provider(backend, linear)),
                                                       mtp_symbol=mtp_symbol))
