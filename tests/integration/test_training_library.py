"""The library parts of the training scripts: ``hp_megatron.model_builders`` (the one hybrid GPTModel builder of
the example, the Megatron-LM launcher and ``hp_megatron.models.preset_gpt_model``), ``hp_megatron.checkpoint``
(Megatron-LM's checkpoint directory layout, also read by the converter) and ``hp_megatron.platform``'s CPU-safe config
fields, which must say what Megatron-LM's CPU flags say."""
import os
import re
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.support.paths import EXAMPLE, MEGATRON_LM, REPO, megatron_lm_skip

LAUNCHER = os.path.join(EXAMPLE, "megatron_lm")


def _megatron_lm():
    """The Megatron-LM 0.16 checkout (0.19's imports typing.override: Python >= 3.12), else skip saying why."""
    if megatron_lm_skip((0, 16)):
        pytest.skip(megatron_lm_skip((0, 16)))
    return MEGATRON_LM


def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from hp_megatron.platform import CPU_SAFE_CONFIG

    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, normalization="RMSNorm",
                  add_bias_linear=False, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                  hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, **CPU_SAFE_CONFIG)
    return TransformerConfig(**{**fields, **overrides})


def test_hybrid_gpt_model_has_our_final_norm_and_patches_nothing(single_rank):
    import megatron.core.transformer.transformer_block as transformer_block

    from hp_megatron.specs import get_hybrid_layer_spec
    from hp_megatron.model_builders import hybrid_gpt_model
    from layers.shared.norm import RMSNorm

    before = transformer_block.LayerNormImpl
    model = hybrid_gpt_model(_config(layernorm_zero_centered_gamma=True, layernorm_epsilon=1e-6),
                             get_hybrid_layer_spec("AA"), vocab_size=64, max_sequence_length=16,
                             position_embedding_type="rope")
    assert transformer_block.LayerNormImpl is before
    norm = model.decoder.final_layernorm
    assert type(norm) is RMSNorm and norm.zero_centered_gamma and norm.eps == 1e-6
    assert len(model.decoder.layers) == 2 and model.embedding.word_embeddings.weight.shape == (64, 32)
    tokens = torch.randint(0, 64, (1, 16))
    logits = model(tokens, torch.arange(16)[None], None)
    assert logits.shape == (1, 16, 64) and torch.isfinite(logits).all()


def _launcher_args(**overrides):
    args = dict(spec=["hp_megatron.specs", "attn_spec"], padded_vocab_size=128, max_position_embeddings=16,
                fp16_lm_cross_entropy=False, untie_embeddings_and_output_weights=True,
                position_embedding_type="rope", rotary_percent=1.0, rotary_base=10000, use_rope_scaling=False,
                use_legacy_models=False, mtp_num_layers=None, yaml_cfg=None, hp_backend="eager")
    return SimpleNamespace(**{**args, **overrides})


def test_launcher_builds_its_model_with_the_library_builder(single_rank, monkeypatch):
    """pretrain_gpt_hp.py's builder for ``--spec hp_megatron.specs NAME``: Megatron-LM's GPTModel keywords, our
    final norm, megatron's module-level LayerNormImpl untouched; what it does not build is refused."""
    monkeypatch.syspath_prepend(_megatron_lm())
    monkeypatch.syspath_prepend(LAUNCHER)
    import megatron.core.transformer.transformer_block as transformer_block
    from pretrain_gpt_hp import _hybrid_gpt_builder

    from layers.shared.norm import RMSNorm

    before = transformer_block.LayerNormImpl
    model = _hybrid_gpt_builder(_launcher_args(), True, True, config=_config())
    assert transformer_block.LayerNormImpl is before
    assert type(model.decoder.final_layernorm) is RMSNorm
    assert model.embedding.word_embeddings.weight.shape == (128, 32) and model.output_layer.weight.shape == (128, 32)
    assert not model.share_embeddings_and_output_weights and model.position_embedding_type == "rope"
    with pytest.raises(ValueError, match="--yaml-cfg is not supported with --spec hp_megatron.specs"):
        _hybrid_gpt_builder(_launcher_args(yaml_cfg="run.yaml"), True, True, config=_config())


def test_checkpoint_directories_follow_megatron_lm(tmp_path):
    from hp_megatron.checkpoint import (TRACKER, checkpoint_directory, find_checkpoint, iteration_directory,
                                        write_tracker)

    root = str(tmp_path)
    assert find_checkpoint(root) is None
    assert iteration_directory(root, 12) == os.path.join(root, "iter_0000012")
    assert iteration_directory(root, None) == os.path.join(root, "release")
    os.makedirs(iteration_directory(root, 12))
    write_tracker(root, 12)
    assert (tmp_path / TRACKER).read_text() == "12" and find_checkpoint(root) == iteration_directory(root, 12)
    (tmp_path / "iter_0000012" / "metadata.json").write_text("{}")
    assert checkpoint_directory(root) == iteration_directory(root, 12)  # the converter reads the same layout
    write_tracker(root, None)
    with pytest.raises(ValueError, match="says 'release', but .*release does not exist"):
        find_checkpoint(root)
    (tmp_path / TRACKER).write_text("latest")
    with pytest.raises(ValueError, match="holds 'latest', not an iteration number"):
        find_checkpoint(root)


def test_cpu_safe_config_is_what_megatron_lm_cpu_flags_set(monkeypatch):
    """``CPU_SAFE_CONFIG`` equals the TransformerConfig fields Megatron-LM builds from ``MEGATRON_LM_CPU_FLAGS``
    (whose own defaults are the fused kernels), and docs/usage.md's CPU recipe passes exactly those flags."""
    monkeypatch.syspath_prepend(_megatron_lm())
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

    from hp_megatron.platform import CPU_SAFE_CONFIG, MEGATRON_LM_CPU_FLAGS

    base = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
            "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "3", "--swiglu", "--normalization", "RMSNorm"]
    configs = {}
    for name, extra in (("cpu", list(MEGATRON_LM_CPU_FLAGS)), ("default", ["--transformer-impl", "local"])):
        monkeypatch.setattr(sys, "argv", base + extra)
        args = parse_args()
        args.world_size, args.rank = 1, 0
        validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
        configs[name] = core_transformer_config_from_args(args)
    assert {k: getattr(configs["cpu"], k) for k in CPU_SAFE_CONFIG} == CPU_SAFE_CONFIG
    assert any(getattr(configs["default"], k) != v for k, v in CPU_SAFE_CONFIG.items())  # the flags do something
    with open(os.path.join(REPO, "docs", "usage.md"), encoding="utf-8") as f:
        recipe = re.search(r'CPU_FLAGS="([^"]*)"', f.read())
    assert recipe and tuple(recipe.group(1).split()) == MEGATRON_LM_CPU_FLAGS
