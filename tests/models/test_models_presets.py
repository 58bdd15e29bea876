"""Presets from HF config.json files (registry, refused fields, Megatron arguments, ``--hp-hf-config``) and the
specs' MoE switch (``--num-experts`` / ``moe_layer_freq`` give megatron-core MoE layers in every spec)."""
from __future__ import annotations

import argparse
import json
import tempfile

import pytest
import torch


QWEN3_NEXT = {"model_type": "qwen3_next", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
              "linear_value_head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
              "shared_expert_intermediate_size": 24, "mlp_only_layers": [1], "hidden_act": "silu",
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}}


def test_registry_and_refusals():
    import re

    from hp_megatron.models import ARCHITECTURES, get_architecture, preset_from_hf

    assert {"deepseek_v3", "kimi_linear", "llama", "qwen3_next"} <= set(ARCHITECTURES)
    with pytest.raises(ValueError, match=rf"'gpt2'.*supported: {re.escape(str(sorted(ARCHITECTURES)))}"):
        get_architecture("gpt2")
    preset = preset_from_hf(QWEN3_NEXT)
    assert preset.pattern == "GGGA" and preset.qk_layernorm
    fields = preset.transformer_fields
    assert fields["moe_layer_freq"] == [1, 0, 1, 1] and fields["moe_shared_expert_gate"]
    assert preset.gpt_model_kwargs["rotary_percent"] == 0.25
    assert preset.mixer_fields["gated_norm_zero_centered_gamma"] is False
    for field, value in (("hidden_act", "gelu"), ("attention_bias", True),
                         ("rope_parameters", {"rope_type": "yarn", "factor": 4.0})):
        with pytest.raises(ValueError, match=field.split("_parameters")[0]):
            preset_from_hf({**QWEN3_NEXT, field: value})
    deepseek = {"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
                "num_hidden_layers": 2, "num_attention_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 4,
                "n_group": 2, "topk_group": 1, "moe_intermediate_size": 16, "kv_lora_rank": 12,
                "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6, "hidden_act": "silu"}
    with pytest.raises(ValueError, match="num_experts_per_tok / topk_group == 2"):
        preset_from_hf(deepseek)
    with pytest.raises(ValueError, match="norm_topk_prob"):
        preset_from_hf({**deepseek, "topk_group": 2, "norm_topk_prob": False})
    with pytest.raises(ValueError, match="moe_router_activation_func"):
        preset_from_hf({**deepseek, "model_type": "kimi_linear", "topk_group": 2,
                        "moe_router_activation_func": "softmax"})


def test_olmo_hybrid_preset_from_transformers_defaults():
    """OlmoHybridConfig's defaults (Olmo-Hybrid-7B's shapes): GDN 3:1 attention, K = 0.75 hidden / heads, V = 2K,
    negative eigenvalues, post-norm attention with whole-projection q/k norms; RoPE only with a rope_theta."""
    from transformers import OlmoHybridConfig

    from hp_megatron.models import preset_from_hf

    hf = OlmoHybridConfig().to_dict()
    preset = preset_from_hf(hf)
    assert preset.pattern == "GGGA" * 8 and preset.qk_layernorm
    assert {k: preset.mixer_fields[k] for k in ("linear_key_head_dim", "linear_value_head_dim", "gdn_allow_neg_eigval",
                                                 "hp_post_norm_symbols", "hp_qk_norm_scope", "delta_norm_eps")} == \
        dict(linear_key_head_dim=96, linear_value_head_dim=192, gdn_allow_neg_eigval=True, hp_post_norm_symbols="A",
             hp_qk_norm_scope="projection", delta_norm_eps=1e-5)
    assert preset.gpt_model_kwargs["position_embedding_type"] == "rope"
    released = preset_from_hf({**hf, "rope_parameters": {"rope_type": "default", "rope_theta": None}})
    assert released.gpt_model_kwargs["position_embedding_type"] == "none"
    with pytest.raises(ValueError, match="rope_parameters"):
        preset_from_hf({**hf, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}})
    with pytest.raises(ValueError, match="layer_types"):
        preset_from_hf({**hf, "layer_types": ["sliding_attention"] * 32})


def test_hf_config_flag_sets_megatron_args_and_config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from hp_megatron.arguments import add_hp_arguments, apply_hp_config
    from hp_megatron.models.args import apply_hf_config_to_args

    with tempfile.TemporaryDirectory() as directory:
        with open(f"{directory}/config.json", "w") as f:
            json.dump(QWEN3_NEXT, f)
        parser = add_hp_arguments(argparse.ArgumentParser())
        args = parser.parse_args(["--hp-hf-config", directory])
        preset = apply_hf_config_to_args(args)
        assert (args.num_experts, args.moe_router_topk, args.layernorm_zero_centered_gamma, args.swiglu) == \
            (4, 2, True, True)
        assert (args.num_query_groups, args.group_query_attention, args.kv_channels) == (2, True, 16)
        assert args.untie_embeddings_and_output_weights and args.hp_layer_pattern == "GGGA"
        config = apply_hp_config(TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4), args)
    assert (config.linear_num_value_heads, config.linear_value_head_dim) == (4, 8)
    assert config.gated_norm_zero_centered_gamma is False and config.hp_layer_pattern == preset.pattern
    assert type(config).__name__ == "HybridTransformerConfig" and not config.multi_latent_attention


def _block(spec, **moe):
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                               use_cpu_initialization=True, add_bias_linear=False, gated_linear_unit=True,
                               activation_func=torch.nn.functional.silu, linear_num_key_heads=2,
                               linear_key_head_dim=8, hidden_dropout=0.0, attention_dropout=0.0, **moe)
    return TransformerBlock(config, spec, pre_process=True, post_process=False)


def test_num_experts_gives_moe_layers_in_every_spec(single_rank):
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from hp_megatron.specs import get_hybrid_layer_spec, get_layer_spec

    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_token_dispatcher_type="allgather")
    for spec in (get_layer_spec("gdn"), get_hybrid_layer_spec("GA")):
        block = _block(spec, **moe)
        assert all(type(layer.mlp) is MoELayer for layer in block.layers)
        out = block(torch.randn(6, 2, 32), None)
        assert torch.isfinite(out[0] if isinstance(out, tuple) else out).all()
    block = _block(get_layer_spec("gdn"), moe_layer_freq=[0, 1, 1], **moe)
    assert [type(layer.mlp) for layer in block.layers] == [MLP, MoELayer, MoELayer]
    assert [type(layer.mlp) for layer in _block(get_layer_spec("gdn"), moe_layer_freq=2, **moe).layers] == \
        [MoELayer, MLP, MoELayer]
    spec = get_layer_spec("gdn")
    spec.submodules.moe_mlp = None
    with pytest.raises(ValueError, match="num_moe_experts=4 asks for MoE layers"):
        _block(spec, **moe)
    with pytest.raises(ValueError, match="qk_layernorm"):
        _block(get_layer_spec("attn"), qk_layernorm=True)
