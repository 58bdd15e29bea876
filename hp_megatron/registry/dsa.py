"""Registration of ``D``: DeepSeek Sparse Attention (``layers.mixers.mla.dsa.DSAttention``; DeepSeek-V3.2's and
GLM-5's attention layers): our MLA's spec with the sparse layer as its module; it applies its own rotary embedding.
``D`` is megatron-core's HybridModel symbol for DSA (slot ``dsa_layer``)."""
from __future__ import annotations

from dataclasses import replace

from hp_megatron.registry.entries import MixerEntry, register_mixer
from hp_megatron.registry.megatron_fields import megatron_config_fields
from hp_megatron.registry.mla import mla_spec
from hp_megatron.registry.support import MixerSupport
from layers.mixers.mla.dsa_options import DSA_ROWS
from layers.mixers.mla.options import MLA_ROWS

MODULE = "layers.mixers.mla.dsa:DSAttention"
# megatron-core 0.19 has the dsa_indexer_* config fields (its own DSA), 0.16 has none: there they are ours
INDEXER_ROWS = tuple(replace(row, megatron_field=row.field in megatron_config_fields()) for row in DSA_ROWS)


def dsa_spec(provider, *, qk_layernorm=False, cp_layout=None):
    return mla_spec(provider, qk_layernorm=qk_layernorm, cp_layout=cp_layout, module=MODULE)


DSA = register_mixer(MixerEntry(
    symbol="D", name="dsa", title="DSA", spec=dsa_spec, module=MODULE, options=MLA_ROWS + INDEXER_ROWS, family="mla",
    own_positions=True, stack_slot="dsa_layer",
    # CP only through the latent all-gather (each rank gathers the latent and the indexer keys); THD per document;
    # decode with the indexer key cache beside the latent cache; MTP (causal mask type); eager kernels only
    supports=MixerSupport(cp_methods=("latent",), thd=True, decode=True, mtp=True, backends=("eager",))))
