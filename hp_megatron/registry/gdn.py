"""Registration of ``G``: Gated DeltaNet (``layers.mixers.delta.gdn.GatedDeltaNet``; Qwen3-Next's linear layers)."""
from __future__ import annotations

from hp_megatron.registry.delta import delta_mixer_spec
from hp_megatron.registry.delta import DELTA_SUPPORT
from hp_megatron.registry.entries import MixerEntry, register_mixer
from layers.mixers.delta.options import DELTA_ROWS, GDN_ROWS

MODULE = "layers.mixers.delta.gdn:GatedDeltaNet"


def gdn_spec(provider, *, qk_layernorm=False, cp_layout=None):
    return delta_mixer_spec(MODULE, provider, cp_layout)


GDN = register_mixer(MixerEntry(
    symbol="G", name="gdn", title="GDN", spec=gdn_spec, module=MODULE, options=DELTA_ROWS + GDN_ROWS, family="delta",
    stack_slot="gdn_layer", cp_auto_field="delta_cp_method", supports=DELTA_SUPPORT))
