"""Strict construction: a mistyped keyword to any layer raises TypeError naming it and the accepted ones, while
megatron-core's own pass-through keywords are accepted; every named choice has one definition."""
from __future__ import annotations

import pytest
import torch


def _config(**extra):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                             params_dtype=torch.float32, attention_dropout=0.0, kv_channels=8, **extra)


def _delta(cls_name, **kw):
    import layers

    return getattr(layers, cls_name)(_config(), None, layer_number=1, num_key_heads=2, key_head_dim=8, **kw)


@pytest.mark.parametrize("cls_name", ["GatedDeltaNet", "KimiDeltaAttention"])
def test_delta_mixers_reject_mistyped_options(cls_name):
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['backnd', 'cp_metod'\]; accepted: .*'backend'.*"
                                        r"'cp_method'"):
        _delta(cls_name, cp_metod="p2p", backnd="triton")
    layer = _delta(cls_name, name="mixer", pp_layer_offset=0, d_model=16)   # megatron's pass-through keywords
    assert layer.backend == "eager"


def test_delta_mixer_must_name_a_registered_kind():
    """A delta mixer subclass runs the delta-rule kind it names (layers/ops/kinds.py); an unnamed or unknown one is
    refused at construction instead of running another kind's math."""
    import layers

    class Unnamed(layers.GatedDeltaNet):
        kind = None

    class Mamba2(layers.GatedDeltaNet):
        kind = "mamba2"

    for cls, shown in ((Unnamed, "None"), (Mamba2, "'mamba2'")):
        with pytest.raises(ValueError, match=rf"^unknown delta-rule kind {shown}; known kinds: gdn, kda$"):
            cls(_config(), None, layer_number=1, num_key_heads=2, key_head_dim=8)


def test_mla_and_attention_cores_reject_mistyped_options():
    from tests.support.mla_layer import make_config, mla_submodules

    from layers.mixers.attention.context_parallel import ContextParallelDotProductAttention
    from layers.mixers.attention import CoreAttention
    from layers.mixers.mla.layer import MultiLatentAttention

    with pytest.raises(TypeError, match=r"MultiLatentAttention got unknown keyword\(s\) \['cp_strategie'\]; "
                                        r"accepted: .*'cp_strategy'"):
        MultiLatentAttention(make_config(), mla_submodules(), layer_number=1, cp_strategie="latent")
    with pytest.raises(TypeError, match=r"\['layot'\]; accepted: .*'layout'"):
        ContextParallelDotProductAttention(_config(), 1, layot="contiguous")
    with pytest.raises(TypeError, match=r"CoreAttention got unknown keyword\(s\) \['backnd'\]"):
        CoreAttention(backnd="npu")
    CoreAttention(softmax_scale=0.5, k_channels=8, v_channels=8, name="core")          # megatron passes these


def test_one_definition_of_each_choice():
    import hp_megatron.flags as flags
    import layers.mixers.delta.options as options
    from layers.base import choices
    from layers.cp import METHODS
    from layers.cp.chain import STATE_METHODS
    from layers.cp.mla import STRATEGIES
    from layers.cp.plan import LAYOUTS
    from layers.ops.backends import BACKENDS

    assert METHODS is choices.CP_METHODS and STATE_METHODS is choices.STATE_METHODS
    assert LAYOUTS is choices.CP_LAYOUTS and STRATEGIES is choices.MLA_CP_STRATEGIES
    assert BACKENDS is choices.BACKENDS
    # the flags' choices are the flag table's rows (hp_megatron.flags), which name these tuples
    rows = {row.flag: row for row in flags.flag_table()}
    assert rows["--hp-cp-method"].choices is choices.CP_METHOD_CHOICES
    assert rows["--hp-cp-layout"].choices is choices.CP_LAYOUTS
    assert rows["--hp-backend"].choices is choices.BACKENDS
    assert rows["--hp-mla-cp-strategy"].choices is choices.MLA_CP_STRATEGY_CHOICES
    assert options.CP_METHOD_CHOICES is choices.CP_METHOD_CHOICES
