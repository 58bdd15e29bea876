"""hp_megatron.specs' stack specs in megatron-core's HybridModel (megatron-core 0.19+; skipped on older versions).

The reference is our GPTModel of the same layers (``hybrid_gpt_model`` over ``get_hybrid_layer_spec``): a GPT layer
is RMSNorm -> mixer -> residual, RMSNorm -> MLP -> residual; HybridModel's pattern ``G-*-`` has the same as two
layers each (mixer layer, MLP layer), so with the GPT model's weights copied over, logits and every gradient are
the same. Cases: GDN + RoPE attention with q/k norms (``hybrid_stack_spec``, ``G-*-`` vs ``GA``), KDA + MLA with
the model's RoPE tables on (``kda_hybrid_stack_spec``, ``G-+-`` vs ``KM``: the MLA layer applies its own rotary
embedding and gets none of the model's), GDN + MoE (``GEGE`` vs ``GG`` with experts), GDN + DSA (``G-D-`` vs ``GD``).
One in-process gloo rank.
"""
import re

import pytest
import torch

from megatron.core.transformer.spec_utils import ModuleSpec

try:
    from megatron.core.models.hybrid.hybrid_model import HybridModel
except ImportError:  # megatron-core before 0.19
    HybridModel = None

needs_hybrid_model = pytest.mark.skipif(HybridModel is None, reason="megatron-core's HybridModel "
                                        "(megatron.core.models.hybrid) is 0.19+; the installed one has none")

VOCAB, SEQ, BATCH = 64, 16, 2


def _config(num_layers, **fields):
    from hp_megatron.config import HybridTransformerConfig
    from hp_megatron.platform import CPU_SAFE_CONFIG

    return HybridTransformerConfig(
        num_layers=num_layers, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
        ffn_hidden_size=64, gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        normalization="RMSNorm", layernorm_epsilon=1e-6, attention_dropout=0.0, hidden_dropout=0.0,
        linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8, params_dtype=torch.float32,
        **CPU_SAFE_CONFIG, **fields)


MOE = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "moe_aux_loss_coeff": 0.0}
# name -> (stack spec, HybridModel pattern, GPT pattern, position embedding, config fields)
CASES = {
    "gdn_attention": ("hybrid_stack_spec", "G-*-", "GA", "rope", {"qk_layernorm": True}),
    "kda_mla": ("kda_hybrid_stack_spec", "G-+-", "KM", "rope", {"rope_type": "rope"}),
    "gdn_moe": ("hybrid_stack_spec", "GEGE", "GG", "none", MOE),
    "gdn_dsa": ("hybrid_stack_spec", "G-D-", "GD", "rope",
                {"rope_type": "rope", "q_lora_rank": 16, "dsa_indexer_n_heads": 2, "dsa_indexer_head_dim": 8,
                 "dsa_indexer_topk": 4, "dsa_indexer_loss_coeff": 0.1}),
}


def _hybrid_name(gpt_name: str) -> str:
    """The HybridModel parameter holding a GPT model's: layer i's mixer part -> layer 2i, its MLP part -> 2i + 1."""
    found = re.match(r"decoder\.layers\.(\d+)\.(input_layernorm|self_attention|pre_mlp_layernorm|mlp)(\..*)", gpt_name)
    if found is None:
        return gpt_name.replace("decoder.final_layernorm.", "decoder.final_norm.")
    index, part, rest = int(found.group(1)), found.group(2), found.group(3)
    mlp_part = part in ("pre_mlp_layernorm", "mlp")
    return f"decoder.layers.{2 * index + int(mlp_part)}.{part}{rest}"


def _forward_backward(model, tokens):
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    logits = model(tokens, positions, None)
    (logits.float() * torch.linspace(-1, 1, VOCAB)).sum().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@needs_hybrid_model
@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_model_with_our_stack_spec_equals_our_gpt_model(case):
    import hp_megatron.specs as specs
    from hp_megatron.platform import single_rank_megatron
    from hp_megatron.specs import get_hybrid_layer_spec
    from hp_megatron.model_builders import hybrid_gpt_model

    stack_name, hybrid_pattern, gpt_pattern, positions, fields = CASES[case]
    with single_rank_megatron(0):
        gpt = hybrid_gpt_model(_config(len(gpt_pattern), **fields),
                               get_hybrid_layer_spec(gpt_pattern, qk_layernorm="config"), vocab_size=VOCAB,
                               max_sequence_length=SEQ, position_embedding_type=positions)
        hybrid = HybridModel(_config(len(hybrid_pattern), **fields), getattr(specs, stack_name), vocab_size=VOCAB,
                             max_sequence_length=SEQ, hybrid_layer_pattern=hybrid_pattern,
                             position_embedding_type=positions)
        hybrid_params = dict(hybrid.named_parameters())
        gpt_params = dict(gpt.named_parameters())
        assert sorted(_hybrid_name(n) for n in gpt_params) == sorted(hybrid_params)
        with torch.no_grad():
            for name, param in gpt_params.items():
                hybrid_params[_hybrid_name(name)].copy_(param)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        gpt_logits, gpt_grads = _forward_backward(gpt, tokens)
        hybrid_logits, hybrid_grads = _forward_backward(hybrid, tokens)
    mixers = [type(layer.self_attention).__name__ for layer in hybrid.decoder.layers[::2]]
    assert mixers == [type(layer.self_attention).__name__ for layer in gpt.decoder.layers]
    assert type(hybrid.decoder.final_norm).__name__ == "RMSNorm"
    torch.testing.assert_close(hybrid_logits, gpt_logits, rtol=1e-6, atol=1e-6)
    for name, grad in gpt_grads.items():
        torch.testing.assert_close(hybrid_grads[_hybrid_name(name)], grad, rtol=1e-5, atol=1e-7, msg=name)


@needs_hybrid_model
@pytest.mark.parametrize("symbol,slot", [("M", "mamba_layer")])
def test_a_symbol_without_our_layer_is_refused(symbol, slot):
    import hp_megatron.specs as specs
    from hp_megatron.platform import single_rank_megatron

    with single_rank_megatron(0), pytest.raises(ValueError, match=rf"symbol '{symbol}' needs the stack spec's {slot}"):
        HybridModel(_config(4), specs.hybrid_stack_spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    hybrid_layer_pattern=f"G-{symbol}-")


@needs_hybrid_model
def test_module_level_stack_specs(monkeypatch):
    """Every name of STACK_SPECS is a HybridStack spec of its backend and G mixer, found the way Megatron-LM's
    ``--spec`` finds it (``import_module``: ``vars`` of the module after a ``from`` import)."""
    from megatron.core.transformer.spec_utils import import_module

    import hp_megatron.specs as specs
    from hp_megatron.hybrid_model.stack import HybridStack

    for name, (backend, g_mixer) in specs.STACK_SPECS.items():
        monkeypatch.delitem(vars(specs), name, raising=False)
        spec = import_module(("hp_megatron.specs", name))
        assert isinstance(spec, ModuleSpec) and spec.module is HybridStack, name
        mixer = spec.submodules.gdn_layer.submodules.self_attention
        assert mixer.module.__name__ == {"gdn": "GatedDeltaNet", "kda": "KimiDeltaAttention"}[g_mixer], name
        assert mixer.params["backend"] == backend, name
        assert spec.submodules.mla_layer.params == {"own_positions": True, "symbol": "M"}
        assert spec.submodules.gdn_layer.params["symbol"] == {"gdn": "G", "kda": "K"}[g_mixer], name
    assert sorted(specs.STACK_SPECS) == sorted(
        f"{prefix}hybrid_stack{suffix}_spec" for prefix in ("", "kda_") for suffix in ("", "_triton", "_ascendc"))
    with pytest.raises(AttributeError, match="no attribute 'hybrid_stack_cuda_spec'"):
        _ = specs.hybrid_stack_cuda_spec
    with pytest.raises(ValueError, match=r"g_mixer .* must be one of \('gdn', 'kda'\), got 'mla'"):
        specs.get_hybrid_stack_spec(g_mixer="mla")


def test_without_hybrid_model_stack_specs_name_the_version(monkeypatch):
    """On a megatron-core without HybridModel (before 0.19) ``import hp_megatron.specs`` works and a stack spec is a
    RuntimeError naming the version."""
    import sys

    import hp_megatron.specs as specs

    monkeypatch.setitem(sys.modules, "megatron.core.models.hybrid.hybrid_block", None)
    monkeypatch.delitem(vars(specs), "hybrid_stack_spec", raising=False)
    with pytest.raises(RuntimeError, match=r"HybridModel \(megatron.core.models.hybrid, megatron-core 0.19\+\); the "
                                           r"installed megatron-core \S+ has none"):
        _ = specs.hybrid_stack_spec
