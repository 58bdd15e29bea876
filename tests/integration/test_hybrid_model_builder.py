"""``hp_megatron.model_builders.hybrid_model`` (megatron-core's HybridModel from our stack spec; skipped before 0.19)
against ``hybrid_gpt_model`` (GPTModel) of the same config and weights, one in-process rank.

The weights are copied by ``hp_megatron.hybrid_model.numbering.LayerNumbering`` (GPT layer i = the i-th mixer and the
i-th MLP layer of the hybrid pattern; MTP inner layers split the same way), which must name every parameter of the
HybridModel exactly once and invert. Then the loss (with labels: the main loss and, with MTP, the MTP losses in the
backward) and every gradient are equal. Cases: GDN and KDA layers in one model (``G`` slot per layer from
``config.hp_layer_pattern``) with RoPE attention and q/k norms; the same with dense and MoE MLPs mixed and an MTP
layer of attention + MoE; KDA / GDN / MLA with an MLA MTP layer; post-norm attention layers (and their MLPs) with
q/k norms over the whole projection and SwiGLU limits (OLMo-Hybrid's); per-layer routed / shared-expert SwiGLU limits
on MoE layers (Ling 3.0's), the clipped fc1s counted in both models. Also: the derived patterns (``|`` per pipeline
stage, ``/`` per MTP depth) and the refusals.
"""
import pytest
import torch

try:
    from megatron.core.models.hybrid.hybrid_model import HybridModel
except ImportError:  # megatron-core before 0.19
    HybridModel = None

pytestmark = pytest.mark.skipif(HybridModel is None, reason="megatron-core's HybridModel is 0.19+")

VOCAB, SEQ, BATCH = 64, 16, 2
MOE = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "moe_aux_loss_coeff": 0.0,
       "moe_layer_freq": [0, 1, 1, 0]}
# name -> (GPT pattern, config fields, MTP symbol, the expected hybrid pattern, the G / mixer layers' classes)
CASES = {
    "gdn_kda_attention": ("GKGA", {"qk_layernorm": True}, None, "G-G-G-*-",
                          ["GatedDeltaNet", "KimiDeltaAttention", "GatedDeltaNet", "SelfAttention"]),
    "moe_mtp_attention": ("GKGA", dict(MOE, mtp_num_layers=1), "A", "G-GEGE*-/*E",
                          ["GatedDeltaNet", "KimiDeltaAttention", "GatedDeltaNet", "SelfAttention"]),
    "kda_mla_mtp_mla": ("KGKM", {"mtp_num_layers": 1}, "M", "G-G-G-+-/+-",
                        ["KimiDeltaAttention", "GatedDeltaNet", "KimiDeltaAttention", "MultiLatentAttention"]),
    # OLMo-Hybrid's layer features: post-norm attention layers, q/k norms over the whole projection, SwiGLU limits
    # (small enough to clip); the MLP after a post-norm mixer is post-norm too
    "post_norm_qk_projection_swiglu_limits": (
        "GAGA", {"qk_layernorm": True, "hp_qk_norm_scope": "projection", "hp_post_norm_symbols": "A",
                 "hp_swiglu_limits": [0.0, 0.3, 0.5, 0.0]}, None, "G-*-G-*-",
        ["GatedDeltaNet", "PostNormSelfAttention", "GatedDeltaNet", "PostNormSelfAttention"]),
    # Ling 3.0's: per-layer limits of routed and shared experts on MoE layers
    "moe_swiglu_limits": ("KAKA", dict(MOE, moe_shared_expert_intermediate_size=32,
                                       hp_swiglu_limits=[0.0, 0.3, 0.4, 0.0],
                                       hp_shared_swiglu_limits=[0.0, 0.2, 0.0, 0.0]), None, "G-*EGE*-",
                          ["KimiDeltaAttention", "SelfAttention", "KimiDeltaAttention", "SelfAttention"]),
}


def _config(pattern, **fields):
    from hp_megatron.config import HybridTransformerConfig
    from hp_megatron.platform import CPU_SAFE_CONFIG

    return HybridTransformerConfig(
        num_layers=len(pattern), hp_layer_pattern=pattern, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        kv_channels=8, ffn_hidden_size=64, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, normalization="RMSNorm", layernorm_epsilon=1e-6, attention_dropout=0.0,
        hidden_dropout=0.0, linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8,
        params_dtype=torch.float32, **CPU_SAFE_CONFIG, **fields)


def _loss_and_grads(model, tokens):
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    loss = model(tokens, positions, None, labels=tokens.roll(-1, 1))
    (loss * torch.linspace(0.5, 1.5, SEQ)).sum().backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_model_equals_gpt_model_of_the_same_weights(case):
    from hp_megatron.hybrid_model.numbering import LayerNumbering
    from hp_megatron.model_builders import hybrid_gpt_model, hybrid_model
    from hp_megatron.platform import single_rank_megatron
    from hp_megatron.specs import get_hybrid_layer_spec

    pattern, fields, mtp, expected_pattern, mixers = CASES[case]
    with single_rank_megatron(0):
        config = _config(pattern, **fields)
        gpt = hybrid_gpt_model(config, get_hybrid_layer_spec(pattern, qk_layernorm="config", mtp_symbol=mtp),
                               vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")
        hybrid = hybrid_model(config, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                              mtp_symbol=mtp)
        assert type(hybrid).__mro__[1] is HybridModel and hybrid.hybrid_layer_pattern == expected_pattern
        assert [type(layer.self_attention).__name__ for layer in hybrid.decoder.layers[::2]] == mixers
        assert hybrid.config.num_layers == 2 * len(pattern) and config.num_layers == len(pattern)
        clipped = [sum(type(m).__name__ == "ClippedSwiGLUInput" for m in model.modules()) for model in (gpt, hybrid)]
        assert clipped[0] == clipped[1] and (clipped[0] > 0) == ("hp_swiglu_limits" in fields), clipped
        numbering = LayerNumbering(hybrid.hybrid_layer_pattern)
        hybrid_params, gpt_params = dict(hybrid.named_parameters()), dict(gpt.named_parameters())
        mapped = {numbering.gpt_to_hybrid(name): name for name in gpt_params}
        assert sorted(mapped) == sorted(hybrid_params)
        assert all(numbering.hybrid_to_gpt(h) == g for h, g in mapped.items())
        with torch.no_grad():
            for h, g in mapped.items():
                hybrid_params[h].copy_(gpt_params[g])
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        gpt_loss, gpt_grads = _loss_and_grads(gpt, tokens)
        hybrid_loss, hybrid_grads = _loss_and_grads(hybrid, tokens)
    torch.testing.assert_close(hybrid_loss, gpt_loss, rtol=1e-6, atol=1e-6)
    if mtp:
        assert gpt_grads["mtp.layers.0.eh_proj.weight"].abs().sum() > 0
    for h, g in mapped.items():
        torch.testing.assert_close(hybrid_grads[h], gpt_grads[g], rtol=1e-5, atol=1e-7, msg=h)


def test_derived_patterns():
    from hp_megatron.hybrid_model.numbering import delta_slot_mixers, hybrid_pattern_of

    assert hybrid_pattern_of("GKKM", 4, [0, 1, 1, 1], pipeline_stages=2) == "G-GE|GE+E"
    assert hybrid_pattern_of("KA", 4, [0] * 4, mtp_symbol="A", mtp_depth=2) == "G-*-G-*-/*-/*-"
    assert delta_slot_mixers("G-G-|G-*-", "GKKA") == {1: "G", 3: "K", 5: "K"}
    with pytest.raises(ValueError, match="num_layers=3 does not split evenly over 2 pipeline stages"):
        hybrid_pattern_of("G", 3, [0] * 3, pipeline_stages=2)


def test_refusals():
    from hp_megatron.hybrid_model.numbering import LayerNumbering
    from hp_megatron.model_builders import hybrid_model
    from hp_megatron.platform import single_rank_megatron

    with single_rank_megatron(0):
        with pytest.raises(ValueError, match=r"^--mla-down-proj-fusion \(mla_down_proj_fusion=True\) replaces the MLA "
                                             r"slot's layer with megatron-core's FusedMLASelfAttention"):
            hybrid_model(_config("KM", mla_down_proj_fusion=True), vocab_size=VOCAB, max_sequence_length=SEQ)
        with pytest.raises(ValueError, match=r"MTP part 'G-' may hold \['\*', '\+', '-', 'D', 'E'\] only"):
            hybrid_model(_config("KM", mtp_num_layers=1), vocab_size=VOCAB, max_sequence_length=SEQ,
                         hybrid_layer_pattern="G-+-/G-")
        with pytest.raises(ValueError, match=r"mtp_num_layers=2 \(--mtp-num-layers\) but the hybrid layer pattern "
                                             r"'G-\+-/\+-' has 1 MTP depths"):
            hybrid_model(_config("KM", mtp_num_layers=2), vocab_size=VOCAB, max_sequence_length=SEQ,
                         hybrid_layer_pattern="G-+-/+-")
    with pytest.raises(ValueError, match=r"'GG-' has 2 mixer and 1 MLP layers"):
        LayerNumbering("GG-")
