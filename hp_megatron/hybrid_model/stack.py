"""megatron-core's ``HybridStack`` (the decoder of ``HybridModel``, megatron-core 0.19+) with our final norm, and the
layer class of our mixer slots.

``HybridModel`` (Megatron-LM's ``pretrain_hybrid.py``) builds its decoder from a stack spec
``ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(mamba_layer=..., gdn_layer=..., ...))`` and the
pattern ``--hybrid-layer-pattern`` (``M`` Mamba, ``G`` GDN, ``*`` attention, ``D`` DSA, ``+`` MLA, ``-`` MLP,
``E`` MoE). Two things of megatron-core's class do not fit our specs, and :class:`HybridStack` changes only them:

* its final norm is always Transformer Engine's ``TENorm`` (an ImportError without TE); ours is
  ``layers.shared.norm.RMSNorm``, the norm of every layer of our specs (zero-centred when
  ``config.layernorm_zero_centered_gamma``), on every install. Checkpoint key and shape are the same
  (``decoder.final_norm.weight``); the cost with TE: one norm per model is not TE's fused kernel;
* a pattern symbol whose slot the spec leaves empty (``IdentityOp``, the dataclass default) would build a layer
  that returns its input; it is refused up front, naming the symbol and the slot;
* options with which megatron-core would swap our layers for its own are refused (:data:`SWAPPING_OPTIONS`:
  ``mla_down_proj_fusion`` replaces the MLA slot's layer with ``FusedMLASelfAttention`` and a TE norm-linear).

:class:`HybridStackLayer` is the ``TransformerLayer`` of our mixer slots (``G``, ``*``, ``+``), with two things
that ``hp_megatron.gpt.layer.PatternLayer`` does for the GPT specs: q/k norms that follow ``config.qk_layernorm``
(``QKNormFromConfig``, ``--qk-layernorm``), and, with ``own_positions=True`` (the MLA slot), the model's rotary
tables are not handed to the mixer: ``HybridModel`` passes them to every layer when
``--position-embedding-type rope``, and our MLA applies its own rotary embedding (``rope_type``) and refuses them,
so MLA (``+``) and RoPE attention (``*``) layers can share a model. A slot that several of our mixers share (``G``:
GDN and KDA, while megatron-core has no ``K``) takes the mixer of each layer from ``mixer_by_layer`` (``{global layer
number: our symbol}``, ``hp_megatron.hybrid_model.numbering.delta_slot_mixers``) among ``mixer_specs``: one model
holds GDN and KDA layers without a symbol of its own in megatron-core.
"""
from __future__ import annotations

from dataclasses import replace

from megatron.core.models.hybrid.hybrid_block import HybridStack as MegatronHybridStack
from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import TransformerLayer

from hp_megatron.decoder.qk_norm import resolve_qk_norm
from hp_megatron.decoder.rotary import without_rotary

# pattern symbol -> HybridStackSubmodules slot
SLOTS = {Symbols.MAMBA: "mamba_layer", Symbols.GDN: "gdn_layer", Symbols.ATTENTION: "attention_layer",
         Symbols.DS_ATTENTION: "dsa_layer", Symbols.MLA: "mla_layer", Symbols.MLP: "mlp_layer",
         Symbols.MOE: "moe_layer"}
if getattr(Symbols, "KDA", None):  # megatron-core's own KDA symbol (its dev branch, PR #6556), where installed
    SLOTS[Symbols.KDA] = "kda_layer"


# config fields with which megatron-core's HybridStack replaces our layers: field -> (flag, what it does)
SWAPPING_OPTIONS = {"mla_down_proj_fusion": ("--mla-down-proj-fusion", "replaces the MLA slot's layer with "
                                             "megatron-core's FusedMLASelfAttention and a Transformer Engine norm")}


def check_options(config) -> None:
    """ValueError naming a set option of :data:`SWAPPING_OPTIONS` (megatron-core would swap our layers out)."""
    for field, (flag, effect) in SWAPPING_OPTIONS.items():
        if getattr(config, field, False):
            raise ValueError(f"{flag} ({field}=True) {effect}: our layers would not be built; unset it")


def check_slots(submodules, layer_types) -> None:
    """ValueError naming the first symbol of ``layer_types`` whose slot of ``submodules`` is empty."""
    for symbol in dict.fromkeys(layer_types):
        slot = SLOTS.get(symbol)
        if slot is not None and getattr(submodules, slot) is IdentityOp:
            filled = "".join(s for s, name in SLOTS.items() if getattr(submodules, name) is not IdentityOp)
            raise ValueError(f"hybrid layer pattern symbol {symbol!r} needs the stack spec's {slot}, which this "
                             f"spec leaves empty (its layers: {filled!r}); set spec.submodules.{slot} to a layer "
                             "spec or drop the symbol from --hybrid-layer-pattern")


class HybridStack(MegatronHybridStack):
    """megatron-core's ``HybridStack`` with ``layers.shared.norm.RMSNorm`` as the final norm (module docstring); every
    argument is megatron-core's."""

    def __init__(self, config, submodules, *args, layer_type_list=None, post_layer_norm: bool = True, **kwargs):
        from layers.shared.norm import RMSNorm

        check_options(config)
        check_slots(submodules, layer_type_list or ())
        super().__init__(config, submodules, *args, layer_type_list=layer_type_list, post_layer_norm=False,
                         **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_norm = RMSNorm(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)


class HybridStackLayer(TransformerLayer):
    """``TransformerLayer`` with q/k norms per ``config.qk_layernorm`` and, with ``own_positions``, no rotary tables
    for its mixer (module docstring); every other argument is megatron-core's."""

    def __init__(self, config, submodules, layer_number: int = 1, *args, own_positions: bool = False,
                 mixer_by_layer=None, mixer_specs=None, **kwargs):
        self.mixer_symbol = None
        if mixer_by_layer:
            if layer_number not in mixer_by_layer:
                raise ValueError(f"HybridModel layer {layer_number} of a shared slot has no mixer in mixer_by_layer "
                                 f"(layers {sorted(mixer_by_layer)})")
            self.mixer_symbol = mixer_by_layer[layer_number]
            submodules = replace(submodules, self_attention=mixer_specs[self.mixer_symbol])
        super().__init__(config, resolve_qk_norm(config, submodules), layer_number, *args, **kwargs)
        self.own_positions = own_positions

    def forward(self, *args, **kwargs):
        if self.own_positions:
            kwargs = without_rotary(kwargs)
        return super().forward(*args, **kwargs)
