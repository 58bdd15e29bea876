"""Registration of ``A``: causal softmax attention (megatron-core's ``SelfAttention`` with our context-parallel core
attention, ``layers.mixers.attention``), q/k RMSNorms optional; it reads the model's RoPE. megatron-core is imported
when a spec is built (the registry is read by the flag parsers, before megatron-core's start-up warnings are
filtered)."""
from __future__ import annotations

from hp_megatron.registry.entries import MixerEntry, register_mixer
from hp_megatron.registry.support import MixerSupport
from layers.base.choices import BACKENDS


def qk_norm_spec(provider, qk_layernorm):
    """The attention's q/k norm spec: ``qk_layernorm`` True, False, or "config" (``QKNormFromConfig``)."""
    from megatron.core.transformer.identity_op import IdentityOp

    from hp_megatron.decoder.qk_norm import QKNormFromConfig

    if qk_layernorm == "config":
        return QKNormFromConfig(provider.layer_norm(rms_norm=True, for_qk=True))
    if not isinstance(qk_layernorm, bool):
        raise ValueError(f"qk_layernorm must be True, False or 'config' (follow config.qk_layernorm when the layer "
                         f"is built), got {qk_layernorm!r}")
    return provider.layer_norm(rms_norm=True, for_qk=True) if qk_layernorm else IdentityOp


def attention_spec(provider, *, qk_layernorm=False, cp_layout=None):
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec

    norm = qk_norm_spec(provider, qk_layernorm)
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


ATTENTION = register_mixer(MixerEntry(
    symbol="A", name="attn", title="attention", spec=attention_spec,
    module="megatron.core.transformer.attention:SelfAttention", family="attention", model_rope=True,
    stack_slot="attention_layer",
    # one CP method: K/V all-gathered over the CP group (layers/mixers/attention/context_parallel.py); THD (causal per
    # document); megatron's static KV cache; MTP; eager SDPA under every --hp-backend (Ascend's fused one on ascendc)
    supports=MixerSupport(cp_methods=("allgather",), thd=True, decode=True, mtp=True, backends=BACKENDS)))
