"""The mixer registry (hp_megatron.registry): the built-in entries, what reads them, and the refusals (no entry is
added in this process: each refused registration raises before it is stored)."""
import pytest


def test_builtin_entries_and_their_readers():
    from hp_megatron.registry import mixers, mtp_symbols, symbols, symbols_where
    from hp_megatron.models import kimi_linear, qwen3_next
    from hp_megatron.specs import gpt_layer_specs as layer_specs, hybrid_stack_specs as hybrid_stack

    assert symbols() == {"G": "gdn", "K": "kda", "M": "mla", "A": "attn", "D": "dsa"}
    assert layer_specs.SYMBOLS == symbols() and layer_specs.MIXERS == ("gdn", "kda", "mla", "attn", "dsa")
    assert layer_specs.OWN_POSITIONS == ("M", "D") and mtp_symbols() == ("A", "D", "M")
    assert hybrid_stack.g_mixers() == ("gdn", "kda") and symbols_where(lambda e: e.model_rope) == ("A",)
    assert set(kimi_linear.LAYER_SYMBOLS.values()) | set(qwen3_next.LAYER_SYMBOLS.values()) <= set(symbols())
    for entry in mixers().values():
        assert entry.mixer_class().__name__ in entry.module


def test_refusals_name_the_clash():
    from hp_megatron.registry import MixerEntry, check_hf_symbols, mixer, register_mixer, symbols
    from hp_megatron.registry.gdn import GDN

    assert register_mixer(GDN) is GDN   # the same entry again: a no-op
    with pytest.raises(ValueError, match=r"mixer symbol 'G' is taken by 'gdn'"):
        register_mixer(MixerEntry(symbol="G", name="other", title="other", spec=GDN.spec, module=GDN.module))
    with pytest.raises(ValueError, match=r"mixer name 'gdn' is taken by symbol 'G'"):
        register_mixer(MixerEntry(symbol="Z", name="gdn", title="other", spec=GDN.spec, module=GDN.module))
    with pytest.raises(ValueError, match=r"MixerEntry.symbol must be one letter, got 'GG'"):
        MixerEntry(symbol="GG", name="x", title="x", spec=GDN.spec, module=GDN.module)
    with pytest.raises(ValueError, match=r"no mixer is registered under symbol 'Z'; known: G=GDN, K=KDA"):
        mixer("Z")
    with pytest.raises(ValueError, match=r"demo: layer symbols \['Z'\] have no registered mixer"):
        check_hf_symbols("demo", {"linear_attention": "Z"})
    assert "Z" not in symbols()


def test_architectures_take_each_mixers_rules_from_the_registry():
    """The conversion rules of a layer are looked up by (architecture, symbol): every symbol an architecture maps
    has rules there; a mixer without rules for an architecture is refused naming the ones it has."""
    from hp_megatron.registry import conversion_rules_of
    from hp_megatron.models import deepseek_v3, kimi_linear, qwen3_next

    for module in (kimi_linear, qwen3_next):
        for symbol in module.LAYER_SYMBOLS.values():
            assert callable(conversion_rules_of(module.MODEL_TYPE, symbol))
    assert conversion_rules_of("deepseek_v3", "M") is deepseek_v3.mla_layer_rules
    assert conversion_rules_of("kimi_linear", "M") is kimi_linear.mla_layer_rules
    with pytest.raises(ValueError, match=r"qwen3_next: mixer 'kda' \(K\) has no conversion rules for it; it has "
                                         r"them for \['bailing_hybrid', 'kimi_linear'\]"):
        conversion_rules_of("qwen3_next", "K")


def test_pattern_errors_name_the_registered_symbols():
    from hp_megatron.specs import get_hybrid_layer_spec, get_layer_spec

    with pytest.raises(ValueError, match=r"symbols \['X'\] that have no layer spec; known symbols: \['A', 'D', 'G', "
                                         r"'K', 'M'\]"):
        get_hybrid_layer_spec("KKXM")
    with pytest.raises(ValueError, match=r"mixer must be one of \('gdn', 'kda', 'mla', 'attn', 'dsa'\), got 'mamba'"):
        get_layer_spec("mamba")
