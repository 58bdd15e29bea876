"""The declared config classes (hp_megatron/config.py) and ``apply_hp_config``, in process, no ranks spawned.

* The class choice (MLA or not), the declared fields, and that a result holds no attribute outside them.
* Bad values of our fields raise ValueError naming the field and the value (constructor and conversion).
* Every megatron field survives ``apply_hp_config`` unchanged (the same object), for the configs the example
  (plain and the three ``--hp-hf-config`` presets) and Megatron-LM's launcher (plain and
  ``--multi-latent-attention``) build.
* docs/usage.md's field table lists every declared field.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import fields

import pytest

from tests.support.paths import EXAMPLE, MEGATRON_LM, REPO, megatron_lm_skip

for path in (EXAMPLE, os.path.join(REPO, "tests", "megatron_lm")):
    if path not in sys.path:
        sys.path.insert(0, path)


def _plain(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, **kw)


def _mla(**kw):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, kv_lora_rank=16, **kw)


def _field_names(config) -> set:
    return {f.name for f in fields(config)}


def assert_megatron_fields_kept(before, after, changed):
    """``after`` is the declared class of ``before``, holds only its fields, and every field of ``before`` not in
    ``changed`` is the same object."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from hp_megatron.config import HybridMLATransformerConfig, HybridTransformerConfig

    wanted = HybridMLATransformerConfig if isinstance(before, MLATransformerConfig) else HybridTransformerConfig
    assert type(after) is wanted
    from hp_megatron.registry import option_rows

    # a registered mixer's own fields are attributes (DSA's dsa_indexer_* on megatron-core 0.16, whose config has none)
    assert set(vars(after)) <= _field_names(after) | {row.field for row in option_rows() if row.field}
    moved = [f.name for f in fields(before)
             if f.name not in changed and getattr(after, f.name) is not getattr(before, f.name)]
    assert not moved, moved


def test_class_choice_and_declared_fields():
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    from hp_megatron.config import (HYBRID_FIELD_NAMES, MLA_FIELD_NAMES, HybridMLATransformerConfig,
                                    HybridTransformerConfig, hybrid_config)

    plain, mla = hybrid_config(_plain()), hybrid_config(_mla())
    assert type(plain) is HybridTransformerConfig and isinstance(plain, TransformerConfig)
    assert type(mla) is HybridMLATransformerConfig and isinstance(mla, MLATransformerConfig)
    assert not plain.multi_latent_attention and mla.multi_latent_attention  # GPTModel's rotary: only for plain
    mla_only = _field_names(MLATransformerConfig) - _field_names(TransformerConfig)
    assert set(MLA_FIELD_NAMES) == mla_only - {"multi_latent_attention", "cache_mla_latents"}
    assert _field_names(plain) == _field_names(TransformerConfig) | set(MLA_FIELD_NAMES) | set(HYBRID_FIELD_NAMES)
    assert _field_names(mla) == _field_names(MLATransformerConfig) | set(HYBRID_FIELD_NAMES)
    assert (plain.q_lora_rank, plain.rope_type, plain.hp_cp_layout, plain.hp_backend) == (512, "yarn", "zigzag",
                                                                                          "eager")
    assert mla.kv_lora_rank == 16 and set(vars(plain)) <= _field_names(plain) and set(vars(mla)) <= _field_names(mla)
    # built directly, megatron's __post_init__ runs too
    direct = HybridTransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, hp_layer_pattern="GA")
    assert direct.ffn_hidden_size == 128 and direct.kv_channels == 8
    # a config Megatron-LM's deprecated --enable-cuda-graph built: its __post_init__ would refuse a second run
    graphs = _plain(enable_cuda_graph=True)
    assert_megatron_fields_kept(graphs, hybrid_config(graphs, hp_backend="triton"), {"hp_backend"})
    # attributes set the old way (setattr of our names on a plain config) become the fields
    old = _plain()
    old.delta_cp_method = "p2p"
    assert hybrid_config(old).delta_cp_method == "p2p"
    old.delta_cp_metod = "p2p"
    with pytest.raises(TypeError, match=r"no field\(s\) \['delta_cp_metod'\]"):
        hybrid_config(old)
    with pytest.raises(TypeError, match=r"no field\(s\) \['backend'\]"):
        hybrid_config(_plain(), backend="triton")
    with pytest.raises(TypeError, match="needs a megatron TransformerConfig"):
        hybrid_config(object())


BAD_VALUES = [("hp_cp_layout", "zz"), ("hp_backend", "cuda"), ("delta_cp_method", "ring"),
              ("mla_cp_strategy", "ulysses"), ("rope_type", "nope"), ("delta_cp_group_size", 0),
              ("delta_cp_ulysses_degree", 1.5), ("kda_gate_low_rank_dim", True), ("kda_lower_bound", 0.0),
              ("kda_safe_gate", "yes"), ("linear_conv_bias", 1), ("gated_norm_zero_centered_gamma", 0),
              ("hp_layer_pattern", "GXA"), ("hp_layer_pattern", ""), ("delta_cp_auto_measure", -1),
              ("delta_cp_auto_measure", None)]


@pytest.mark.parametrize("name,value", BAD_VALUES)
def test_bad_values_name_the_field(name, value):
    from hp_megatron.config import HybridTransformerConfig, hybrid_config

    message = re.escape(f"{name}") + ".*" + re.escape(repr(value))
    with pytest.raises(ValueError, match=message):
        HybridTransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, **{name: value})
    if name != "rope_type":  # megatron's own flags set the MLA class's rope_type
        with pytest.raises(ValueError, match=message):
            hybrid_config(_mla(), **{name: value})


def test_example_configs_keep_megatron_fields(monkeypatch, tmp_path):
    import pretrain_hybrid

    from hp_megatron.arguments import hp_config_from_args
    from hp_megatron.models import preset_from_hf
    from hp_megatron.models.tiny import TINY_ARCHITECTURES, tiny_hf_config

    import hp_megatron.arguments

    seen = []
    apply = hp_megatron.arguments.apply_hp_config
    recording = lambda config, args: seen.append(config) or apply(config, args)  # noqa: E731
    # the flags' path applies it in hp_megatron.training.model_args (imported at call time), a preset's in the example
    monkeypatch.setattr(hp_megatron.arguments, "apply_hp_config", recording)
    monkeypatch.setattr(pretrain_hybrid, "apply_hp_config", recording)
    monkeypatch.setenv("WORLD_SIZE", "1")
    tiny = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "1", "--global-batch-size", "2"]
    args = pretrain_hybrid.parse_args([*tiny, "--hp-layer-pattern", "GKMA", "--hp-cp-layout", "zigzag",
                                       "--hp-backend", "eager", "--hp-mla-rope-type", "none"])
    config = pretrain_hybrid.build_config(args, 64)
    assert_megatron_fields_kept(seen[-1], config, hp_config_from_args(args))
    assert (config.hp_layer_pattern, config.rope_type, config.kv_lora_rank) == ("GKMA", "none", 16)
    assert config.rotary_base == 10000.0
    args = pretrain_hybrid.parse_args([*tiny, "--hp-layer-pattern", "KKKM", "--rotary-base", "50000"])
    assert pretrain_hybrid.build_config(args, 64).rotary_base == 50000.0   # the MLA layers' RoPE base too
    for arch in sorted(TINY_ARCHITECTURES):
        _, hf = tiny_hf_config(arch)
        hf.save_pretrained(tmp_path / arch)
        args = pretrain_hybrid.parse_args([*tiny, "--hp-hf-config", str(tmp_path / arch)])
        config = pretrain_hybrid.build_config(args, 64)
        preset = preset_from_hf(str(tmp_path / arch))
        assert_megatron_fields_kept(seen[-1], config, {**hp_config_from_args(args), **preset.mixer_fields})
        assert config.hp_layer_pattern == preset.pattern
        assert all(getattr(config, k) == v for k, v in preset.mixer_fields.items()), arch
        assert all(getattr(config, k) == v for k, v in preset.transformer_fields.items() if k != "num_layers"), arch
        if preset.gpt_model_kwargs.get("position_embedding_type") != "none":   # NoPE (OLMo-Hybrid): no RoPE base
            assert config.rotary_base == preset.gpt_model_kwargs.get("rotary_base",
                                                                     preset.mixer_fields.get("rotary_base")), arch


def test_megatron_lm_configs_keep_megatron_fields(monkeypatch):
    if megatron_lm_skip((0, 16)):  # Megatron-LM 0.19 imports typing.override (Python >= 3.12)
        pytest.skip(megatron_lm_skip((0, 16)))
    monkeypatch.syspath_prepend(MEGATRON_LM)
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

    from hp_megatron.arguments import add_hp_arguments, apply_hp_config, hp_config_from_args

    base = ["pretrain_gpt.py", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
            "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "3", "--transformer-impl", "local",
            "--use-cpu-initialization", "--no-gradient-accumulation-fusion", "--swiglu", "--normalization", "RMSNorm",
            "--hp-mla-kv-lora-rank", "24"]
    for extra, mla in ((["--hp-layer-pattern", "GGGA"], False),
                       (["--hp-layer-pattern", "KKKM", "--multi-latent-attention", "--kv-lora-rank", "16"], True)):
        monkeypatch.setattr(sys, "argv", base + extra)
        args = parse_args(extra_args_provider=add_hp_arguments)
        args.world_size, args.rank = 1, 0
        validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
        before = core_transformer_config_from_args(args)
        config = apply_hp_config(before, args)
        assert config.multi_latent_attention is mla
        assert_megatron_fields_kept(before, config, hp_config_from_args(args))
        assert config.kv_lora_rank == (16 if mla else 24)  # an MLA config keeps Megatron-LM's MLA flags


def test_usage_doc_lists_every_field():
    from hp_megatron.config import HYBRID_FIELD_NAMES

    with open(os.path.join(REPO, "docs", "usage.md"), encoding="utf-8") as f:
        rows = {m.group(1) for m in re.finditer(r"^\| `(\w+)` \|", f.read(), re.M)}
    assert set(HYBRID_FIELD_NAMES) <= rows, sorted(set(HYBRID_FIELD_NAMES) - rows)


def _layouts(config, pattern, **spec_kwargs):
    """The CP layout each layer's mixer (GDN/KDA/MLA ``cp_layout``, attention core ``layout``) was built with."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    from hp_megatron.specs import get_hybrid_layer_spec

    block = TransformerBlock(config, get_hybrid_layer_spec(pattern, "eager", **spec_kwargs), post_process=False)
    return [getattr(layer.self_attention, "cp_layout", None) or layer.self_attention.core_attention.layout
            for layer in block.layers]


def test_every_mixer_reads_the_shared_layout_field(single_rank):
    """GDN, KDA, MLA and attention take ``hp_cp_layout``; a plain TransformerConfig plus ModuleSpec params still
    builds them."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from hp_megatron.config import HybridTransformerConfig
    from layers.mixers.attention.context_parallel import ContextParallelDotProductAttention

    shape = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, use_cpu_initialization=True,
                 add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, linear_num_key_heads=2,
                 linear_key_head_dim=8)
    config = HybridTransformerConfig(**shape, q_lora_rank=None, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
                                     v_head_dim=8, hp_layer_pattern="GKMA", hp_cp_layout="contiguous")
    assert _layouts(config, "GKMA") == ["contiguous"] * 4
    plain = TransformerConfig(**{**shape, "num_layers": 3})
    assert _layouts(plain, "GKA", cp_layout="contiguous") == ["contiguous"] * 3
    assert _layouts(plain, "GKA") == ["zigzag"] * 3
    with pytest.raises(ValueError, match="layout must be one of.*'zz'"):
        ContextParallelDotProductAttention(config, 1, layout="zz")
