"""Registration of ``M``: multi-latent attention (``layers.mixers.mla.layer.MultiLatentAttention``; DeepSeek-V3's
and Kimi Linear's attention layers). It applies its own rotary embedding (``rope_type``) or none."""
from __future__ import annotations

from hp_megatron.registry.entries import MixerEntry, register_mixer, resolve
from hp_megatron.registry.support import MixerSupport
from layers.base.choices import BACKENDS, MLA_CP_STRATEGY_CHOICES
from layers.mixers.mla.options import MLA_ROWS

MODULE = "layers.mixers.mla.layer:MultiLatentAttention"


def mla_spec(provider, *, qk_layernorm=False, cp_layout=None, module=MODULE):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec

    from layers.mixers.mla.layer import MLASelfAttentionSubmodules

    norm = provider.layer_norm(rms_norm=True, for_qk=True)
    column, row = provider.column_parallel_linear(), provider.row_parallel_linear()
    return ModuleSpec(
        module=resolve(module),
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


MLA = register_mixer(MixerEntry(
    symbol="M", name="mla", title="MLA", spec=mla_spec, module=MODULE, options=MLA_ROWS, family="mla",
    own_positions=True, stack_slot="mla_layer", cp_auto_field="mla_cp_strategy",
    # every --hp-mla-cp-strategy, THD (per-document positions), the latent KV cache (layers/mixers/mla/decode.py),
    # MTP (causal mask type); the same eager latent attention under every --hp-backend (NPU's fused one on ascendc)
    supports=MixerSupport(cp_methods=MLA_CP_STRATEGY_CHOICES, thd=True, decode=True, mtp=True, backends=BACKENDS)))
