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

Per-GPT-layer settings: a HybridModel layer is half of a GPT layer (``config.hp_gpt_layer_numbers``, set by
``hp_megatron.model_builders.hybrid_model_config``), and the settings of that GPT layer apply to it as in a
``GPTModel``: :class:`HybridStackLayer` makes its mixer post-norm where ``config.hp_post_norm_symbols`` names it,
:class:`HybridMLPLayer` / :class:`HybridMoELayer` (the ``-`` / ``E`` slots) take the GPT layer's SwiGLU limits
(``hp_megatron.decoder.swiglu_limits``) and, after a post-norm mixer, a post-norm MLP; DSA's top-k sharing counts
GPT layers the same way (``layers.mixers.mla.dsa``). Megatron-LM's module-level specs build no such numbering: their
layers are megatron-core's numbering as it is, and post-norm layers are refused there.
"""
from __future__ import annotations

from dataclasses import replace

from megatron.core.models.hybrid.hybrid_block import HybridStack as MegatronHybridStack
from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

from hp_megatron.decoder.pattern import symbol_for_layer
from hp_megatron.decoder.post_norm import is_post_norm, post_norm_mixer, post_norm_mlp
from hp_megatron.decoder.qk_norm import resolve_qk_norm
from hp_megatron.decoder.rotary import without_rotary
from hp_megatron.decoder.swiglu_limits import with_swiglu_limits

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
                 mixer_by_layer=None, mixer_specs=None, symbol=None, **kwargs):
        self.mixer_symbol = symbol
        if mixer_by_layer:
            if layer_number not in mixer_by_layer:
                raise ValueError(f"HybridModel layer {layer_number} of a shared slot has no mixer in mixer_by_layer "
                                 f"(layers {sorted(mixer_by_layer)})")
            self.mixer_symbol = mixer_by_layer[layer_number]
            submodules = replace(submodules, self_attention=mixer_specs[self.mixer_symbol])
        submodules = resolve_qk_norm(config, submodules)
        if self.mixer_symbol is not None and is_post_norm(config, self.mixer_symbol):
            submodules = post_norm_mixer(submodules)
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.own_positions = own_positions

    def forward(self, *args, **kwargs):
        if self.own_positions:
            kwargs = without_rotary(kwargs)
        return super().forward(*args, **kwargs)


def _mlp_submodules(config, submodules, layer_number: int):
    """The MLP half of GPT layer ``config.hp_gpt_layer_numbers[layer_number]``: its SwiGLU limits and, when that
    layer's mixer (``config.hp_layer_pattern``) is post-norm, a post-norm MLP. Layers the config does not number
    (MTP parts; Megatron-LM's module-level specs, which build no renumbered config) are megatron-core's as they are,
    unless the config asks for post-norm layers, which they could not honour (a ValueError)."""
    number = (getattr(config, "hp_gpt_layer_numbers", None) or {}).get(layer_number)
    if number is None:
        if getattr(config, "hp_post_norm_symbols", None):
            raise ValueError(f"HybridModel layer {layer_number} is not a GPT layer's half (config.hp_gpt_layer_numbers"
                             f", hp_megatron.model_builders.hybrid_model_config): post-norm layers "
                             f"(hp_post_norm_symbols={config.hp_post_norm_symbols!r}) need it; MTP with post-norm "
                             "layers is not supported")
        return submodules
    submodules = with_swiglu_limits(config, submodules, number, config.hp_gpt_num_layers)
    pattern = getattr(config, "hp_layer_pattern", None)
    if getattr(config, "hp_post_norm_symbols", None):
        if not pattern:
            raise ValueError(f"post-norm layers (hp_post_norm_symbols={config.hp_post_norm_symbols!r}) in a "
                             "HybridModel need config.hp_layer_pattern (--hp-layer-pattern) to tell which MLP layers "
                             "follow them")
        if is_post_norm(config, symbol_for_layer(pattern, number)):
            submodules = post_norm_mlp(config, submodules)
    return submodules


class HybridMLPLayer(MLPLayer):
    """megatron-core's ``MLPLayer`` (``-``) with its GPT layer's SwiGLU limits and post-norm
    (:func:`_mlp_submodules`)."""

    def __init__(self, config, submodules, layer_number: int = 1, *args, **kwargs):
        super().__init__(config, _mlp_submodules(config, submodules, layer_number), layer_number, *args, **kwargs)


class HybridMoELayer(MoETransformerLayer):
    """megatron-core's ``MoETransformerLayer`` (``E``) with its GPT layer's SwiGLU limits (:func:`_mlp_submodules`)."""

    def __init__(self, config, submodules, layer_number: int = 1, *args, **kwargs):
        super().__init__(config, _mlp_submodules(config, submodules, layer_number), layer_number, *args, **kwargs)
