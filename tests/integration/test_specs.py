"""hp_megatron.specs on the installed megatron-core (0.16 or 0.19; see tests/run_mcore_versions.sh).

One 2-rank gloo spawn builds hybrid blocks under PP=2 and PP=2 x VPP=2 and reports, per stage, each layer's
global number, pattern symbol and mixer class, the checkpoint layer keys, a forward pass and a custom spec.
"""
import argparse
import copy

import pytest
import torch

from tests.support.dist import run_distributed

PATTERN = "GKMAK"  # 5 symbols over 8 layers: G K M A K G K M
NUM_LAYERS = 8
EXPECTED_TYPES = "GKMAKGKM"
MIXER_CLASS = {"G": "GatedDeltaNet", "K": "KimiDeltaAttention", "M": "MultiLatentAttention", "A": "SelfAttention"}


def _config(pp, vpp):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from hp_megatron.arguments import add_hp_arguments, apply_hp_config

    config = TransformerConfig(
        num_layers=NUM_LAYERS, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.float32,
        use_cpu_initialization=True, params_dtype=torch.float32, gradient_accumulation_fusion=False,
        bias_dropout_fusion=False, normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0)
    args = add_hp_arguments(argparse.ArgumentParser()).parse_args([])
    args.num_attention_heads, args.hidden_size = 2, 32
    return apply_hp_config(config, args)


def _block(config, spec, vp_stage):
    from megatron.core.transformer.transformer_block import TransformerBlock

    return TransformerBlock(config, spec, pre_process=True, post_process=False, vp_stage=vp_stage)


def _describe(block):
    return [(layer.layer_number, layer.layer_symbol, type(layer.self_attention).__name__) for layer in block.layers]


def _worker(rank, world_size):
    from megatron.core import parallel_state

    from hp_megatron.platform import apply_cpu_training_shims
    from hp_megatron.specs import get_hybrid_layer_spec, kimi_linear_spec

    apply_cpu_training_shims(0)
    result = {}
    # --- PP = 2
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    config = _config(2, None)
    block = _block(config, get_hybrid_layer_spec(PATTERN), None)
    result["pp"] = _describe(block)
    keys = block.sharded_state_dict(prefix="decoder.").keys()
    sharded = {v.key.split(".")[2] for v in block.sharded_state_dict(prefix="decoder.").values()
               if hasattr(v, "key") and v.key.startswith("decoder.layers.")}
    result["pp_ckpt_layers"] = sorted(int(i) for i in sharded)
    result["pp_local_keys"] = sorted({k.split(".")[2] for k in keys if k.startswith("decoder.layers.")})
    hidden = torch.randn(8, 2, 32)
    out = block(hidden, None)
    out = out[0] if isinstance(out, tuple) else out
    result["forward_shape"] = tuple(out.shape)
    result["forward_finite"] = bool(torch.isfinite(out).all())
    # --- a custom spec: swap the KDA layers' output projection class
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    class MyRowParallelLinear(RowParallelLinear):
        pass

    custom = copy.deepcopy(kimi_linear_spec)
    custom.submodules.layer_types["K"].self_attention.submodules.out_proj = MyRowParallelLinear
    custom_block = _block(config, custom, None)
    result["custom"] = [(layer.layer_symbol, type(getattr(layer.self_attention, "out_proj", None)).__name__)
                        for layer in custom_block.layers]
    parallel_state.destroy_model_parallel()
    # --- PP = 2 x VPP = 2
    kwargs = {"virtual_pipeline_model_parallel_size": 2}
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2, **kwargs)
    config = _config(2, 2)
    result["vpp"] = [_describe(_block(config, get_hybrid_layer_spec(PATTERN), vp)) for vp in range(2)]
    parallel_state.destroy_model_parallel()
    return result


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2)


def test_pp_stages_get_global_layer_types(results):
    for rank in range(2):
        layers = results[rank]["pp"]
        assert [n for n, _, _ in layers] == list(range(1 + 4 * rank, 5 + 4 * rank))
        for number, symbol, cls in layers:
            assert symbol == EXPECTED_TYPES[number - 1]
            assert cls == MIXER_CLASS[symbol]


def test_vpp_chunks_get_global_layer_types(results):
    # 8 layers, PP=2, VPP=2: chunks of 2 layers; rank r, chunk v holds layers 2*(v*2 + r) + 1, + 2
    for rank in range(2):
        for vp in range(2):
            layers = results[rank]["vpp"][vp]
            first = 2 * (vp * 2 + rank) + 1
            assert [n for n, _, _ in layers] == [first, first + 1]
            assert [s for _, s, _ in layers] == list(EXPECTED_TYPES[first - 1:first + 1])
            assert [c for _, _, c in layers] == [MIXER_CLASS[s] for _, s, _ in layers]


def test_checkpoint_keys_use_global_layer_indices(results):
    for rank in range(2):
        assert results[rank]["pp_ckpt_layers"] == list(range(4 * rank, 4 * rank + 4))
        assert results[rank]["pp_local_keys"] == ["0", "1", "2", "3"]


def test_hybrid_block_forward(results):
    for rank in range(2):
        assert results[rank]["forward_shape"] == (8, 2, 32)
        assert results[rank]["forward_finite"]


def test_custom_spec_swaps_a_submodule(results):
    for rank in range(2):
        custom = results[rank]["custom"]
        assert [s for s, _ in custom] == list("KKKM")
        assert [p for s, p in custom if s == "K"] == ["MyRowParallelLinear"] * 3


def test_ready_specs_import_like_megatron_lm():
    """Megatron-LM's --spec MODULE NAME does import_module((MODULE, NAME)) and uses the object as is."""
    from megatron.core.transformer.spec_utils import import_module

    import hp_megatron.specs as specs
    from hp_megatron.gpt.layer import PatternLayer

    for name in specs.READY_SPECS:
        obj = import_module(("hp_megatron.specs", name))
        assert obj is getattr(specs, name)
    assert specs.kimi_linear_spec.module is PatternLayer and specs.kimi_linear_spec.params["pattern"] == "KKKM"
    assert specs.qwen3_next_spec.params["pattern"] == "GGGA"
    assert specs.hybrid_spec.params["pattern"] is None
    assert specs.gdn_triton_spec.submodules.layer_types["G"].self_attention.params["backend"] == "triton"
    assert specs.kda_ascendc_spec.submodules.layer_types["K"].self_attention.params["backend"] == "ascendc"


def test_providers_and_errors():
    from megatron.core.models.backends import BackendSpecProvider
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from hp_megatron.specs import (AscendCSpecProvider, EagerSpecProvider, TritonSpecProvider,
                                   get_hybrid_layer_spec, get_layer_spec)

    for cls, backend in ((EagerSpecProvider, "eager"), (TritonSpecProvider, "triton"),
                         (AscendCSpecProvider, "ascendc")):
        provider = cls()
        assert BackendSpecProvider in type(provider).__mro__
        assert provider.mixer_backend == backend
        assert provider.column_parallel_linear() is ColumnParallelLinear
        assert provider.row_parallel_linear() is RowParallelLinear
    with pytest.raises(ValueError, match="symbols \\['X'\\]"):
        get_hybrid_layer_spec("KKX")
    with pytest.raises(ValueError, match="mixer must be one of"):
        get_layer_spec("rnn")
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="transformer_engine"):
            TritonSpecProvider(linear="te")


def test_arguments_become_config_fields():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from hp_megatron.arguments import add_hp_arguments, apply_hp_config, hp_config_from_args

    parser = argparse.ArgumentParser()
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=64)
    add_hp_arguments(parser)
    args = parser.parse_args(["--hp-layer-pattern", "KKKM", "--hp-backend", "triton", "--hp-cp-method", "p2p",
                              "--hp-linear-num-value-heads", "8", "--hp-kda-lower-bound", "-5",
                              "--hp-mla-kv-lora-rank", "48", "--hp-mla-rope-type", "none"])
    fields = hp_config_from_args(args)
    assert fields["hp_layer_pattern"] == "KKKM" and fields["hp_backend"] == "triton"
    assert fields["delta_cp_method"] == "p2p" and fields["hp_cp_layout"] == "zigzag"
    assert (fields["linear_num_key_heads"], fields["linear_num_value_heads"],
            fields["linear_key_head_dim"]) == (4, 8, 16)
    assert fields["kda_lower_bound"] == -5.0 and fields["kv_lora_rank"] == 48 and fields["rope_type"] == "none"
    config = apply_hp_config(TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4), args)
    assert config.delta_cp_method == "p2p" and config.kv_lora_rank == 48
    assert config.rotary_scaling_factor == 40  # HybridTransformerConfig's MLA field: MLATransformerConfig's default
    with pytest.raises(ValueError, match="multiple of the key heads 4"):
        hp_config_from_args(parser.parse_args(["--hp-linear-num-value-heads", "6"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--hp-backend", "cuda"])


@pytest.mark.parametrize("qk_layernorm", [False, True])
def test_ready_specs_follow_the_qk_layernorm_flag(qk_layernorm):
    """Megatron-LM imports the ready specs as objects, so ``--qk-layernorm`` cannot reach their construction: their
    attention layers read ``config.qk_layernorm`` when built (Qwen3-Next's attention has q/k norms); a spec
    built with an explicit ``qk_layernorm=False`` still refuses the flag."""
    from megatron.core.transformer.identity_op import IdentityOp

    import hp_megatron.specs as specs
    from hp_megatron.config import HybridTransformerConfig
    from hp_megatron.platform import single_rank_megatron

    config = HybridTransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, qk_layernorm=qk_layernorm,
                                     use_cpu_initialization=True, linear_num_key_heads=4, linear_key_head_dim=8,
                                     attention_dropout=0.0)
    with single_rank_megatron(0):
        layer = specs.qwen3_next_spec.module(config, specs.qwen3_next_spec.submodules, layer_number=4,
                                             **specs.qwen3_next_spec.params)
        assert layer.layer_symbol == "A"
        norms = (type(layer.self_attention.q_layernorm), type(layer.self_attention.k_layernorm))
        if qk_layernorm:
            assert norms[0] is not IdentityOp and norms[0] is norms[1]
            assert layer.self_attention.q_layernorm.weight.shape == (config.kv_channels,)
            explicit = specs.get_hybrid_layer_spec("GGGA", qk_layernorm=False)
            with pytest.raises(ValueError, match="config.qk_layernorm=True .* has no q/k norms"):
                explicit.module(config, explicit.submodules, layer_number=4, **explicit.params)
        else:  # no q/k norm: megatron-core 0.16 builds IdentityOp there, 0.17+ none
            assert norms in ((IdentityOp, IdentityOp), (type(None), type(None)))
    with pytest.raises(ValueError, match="qk_layernorm must be True, False or 'config'"):
        specs.get_hybrid_layer_spec("GGGA", qk_layernorm="yes")
