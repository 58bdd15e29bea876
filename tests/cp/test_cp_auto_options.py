"""The options only ``auto`` reads are refused where they are set without ``auto`` (they used to be ignored):
the flags ``--hp-cp-auto-measure`` / ``--hp-cp-calibration``, the config fields ``delta_cp_auto_measure`` /
``hp_cp_calibration``, the mixer options ``cp_auto_measure`` / ``cp_calibration``; and ``auto`` with an explicit
group size or Ulysses degree is refused at construction, not at the first CP forward. In process, no ranks."""
from __future__ import annotations

import argparse

import pytest

from layers.cp.auto import MEASURE_TOP


def _parser():
    from hp_megatron.arguments import add_hp_arguments

    parser = argparse.ArgumentParser()
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=64)
    return add_hp_arguments(parser)


def test_auto_measure_flag_needs_auto():
    from hp_megatron.arguments import hp_config_from_args

    parser = _parser()
    with pytest.raises(ValueError, match="--hp-cp-auto-measure 2 needs --hp-cp-method auto"):
        hp_config_from_args(parser.parse_args(["--hp-cp-auto-measure", "2"]))
    with pytest.raises(ValueError, match="--hp-cp-auto-measure 0 needs --hp-cp-method auto"):
        hp_config_from_args(parser.parse_args(["--hp-cp-method", "p2p", "--hp-mla-cp-strategy", "auto",
                                               "--hp-cp-auto-measure", "0"]))
    fields = hp_config_from_args(parser.parse_args(["--hp-cp-method", "auto", "--hp-cp-auto-measure", "0"]))
    assert fields["delta_cp_auto_measure"] == 0
    assert hp_config_from_args(parser.parse_args(["--hp-cp-method", "auto"]))["delta_cp_auto_measure"] == MEASURE_TOP
    assert hp_config_from_args(parser.parse_args([]))["delta_cp_auto_measure"] == MEASURE_TOP


def test_calibration_flag_needs_an_auto():
    from hp_megatron.arguments import hp_config_from_args

    parser = _parser()
    with pytest.raises(ValueError, match="needs --hp-cp-method auto or --hp-mla-cp-strategy auto"):
        hp_config_from_args(parser.parse_args(["--hp-cp-method", "p2p", "--hp-cp-calibration", "cal.json"]))
    fields = hp_config_from_args(parser.parse_args(["--hp-mla-cp-strategy", "auto", "--hp-cp-calibration", "cal.json"]))
    assert fields["hp_cp_calibration"] == "cal.json"


def test_auto_flags_with_group_size_name_the_flags():
    from hp_megatron.arguments import validate_hp_args

    args = _parser().parse_args(["--hp-cp-method", "auto", "--hp-cp-ulysses-degree", "2"])
    args.context_parallel_size, args.tensor_model_parallel_size, args.seq_length = 4, 1, 64
    with pytest.raises(ValueError, match="--hp-cp-method auto chooses the group size and Ulysses degree itself; "
                                         "drop --hp-cp-group-size None / --hp-cp-ulysses-degree 2"):
        validate_hp_args(args)


def _config(**fields):
    from hp_megatron.config import HybridTransformerConfig

    return HybridTransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, **fields)


def test_config_auto_fields_need_auto():
    with pytest.raises(ValueError, match="hp_cp_calibration 'cal.json' needs delta_cp_method or mla_cp_strategy"):
        _config(hp_cp_calibration="cal.json", delta_cp_method="allgather")
    with pytest.raises(ValueError, match="delta_cp_auto_measure=1 needs delta_cp_method 'auto'"):
        _config(delta_cp_auto_measure=1)
    assert _config(hp_cp_calibration="cal.json", mla_cp_strategy="auto").hp_cp_calibration == "cal.json"
    assert _config(delta_cp_method="auto", delta_cp_auto_measure=0).delta_cp_auto_measure == 0


def _gdn(config=None, **options):
    from megatron.core.transformer import TransformerConfig

    from layers import GatedDeltaNet

    config = config or TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                                         use_cpu_initialization=True)
    return GatedDeltaNet(config, None, layer_number=1, num_key_heads=4, key_head_dim=8, **options)


def test_mixer_auto_options_need_auto():
    with pytest.raises(ValueError, match=r"cp_calibration only apply to cp_method='auto', got cp_method='p2p'"):
        _gdn(cp_method="p2p", cp_calibration="cal.json")
    with pytest.raises(ValueError, match=r"cp_auto_measure only apply to cp_method='auto', got cp_method='allgather'"):
        _gdn(cp_auto_measure=1)
    with pytest.raises(ValueError, match="chooses group_size and ulysses_degree itself"):
        _gdn(cp_method="auto", cp_ulysses_degree=2)
    assert _gdn(cp_method="auto", cp_calibration="cal.json", cp_auto_measure=0).options["cp_auto_measure"] == 0
    # a config naming a calibration for the MLA layers' auto leaves a GDN layer with another method alone
    assert _gdn(_config(hp_cp_calibration="cal.json", mla_cp_strategy="auto", use_cpu_initialization=True),
                cp_method="p2p").cp_method == "p2p"


def test_auto_is_no_context_method():
    """``build_cp_context`` runs concrete methods only (its checks: ``hybrid_degrees``); a layer resolves ``auto``
    first. The old ``build_cp_context(method="auto", auto_layer=...)`` path is gone."""
    import inspect

    from layers.cp import build_cp_context
    from layers.cp.subgroups import hybrid_degrees

    with pytest.raises(ValueError, match="method must be one of"):
        hybrid_degrees(4, "auto", None, None)
    assert not {"auto_layer", "calibration"} & set(inspect.signature(build_cp_context).parameters)
