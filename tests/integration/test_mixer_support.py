"""What a mixer declares (``MixerEntry.supports`` / ``check_args``) and what registration refuses, as the entry points
meet them.

* A third-party mixer declaring no CP and no decode (tests/support/limited_mixer.py): the example's argument phase
  (a launched process) refuses ``--context-parallel-size 2`` and ``python -m hp_megatron.generate``'s ``main``
  refuses a checkpoint of it (its stored ``--hp-mixer-module``; in process, in a scratch registry), each one line
  with exit status 2, before a model is built; a checkpoint whose stored module does not import is refused alike.
* ``check_mixer_support``: MTP with a mixer without MTP, a backend it lacks, its own ``check_args`` hook; the
  HybridModel slot refusal names the mixers that have a slot; a registered mixer gets a ``<name>_spec``.
* Registration refuses a megatron-core config field without ``OptionRow.megatron_field`` (and the declaration on a
  field megatron-core lacks), a row another mixer or the shared rows declare differently, a taken flag;
  megatron-core's field names read without importing it equal ``dataclasses.fields``.
* Option rows: argparse says what each check expects for every type; a bool row's ``default=True`` holds and has a
  ``--no-`` form.

Entries added here in process are added to a copy of the registry (``monkeypatch``) and gone after each test.
"""
import argparse
import os
import subprocess
import sys

import pytest

from tests.support.paths import EXAMPLE, REPO, pythonpath
from tests.support.stderr_lines import own_stderr_lines

LIMITED = "tests.support.limited_mixer"


@pytest.fixture
def scratch_registry(monkeypatch):
    """The registry's dict, restored after the test (entries registered inside vanish, and so do the mixer modules
    of tests/support imported inside: a later import registers them again)."""
    from hp_megatron.registry import entries

    monkeypatch.setattr(entries, "_REGISTRY", dict(entries._REGISTRY))
    before = set(sys.modules)
    yield entries._REGISTRY
    for name in set(sys.modules) - before:
        if name.startswith("tests.support."):
            del sys.modules[name]


def _entry(symbol="Z", name="zeta", **kwargs):
    from hp_megatron.registry import MixerEntry
    from hp_megatron.registry.attention import attention_spec

    return MixerEntry(symbol=symbol, name=name, title="zeta", spec=attention_spec,
                      module="megatron.core.transformer.attention:SelfAttention", **kwargs)


def _run(cmd, env_extra=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath(REPO), **(env_extra or {}))
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)


def test_example_refuses_cp_for_a_mixer_without_cp_at_argument_time():
    proc = _run([sys.executable, os.path.join(EXAMPLE, "pretrain_hybrid.py"), "--hp-mixer-module", LIMITED,
                 "--hp-layer-pattern", "P", "--context-parallel-size", "2", "--num-layers", "1", "--hidden-size",
                 "16", "--num-attention-heads", "2", "--seq-length", "8", "--micro-batch-size", "1",
                 "--global-batch-size", "1", "--train-iters", "1", "--no-progress"], {"WORLD_SIZE": "2"})
    lines = own_stderr_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: plain toy (P in --hp-layer-pattern P) has no context-parallel implementation "
                               "(MixerSupport.cp_methods is empty); got --context-parallel-size 2; mixers with CP: "
                               "G=GDN, K=KDA, M=MLA, A=attention"), lines
    assert proc.stdout == "", proc.stdout   # refused before the header, data or model


def _stored_checkpoint(directory, pattern, modules):
    """A checkpoint directory holding only the example's common state (its stored model flags, no tensors)."""
    from hp_megatron.arguments import add_hp_arguments
    from hp_megatron.checkpoint.common_state import with_common_state
    from hp_megatron.checkpoint.dcp_io import save_lazily
    from hp_megatron.training.model_args import MEGATRON_MODEL_ARG_NAMES, MODEL_ARGS_KEY, model_arg_names

    hp = vars(add_hp_arguments(argparse.ArgumentParser(), []).parse_args([]))
    megatron = dict(num_layers=1, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2, num_query_groups=None,
                    seq_length=16, rotary_base=10000, bf16=False, num_experts=None, moe_router_topk=2,
                    moe_ffn_hidden_size=None, moe_router_score_function="softmax",
                    moe_router_enable_expert_bias=False, mtp_num_layers=None)
    stored = {name: megatron[name] if name in MEGATRON_MODEL_ARG_NAMES else hp[name] for name in model_arg_names()}
    stored.update(hp_layer_pattern=pattern, hp_mixer_module=modules, padded_vocab_size=128, vocab_size=128,
                  tokenizer=None)
    os.makedirs(directory)
    save_lazily(directory, [], with_common_state(directory, {MODEL_ARGS_KEY: stored}, {}), produce=None)
    return directory


def test_generate_refuses_a_mixer_without_decode_in_one_line(tmp_path, capsys, scratch_registry):
    """``python -m hp_megatron.generate`` is ``sys.exit(main())``: main's status and stderr, in process (the stored
    module registers its mixers in the scratch registry)."""
    from hp_megatron.generate.__main__ import main

    ckpt = _stored_checkpoint(str(tmp_path / "iter_0000001"), "P", [LIMITED])
    capsys.readouterr()
    assert main(["--load", ckpt, "--prompt-ids", "1,2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "P" in scratch_registry, lines
    assert lines[0].startswith("error: plain toy (P in --hp-layer-pattern P) has no generation path with a state "
                               "cache (MixerSupport.decode is False), which generation needs; mixers with decode: "
                               "G=GDN, K=KDA, M=MLA, A=attention"), lines


def test_generate_refuses_a_stored_mixer_module_that_does_not_import(tmp_path, capsys):
    from hp_megatron.generate.__main__ import main

    ckpt = _stored_checkpoint(str(tmp_path / "iter_0000001"), "KM", ["no_such_mixer_module_here"])
    assert main(["--load", ckpt, "--prompt-ids", "1,2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: checkpoint {ckpt} was trained with a mixer module that "
                                               "cannot be imported here: --hp-mixer-module "
                                               "no_such_mixer_module_here: cannot import it"), err


def _args(**kwargs):
    return argparse.Namespace(**{"hp_layer_pattern": "Z", "context_parallel_size": 1, "mtp_num_layers": None,
                                 "hp_mtp_layer_symbol": None, "hp_backend": "eager", **kwargs})


def test_mixer_support_refusals_name_what_and_who(scratch_registry):
    from hp_megatron.arguments import check_mixer_support
    from hp_megatron.registry import MixerSupport, UnsupportedByMixer, register_mixer

    seen = []
    register_mixer(_entry(supports=MixerSupport(), check_args=lambda args: seen.append(args.hp_backend)))
    check_mixer_support(_args())
    assert seen == ["eager"]   # the hook ran once, for the mixer of the pattern
    check_mixer_support(_args(hp_layer_pattern="GM", context_parallel_size=2))   # the hook: not for other patterns
    assert seen == ["eager"]
    with pytest.raises(UnsupportedByMixer, match=r"^zeta \(Z, the multi-token-prediction layers' mixer of "
                                                 r"--hp-layer-pattern Z\) cannot be megatron-core's MTP layer "
                                                 r"\(MixerSupport.mtp is False\); mixers with MTP: M=MLA, A=attention"):
        check_mixer_support(_args(mtp_num_layers=1))
    with pytest.raises(UnsupportedByMixer, match=r"^zeta \(Z in --hp-layer-pattern GZ\) runs under --hp-backend "
                                                 r"eager only \(MixerSupport.backends\); got --hp-backend triton$"):
        check_mixer_support(_args(hp_layer_pattern="GZ", hp_backend="triton"))
    with pytest.raises(UnsupportedByMixer, match=r"generation needs"):
        check_mixer_support(_args(), decode=True)
    with pytest.raises(UnsupportedByMixer, match=r"^zeta \(Z in --hp-layer-pattern GZ\) does not take packed "
                                                 r"sequences \(THD; MixerSupport.thd is False\)"):
        check_mixer_support(_args(hp_layer_pattern="GZ", reset_attention_mask=True))
    check_mixer_support(_args(hp_layer_pattern="GM", reset_attention_mask=True))   # GDN and MLA declare THD
    with pytest.raises(ValueError, match=r"^MixerSupport.backends must be a non-empty subset"):
        MixerSupport(backends=("cuda",))


def test_mtp_and_hybrid_model_slot_refusals_come_from_the_registry(scratch_registry):
    from hp_megatron.registry import UnsupportedByMixer, register_mixer
    from hp_megatron.specs import get_hybrid_layer_spec
    from hp_megatron.specs.hybrid_stack_specs import get_hybrid_stack_spec
    from hp_megatron.specs.mtp_specs import mtp_transformer_layer_spec

    register_mixer(_entry())
    with pytest.raises(UnsupportedByMixer, match=r"^g_mixer \(the mixer of HybridModel's 'G' slot\): mixer 'zeta' "
                                                 r"declares no slot of megatron-core's HybridModel \(MixerEntry."
                                                 r"stack_slot is None\); mixers with a slot: gdn \(gdn_layer\), kda "
                                                 r"\(gdn_layer\), mla \(mla_layer\), attn \(attention_layer\), dsa "
                                                 r"\(dsa_layer\)$"):
        get_hybrid_stack_spec(g_mixer="zeta")
    with pytest.raises(ValueError, match=r"must be one of \('gdn', 'kda'\), got 'attn' \(it fills HybridModel's "
                                         r"attention_layer\)$"):
        get_hybrid_stack_spec(g_mixer="attn")
    config = argparse.Namespace(hp_layer_pattern="GZ", hp_mtp_layer_symbol="Z", mtp_num_layers=1)
    with pytest.raises(UnsupportedByMixer, match=r"^zeta \(Z, the multi-token-prediction layers' mixer of the "
                                                 r"pattern GZ\) cannot be megatron-core's MTP layer"):
        mtp_transformer_layer_spec(config, get_hybrid_layer_spec("GZ"))
    # declared MTP, but the spec lacks the mask type megatron-core's MTP layer asserts on: named before building
    from hp_megatron.registry import MixerEntry, MixerSupport
    from hp_megatron.registry.gdn import GDN

    register_mixer(MixerEntry(symbol="Y", name="gdn_mtp", title="GDN-MTP", spec=GDN.spec, module=GDN.module,
                              supports=MixerSupport(mtp=True)))
    config.hp_layer_pattern, config.hp_mtp_layer_symbol = "Y", "Y"
    with pytest.raises(ValueError, match=r"^MTP layer kind 'Y': its mixer declares MTP support \(MixerSupport.mtp\), "
                                         r"but its spec's params have no attn_mask_type"):
        mtp_transformer_layer_spec(config, get_hybrid_layer_spec("Y"))


def test_registered_mixer_gets_a_ready_spec(scratch_registry):
    import hp_megatron.specs as specs
    from hp_megatron.gpt.layer import PatternLayer
    from hp_megatron.registry import register_mixer

    register_mixer(_entry())
    try:
        spec = specs.zeta_spec
        assert spec.module is PatternLayer and set(spec.submodules.layer_types) == {"Z"}
        assert specs.zeta_triton_spec.submodules.layer_types["Z"].self_attention.module.__name__ == "SelfAttention"
    finally:
        for name in ("zeta_spec", "zeta_triton_spec"):
            vars(specs).pop(name, None)
    with pytest.raises(AttributeError):
        _ = specs.no_such_mixer_spec


def test_registration_refuses_megatron_fields_and_clashes(scratch_registry):
    from hp_megatron.flags import flag_groups
    from hp_megatron.registry import register_mixer
    from layers.base.options import OptionRow

    with pytest.raises(ValueError, match=r"^mixer 'zeta': config fields \['num_attention_heads'\] are megatron-core's "
                                         r"own \(TransformerConfig\); a row that sets one declares "
                                         r"OptionRow\(megatron_field=True\)"):
        register_mixer(_entry(options=(OptionRow("--hp-zeta-heads", "num_attention_heads", type=int),)))
    with pytest.raises(ValueError, match=r"^mixer 'zeta': rows \['zeta_heads'\] declare megatron_field=True, but "
                                         r"megatron-core's config has no such field$"):
        register_mixer(_entry(options=(OptionRow("--hp-zeta-heads", "zeta_heads", type=int, megatron_field=True),)))
    with pytest.raises(ValueError, match=r"^mixer 'zeta': \['--hp-mla-cp-strategy', 'mla_cp_strategy'\] already "
                                         r"belong to 'mla' \(declared differently\)$"):
        register_mixer(_entry(options=(OptionRow("--hp-mla-cp-strategy", "mla_cp_strategy", default="latent"),)))
    with pytest.raises(ValueError, match=r"^mixer 'zeta': \['--hp-cp-layout'\] already belong to 'hp_megatron "
                                         r"\(shared rows\)'"):
        register_mixer(_entry(options=(OptionRow("--hp-cp-layout", "zeta_layout"),)))
    with pytest.raises(ValueError, match=r"^mixer 'zeta': --hp-mixer-module is hp_megatron's own flag$"):
        register_mixer(_entry(options=(OptionRow("--hp-mixer-module", "zeta_module"),)))
    assert "Z" not in scratch_registry
    # a megatron field no other mixer sets, declared as such, is accepted (as the built-in linear_* and MLA rows)
    register_mixer(_entry(options=(OptionRow("--hp-zeta-kv-channels", "kv_channels", type=int,
                                             megatron_field=True),)))
    scratch_registry.pop("Z")
    register_mixer(_entry(options=(OptionRow("--hp-layer-pattern", "zeta_pattern"),)))
    with pytest.raises(ValueError, match=r"^mixer 'zeta': \['--hp-layer-pattern'\] belong to hp_megatron's own"):
        flag_groups()


def test_megatron_field_names_without_importing_megatron_core():
    import dataclasses

    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    from hp_megatron.registry import mixers
    from hp_megatron.registry.megatron_fields import megatron_config_fields

    want = {f.name for cls in (TransformerConfig, MLATransformerConfig) for f in dataclasses.fields(cls)}
    assert megatron_config_fields() == want
    declared = sorted(r.field for e in mixers().values() for r in e.options if r.megatron_field)
    assert set(declared) == {"linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                             "linear_value_head_dim", "linear_conv_kernel_dim", "q_lora_rank", "kv_lora_rank",
                             "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
                             # DSA's rows set megatron-core 0.19's own dsa_indexer_* fields
                             *(r.field for r in mixers()["D"].options if r.field.startswith("dsa_indexer_"))}
    assert len([f for f in declared if f.startswith("dsa_indexer_")]) == 9


def _parser(rows):
    from hp_megatron.arguments import add_row_arguments

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_row_arguments(parser, rows)
    return parser


@pytest.mark.parametrize("kind,check,text,expected", [
    (float, "positive", "-1", "expected a positive number, got -1"),
    (int, "positive", "0", "expected a positive int, got 0"),
    (int, "non_negative", "-2", "expected an int >= 0, got -2"),
    (float, "non_negative", "-0.5", "expected a number >= 0, got -0.5"),
    (float, "negative", "0", "expected a negative number, got 0"),
    (int, "negative", "3", "expected a negative int, got 3"),
])
def test_option_checks_say_what_they_expect(kind, check, text, expected):
    from layers.base.options import OptionRow

    row = OptionRow("--hp-zeta-x", "zeta_x", type=kind, check=check)
    with pytest.raises(argparse.ArgumentError, match=f"^argument --hp-zeta-x: {expected}$"):
        _parser([row]).parse_args(["--hp-zeta-x", text])
    assert row.problem(kind(text)) == f"must be {expected.split(', got')[0][len('expected '):]} or None"


def test_bool_rows_honour_their_default():
    from layers.base.options import OptionRow

    on = OptionRow("--hp-zeta-on", "zeta_on", type=bool, default=True)
    off = OptionRow("--hp-zeta-off", "zeta_off", type=bool)
    parser = _parser([on, off])
    assert (parser.parse_args([]).hp_zeta_on, parser.parse_args([]).hp_zeta_off) == (True, False)
    assert parser.parse_args(["--no-hp-zeta-on", "--hp-zeta-off"]).hp_zeta_on is False
    assert parser.parse_args(["--hp-zeta-on"]).hp_zeta_on is True
    with pytest.raises(ValueError, match=r"a bool row's default must be True, False or None, got 'yes'"):
        OptionRow("--hp-zeta-bad", "zeta_bad", type=bool, default="yes")


def test_megatron_lm_launchers_refuse_before_the_config_is_built(scratch_registry, capsys, monkeypatch):
    """``hp_launch.check_args`` (run by ``with_hp_config`` before Megatron-LM's config, hence the model, is built)
    refuses what the pattern's mixers do not declare; the launchers' ``exit_refusing_unsupported`` makes it one
    line and status 2 (rank 0 prints)."""
    from hp_megatron.registry import UnsupportedByMixer, register_mixer

    monkeypatch.syspath_prepend(os.path.join(EXAMPLE, "megatron_lm"))
    import hp_launch

    register_mixer(_entry())
    args = _args(context_parallel_size=2, hp_cp_layout="zigzag", spec=["hp_megatron.specs", "hybrid_spec"])
    with pytest.raises(UnsupportedByMixer, match=r"^zeta \(Z in --hp-layer-pattern Z\) has no context-parallel"):
        hp_launch.check_args(args)
    hp_launch.check_args(_args(hp_layer_pattern="GM", context_parallel_size=2, hp_cp_layout="zigzag", spec=None))

    def main():
        hp_launch.check_args(args)

    monkeypatch.setenv("RANK", "0")
    assert hp_launch.exit_refusing_unsupported(main) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: zeta (Z in --hp-layer-pattern Z) has no"), lines
    monkeypatch.setenv("RANK", "1")
    assert hp_launch.exit_refusing_unsupported(main) == 2 and capsys.readouterr().err == ""


def test_toy_check_args_hook_and_the_deprecated_mtp_keyword(scratch_registry):
    import warnings

    from hp_megatron.arguments import check_mixer_support
    from hp_megatron.registry import MixerSupport

    import tests.support.toy_mixer  # noqa: F401  (registers T in the scratch registry)

    check_mixer_support(_args(hp_layer_pattern="TM", hp_toy_ema_decay=0.5))
    with pytest.raises(ValueError, match=r"^--hp-toy-ema-decay 1.5 must be in \(0, 1\)"):
        check_mixer_support(_args(hp_layer_pattern="TM", hp_toy_ema_decay=1.5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        entry = _entry(mtp=True)
    assert entry.supports.mtp and entry.mtp and caught[0].category is DeprecationWarning
    assert _entry(supports=MixerSupport(mtp=True)).mtp is True
    with pytest.raises(ValueError, match=r"mtp=False contradicts supports.mtp=True"):
        _entry(mtp=False, supports=MixerSupport(mtp=True))
