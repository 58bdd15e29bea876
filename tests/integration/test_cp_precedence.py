"""One CP precedence for every mixer (hp_megatron.cp_choice, docs/cp.md "Which CP method"): an explicit ``--hp-*``
flag (or keyword) > a ``--cp-comm-type`` the user gave > the mixer's default (``allgather`` / ``latent``).

Through Megatron-LM's own ``parse_args`` with our flags (parse only: the config Megatron-LM builds from the args,
then ``apply_hp_config``), through the example's command line, at the layer (MLA's config field beats the
``cp_comm_type`` megatron's ``TransformerLayer`` hands it) and as built at CP2 in a ``TransformerBlock`` of the
example's config (one job of the shared 2-rank spawn), with the one log line per layer shape."""
from __future__ import annotations

import os
import sys

import pytest

from tests.support.dist import share_spawn
from tests.support.paths import EXAMPLE, MEGATRON_LM

# (extra flags, GDN/KDA method, MLA strategy): Megatron-LM's default --cp-comm-type ['p2p'] is not a choice
CASES = [
    ([], "allgather", "latent"),
    (["--cp-comm-type", "a2a"], "ulysses", "expanded_ulysses"),
    (["--cp-comm-type", "a2a", "--hp-mla-cp-strategy", "latent"], "ulysses", "latent"),
    (["--cp-comm-type", "p2p"], "p2p", "latent"),                     # given p2p is a choice, unlike the default
    (["--cp-comm-type=all_gather", "--hp-cp-method", "p2p"], "p2p", "latent"),
]
TINY = ["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--hp-layer-pattern", "GKM"]


def _megatron_lm_config(monkeypatch, extra):
    from tests.megatron_lm.typing_override import install

    install()   # Megatron-LM 0.19 imports typing.override (Python >= 3.12)
    monkeypatch.syspath_prepend(MEGATRON_LM)
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

    from hp_megatron.arguments import add_hp_arguments, apply_hp_config

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *TINY[:6], "--max-position-embeddings", "32",
                                      "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-3",
                                      "--train-iters", "3", "--transformer-impl", "local", "--use-cpu-initialization",
                                      *TINY[6:], *extra])
    args = parse_args(extra_args_provider=add_hp_arguments)
    args.world_size, args.rank = 1, 0
    validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    return args, apply_hp_config(core_transformer_config_from_args(args), args)


@pytest.mark.skipif(MEGATRON_LM is None, reason="Megatron-LM's training code not found (tests/support/paths.py)")
def test_megatron_lm_parse_args_follows_one_precedence(monkeypatch, capsys):
    built = [_megatron_lm_config(monkeypatch, extra) for extra, _, _ in CASES]
    assert [(c.delta_cp_method, c.mla_cp_strategy) for _, c in built] == [(d, m) for _, d, m in CASES]
    for (extra, _, _), (args, _) in zip(CASES, built):
        assert len(args.cp_comm_type) == 1   # Megatron-LM's list, ['p2p'] by default
        assert args.hp_cp_comm_type_given == any(a.startswith("--cp-comm-type") for a in extra)
    capsys.readouterr()   # validate_args prints every argument


def _example_args(monkeypatch, argv, world=1):
    monkeypatch.syspath_prepend(EXAMPLE)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    from cli import parse_args

    return parse_args(argv)


def test_example_follows_one_precedence_and_checks_the_resolved_method(monkeypatch):
    from hp_megatron.arguments import hp_config_from_args

    for extra, delta, mla in CASES:
        fields = hp_config_from_args(_example_args(monkeypatch, TINY + extra))
        assert (fields["delta_cp_method"], fields["mla_cp_strategy"]) == (delta, mla), extra
    heads = TINY + ["--context-parallel-size", "2", "--hp-linear-num-key-heads", "3", "--hp-linear-key-head-dim", "8"]
    assert _example_args(monkeypatch, heads, world=2).context_parallel_size == 2   # allgather: any head count
    with pytest.raises(ValueError, match=r"GDN/KDA heads 3 .* Ulysses degree 2"):
        _example_args(monkeypatch, heads + ["--cp-comm-type", "a2a"], world=2)   # a2a -> ulysses: heads % CP
    with pytest.raises(ValueError, match=r"GDN/KDA CP method ulysses \(from --cp-comm-type a2a\) uses all"):
        _example_args(monkeypatch, TINY + ["--context-parallel-size", "2", "--cp-comm-type", "a2a",
                                           "--hp-cp-ulysses-degree", "1"], world=2)


def test_mla_config_field_beats_cp_comm_type(single_rank):
    from tests.support.mla_layer import build_layer, make_config

    config = make_config()
    assert build_layer(config, single_rank, single_rank, cp_comm_type="a2a").cp_strategy == "expanded_ulysses"
    config.mla_cp_strategy = "latent"   # --hp-mla-cp-strategy latent: beats megatron's cp_comm_type
    layer = build_layer(config, single_rank, single_rank, cp_comm_type="a2a")
    assert layer.cp_strategy == "latent" and layer.cp_strategy_source == "config.mla_cp_strategy"
    keyword = build_layer(config, single_rank, single_rank, cp_comm_type="a2a", cp_strategy="expanded_ulysses")
    assert (keyword.cp_strategy, keyword.cp_strategy_source) == ("expanded_ulysses", "ModuleSpec.params cp_strategy")


# CP2 job: (extra flags, megatron's cp_comm_type on the config as Megatron-LM sets it, expected per layer)
CP2_CASES = [
    ([], "p2p", ("allgather", "allgather", "latent")),
    (["--cp-comm-type", "a2a"], None, ("ulysses", "ulysses", "expanded_ulysses")),
    (["--cp-comm-type", "a2a", "--hp-mla-cp-strategy", "latent"], None, ("ulysses", "ulysses", "latent")),
]


def _built_at_cp2(rank, world_size):
    """The CP method of each layer of a GKM ``TransformerBlock`` built at CP2 from the example's config."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import TransformerBlock

    from hp_megatron.platform import apply_cpu_training_shims
    from hp_megatron.specs import get_hybrid_layer_spec
    from layers.cp import choice_log

    choice_log.CP_CHOICE_LOG.clear()   # the spawn is shared: count only this job's layers, each line once
    choice_log._LOGGED.clear()
    sys.path.insert(0, EXAMPLE)
    os.environ["WORLD_SIZE"] = str(world_size)
    from cli import parse_args
    from pretrain_hybrid import build_config

    apply_cpu_training_shims(0)
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    out = {}
    try:
        for extra, megatron_default, _ in CP2_CASES:
            args = parse_args(TINY + ["--context-parallel-size", "2", *extra])
            config = build_config(args, 64)
            if megatron_default is not None:
                config.cp_comm_type = megatron_default   # what Megatron-LM's config holds without the flag
            block = TransformerBlock(config, get_hybrid_layer_spec("GKM", "eager"), post_process=False)
            out[" ".join(extra)] = [getattr(layer.self_attention, "cp_method", None)
                                    or layer.self_attention.cp_strategy for layer in block.layers]
        out["log"] = list(choice_log.CP_CHOICE_LOG)
    finally:
        parallel_state.destroy_model_parallel()
    return out


built_at_cp2 = share_spawn(_built_at_cp2, (2,))


@pytest.mark.parametrize("extra,expected", [(c[0], c[2]) for c in CP2_CASES], ids=["none", "a2a", "a2a-mla-latent"])
def test_methods_as_built_at_cp2(extra, expected):
    for result in built_at_cp2(2):
        assert tuple(result[" ".join(extra)]) == expected


def test_the_chosen_method_is_logged_once_per_layer_shape():
    log = built_at_cp2(2)[0]["log"]
    assert "[hp_megatron cp] GDN H=4 HV=4 K=8 V=8 P=2: allgather (config.delta_cp_method)" in log
    assert "[hp_megatron cp] KDA H=4 HV=4 K=8 V=8 P=2: ulysses (config.delta_cp_method)" in log
    assert any(line.startswith("[hp_megatron cp] MLA heads=4 ") and line.endswith("expanded_ulysses "
                                                                                   "(config.mla_cp_strategy)")
               for line in log), log
    assert len(log) == len(set(log)) == 6, log   # 3 layer shapes x 2 methods each, none twice


def test_a_registered_mixers_cp_row_follows_the_same_precedence(monkeypatch):
    """A third-party mixer whose CP row declares a ``CommTypeRule`` gets the same rule, on a parser with Megatron-LM's
    ``--cp-comm-type`` default ``['p2p']`` (which does not decide)."""
    import argparse

    import hp_megatron.registry.entries as entries
    from hp_megatron.arguments import add_hp_arguments, hp_config_from_args
    from hp_megatron.registry import MixerEntry
    from hp_megatron.registry.gdn import GDN
    from layers.base.options import CommTypeRule, OptionRow

    rule = CommTypeRule((("p2p", "ring"), ("all_gather", "gather"), ("a2a", "heads"), ("a2a+p2p", "ring")), "gather")
    row = OptionRow("--hp-demo-cp", "demo_cp", "cp", str, comm_type=rule, choices=("ring", "gather", "heads"))
    monkeypatch.setitem(entries._REGISTRY, "Q", MixerEntry(symbol="Q", name="demo", title="demo", spec=GDN.spec,
                                                           module=GDN.module, options=(row,), cp_auto_field="demo_cp"))

    def fields(argv):
        parser = argparse.ArgumentParser(allow_abbrev=False)
        parser.add_argument("--cp-comm-type", nargs="+", default=["p2p"])   # Megatron-LM's flag and default
        parser.set_defaults(num_attention_heads=4, hidden_size=32)
        return hp_config_from_args(add_hp_arguments(parser, argv).parse_args(argv))

    assert (fields([])["demo_cp"], fields([])["delta_cp_method"]) == ("gather", "allgather")
    assert (fields(["--cp-comm-type", "p2p"])["demo_cp"], fields(["--cp-comm-type", "p2p"])["delta_cp_method"]) == (
        "ring", "p2p")
    assert fields(["--cp-comm-type", "a2a", "--hp-demo-cp", "ring"])["demo_cp"] == "ring"
    per_layer = fields(["--cp-comm-type", "a2a", "p2p"])   # one value per layer: each layer maps its own
    assert (per_layer["demo_cp"], per_layer["delta_cp_method"], per_layer["mla_cp_strategy"]) == (None, None, None)
