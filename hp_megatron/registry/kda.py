"""Registration of ``K``: Kimi Delta Attention (``layers.mixers.delta.kda.KimiDeltaAttention``; Kimi Linear's linear
layers). HybridModel has no KDA symbol: ``kda_hybrid_stack_spec`` puts it in the ``G`` slot."""
from __future__ import annotations

from hp_megatron.registry.delta import DELTA_SUPPORT, delta_mixer_spec
from hp_megatron.registry.entries import MixerEntry, register_mixer
from layers.mixers.delta.options import DELTA_ROWS, KDA_ROWS

MODULE = "layers.mixers.delta.kda:KimiDeltaAttention"


def kda_spec(provider, *, qk_layernorm=False, cp_layout=None):
    return delta_mixer_spec(MODULE, provider, cp_layout)


KDA = register_mixer(MixerEntry(
    symbol="K", name="kda", title="KDA", spec=kda_spec, module=MODULE, options=DELTA_ROWS + KDA_ROWS,
    family="delta", stack_slot="gdn_layer", cp_auto_field="delta_cp_method", supports=DELTA_SUPPORT))
