"""The multi-token-prediction block spec of a hybrid model: megatron-core's ``MultiTokenPredictionBlock`` (the
``mtp_block_spec`` of ``GPTModel``, Megatron's ``--mtp-num-layers`` / ``--mtp-loss-scaling-factor``) whose layers
are ``hp_megatron.decoder.mtp.GlobalShiftMTPLayer`` around a ``PatternLayer`` of a fixed kind.

Each MTP layer: ``enorm`` / ``hnorm`` / ``final_layernorm`` are our RMSNorm (zero-centred with
``layernorm_zero_centered_gamma``, as Qwen3-Next's), ``eh_proj`` the provider's column-parallel linear, and its
transformer layer (``transformer_layer``; megatron-core 0.19: ``mtp_model_layer``) an ``MTPPatternLayer`` of the
layer spec: the kind the spec declares (``mtp_symbol``, ``config.hp_mtp_layer_symbol``, or the pattern's only symbol;
DeepSeek-V3: MLA, Qwen3-Next: gated attention), with the MoE MLP when the model has experts.
"""
from __future__ import annotations

from megatron.core.transformer.multi_token_prediction import (MultiTokenPredictionBlockSubmodules,
                                                              get_mtp_num_layers_to_build)
from megatron.core.transformer.spec_utils import ModuleSpec

from hp_megatron.gpt.layer import PatternLayer, PatternLayerSubmodules, mtp_layer_symbol
from hp_megatron.gpt.mtp_layer import MTPPatternLayer
from hp_megatron.registry import mixers, refuse_unsupported
from hp_megatron.specs.providers import get_spec_provider
from layers.base.megatron_compat import mtp_layer_submodules


def mtp_transformer_layer_spec(config, layer_spec: ModuleSpec) -> ModuleSpec:
    """The ``MTPPatternLayer`` spec of the MTP layers: ``layer_spec`` reduced to its MTP kind."""
    if not (isinstance(layer_spec, ModuleSpec) and isinstance(layer_spec.module, type)
            and issubclass(layer_spec.module, PatternLayer)):
        raise TypeError("multi-token prediction needs a PatternLayer layer spec (hp_megatron.specs), "
                        f"got {layer_spec!r}")
    submodules: PatternLayerSubmodules = layer_spec.submodules
    pattern = layer_spec.params.get("pattern") or getattr(config, "hp_layer_pattern", None)
    if pattern is None:
        raise ValueError("multi-token prediction with a pattern-less PatternLayer spec reads config.hp_layer_pattern "
                         "(--hp-layer-pattern), which is not set")
    kind = mtp_layer_symbol(submodules, pattern, config)
    refuse_unsupported([], mixers().values(), source=f"the pattern {pattern}", mtp_symbol=kind)
    mixer_spec = submodules.layer_types[kind].self_attention
    if "attn_mask_type" not in (getattr(mixer_spec, "params", None) or {}):
        raise ValueError(f"MTP layer kind {kind!r}: its mixer declares MTP support (MixerSupport.mtp), but its spec's "
                         "params have no attn_mask_type, which megatron-core's MTP layer reads (give "
                         "params={'attn_mask_type': AttnMaskType.causal})")
    params = {k: v for k, v in layer_spec.params.items() if k not in ("pattern", "mtp")}
    return ModuleSpec(module=MTPPatternLayer, submodules=submodules.layer_types[kind],
                      params={**params, "symbol": kind, "moe_mlp": submodules.moe_mlp,
                              "own_positions": submodules.own_positions})


def get_mtp_block_spec(config, layer_spec: ModuleSpec, backend="eager", *, vp_stage=None, pp_rank=None,
                       linear: str | None = None):
    """``MultiTokenPredictionBlockSubmodules`` of this pipeline stage (the last one builds every MTP layer), or None
    without ``config.mtp_num_layers`` or on other stages; ``backend``: the layer spec's (name or spec provider).
    ``linear``: the ``eh_proj`` linear, None: the layer spec's (``PatternLayerSubmodules.linear``, what
    ``get_hybrid_layer_spec(..., linear=)`` built its layers with); another than the spec's is refused."""
    from hp_megatron.decoder.mtp import GlobalShiftMTPLayer

    if not getattr(config, "mtp_num_layers", None):
        return None
    transformer_layer = mtp_transformer_layer_spec(config, layer_spec)
    count = get_mtp_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    if count == 0:
        return None
    spec_linear = layer_spec.submodules.linear
    if linear is not None and linear != spec_linear:
        raise ValueError(f"get_mtp_block_spec: linear={linear!r} but the layer spec's layers use {spec_linear!r} "
                         "linears (get_hybrid_layer_spec(..., linear=)); the MTP block follows the spec")
    provider = get_spec_provider(backend, linear=spec_linear)
    norm = provider.layer_norm(rms_norm=True)
    layer = ModuleSpec(module=GlobalShiftMTPLayer, submodules=mtp_layer_submodules(
        enorm=norm, hnorm=norm, eh_proj=provider.column_parallel_linear(), layer=transformer_layer, layer_norm=norm))
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * count)
