"""MultiLatentAttention on one rank: equals transformers' DeepSeek-V3 and Kimi-Linear MLA attention (output,
input and weight gradients) with copied weights; core attention against a plain softmax reference; packed
THD documents; checkpoint names and conversions; the Ascend adapter's call contract; input errors."""
from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch

from tests.support.mla_layer import build_layer, make_config
from tests.support.reference import rel_err

warnings.filterwarnings("ignore", category=UserWarning)


def plain_attention(q, k, v, scale, doc_of=None):
    """Reference causal softmax attention, q/k [B, T, H, D] fp64, optional doc id per token [T]."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    T = q.shape[1]
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    if doc_of is not None:
        allowed &= doc_of[:, None] == doc_of[None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.double())


def _hf_deepseek(q_lora_rank, rope_interleave, rope):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    params = {"rope_type": "default", "rope_theta": 10000.0}
    if rope == "yarn":
        params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                  "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    cfg = DeepseekV3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
                           kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                           rope_interleave=rope_interleave, max_position_embeddings=64, rope_parameters=params)
    cfg._attn_implementation = "eager"
    return DeepseekV3Attention(cfg, 0).float(), DeepseekV3RotaryEmbedding(cfg)


def _causal_mask(T):
    return torch.full((T, T), float("-inf")).triu(1)[None, None]


def _run_ours(layer, x_bsh, packed=None):
    x = x_bsh.detach().transpose(0, 1).contiguous().requires_grad_(True)
    out, bias = layer(x, packed_seq_params=packed)
    assert bias is None
    return out.transpose(0, 1), x


def _assert_output_and_input_grad_match(layer, x, ref):
    """Our layer on ``x`` [B, T, h] (a leaf) matches the reference output ``ref`` and, under one random
    cotangent backpropagated through both (weight grads are left for the caller), x's gradient: rel. L2 <= 1e-5."""
    out, x_ours = _run_ours(layer, x)
    assert rel_err(out, ref) <= 1e-5
    grad = torch.randn_like(ref)
    (ref * grad).sum().backward()
    (out * grad).sum().backward()
    assert rel_err(x_ours.grad.transpose(0, 1), x.grad) <= 1e-5


HF_GRADS = {"kv_b_proj.weight": "linear_kv_up_proj.weight", "kv_a_proj_with_mqa.weight": "linear_kv_down_proj.weight",
            "o_proj.weight": "linear_proj.weight", "kv_a_layernorm.weight": "kv_layernorm.weight"}


@pytest.mark.parametrize("q_lora_rank,rope_interleave,rope", [(16, True, "yarn"), (None, False, "rope"),
                                                             (16, False, "yarn")])
def test_matches_transformers_deepseek_v3(single_rank, q_lora_rank, rope_interleave, rope):
    from layers.mixers.mla.layer import mla_state_dict_from_hf

    torch.manual_seed(1)
    hf, rotary = _hf_deepseek(q_lora_rank, rope_interleave, rope)
    config = make_config(q_lora_rank=q_lora_rank, rope_type=rope)
    layer = build_layer(config, single_rank, single_rank)
    layer.load_state_dict(mla_state_dict_from_hf(hf.state_dict(), config, rope_interleave=rope_interleave))
    B, T = 2, 12
    x = torch.randn(B, T, 32, requires_grad=True)
    cos, sin = rotary(x, torch.arange(T)[None].expand(B, T))
    ref, _ = hf(x, (cos, sin), _causal_mask(T))
    _assert_output_and_input_grad_match(layer, x, ref)
    params = dict(layer.named_parameters())
    for hf_name, ours in HF_GRADS.items():
        hf_grad = dict(hf.named_parameters())[hf_name].grad
        if hf_name == "kv_a_proj_with_mqa.weight" and not rope_interleave:
            continue  # rows permuted by the conversion; covered by the input gradient
        assert rel_err(params[ours].grad, hf_grad) <= 1e-5, hf_name


def test_matches_transformers_kimi_linear(single_rank):
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

    from layers.mixers.mla.layer import mla_state_dict_from_hf

    torch.manual_seed(2)
    cfg = KimiLinearConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                           kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rms_norm_eps=1e-6)
    cfg._attn_implementation = "eager"
    hf = KimiLinearAttention(cfg, 0).float()
    config = make_config(q_lora_rank=None, rope_type="none")
    layer = build_layer(config, single_rank, single_rank)
    assert abs(layer.softmax_scale - (8 + 4) ** -0.5) < 1e-12       # NoPE, no YaRN: plain 1/sqrt(d)
    layer.load_state_dict(mla_state_dict_from_hf(hf.state_dict(), config))
    B, T = 2, 10
    x = torch.randn(B, T, 32, requires_grad=True)
    ref, _ = hf(x, _causal_mask(T))
    _assert_output_and_input_grad_match(layer, x, ref)
    assert rel_err(layer.linear_kv_up_proj.weight.grad, hf.kv_b_proj.weight.grad) <= 1e-5


def test_output_gate_matches_transformers_bailing_hybrid(single_rank):
    """Ling 3.0's MLA: DeepSeek-V3's with a head-wise sigmoid output gate (``g_proj``), interleaved RoPE, no q LoRA."""
    from transformers import BailingHybridConfig
    from transformers.models.bailing_hybrid.modeling_bailing_hybrid import (BailingHybridAttention,
                                                                            BailingHybridRotaryEmbedding)

    from layers.mixers.mla.layer import mla_state_dict_from_hf, mla_state_dict_to_hf

    torch.manual_seed(3)
    cfg = BailingHybridConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                              kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rms_norm_eps=1e-6,
                              num_hidden_layers=2, layer_group_size=2, rope_theta=10000.0, pad_token_id=None,
                              eos_token_id=None)
    cfg._attn_implementation = "eager"
    hf, rotary = BailingHybridAttention(cfg, 1).float(), BailingHybridRotaryEmbedding(cfg)
    config = make_config(q_lora_rank=None, rope_type="rope", rotary_scaling_factor=1.0)
    layer = build_layer(config, single_rank, single_rank, output_gate=True)
    layer.load_state_dict(mla_state_dict_from_hf(hf.state_dict(), config))
    B, T = 2, 12
    x = torch.randn(B, T, 32, requires_grad=True)
    cos, sin = rotary(x, torch.arange(T)[None].expand(B, T))
    ref, _ = hf(x, (cos, sin), _causal_mask(T))
    _assert_output_and_input_grad_match(layer, x, ref)
    assert rel_err(layer.linear_gate_proj.weight.grad, hf.g_proj.weight.grad) <= 1e-5
    back = mla_state_dict_to_hf(layer.state_dict(), config)
    assert sorted(back) == sorted(hf.state_dict()) and all(torch.equal(back[k], v) for k, v in hf.state_dict().items())
    assert build_layer(config, single_rank, single_rank).linear_gate_proj is None
    with pytest.raises(TypeError, match="output_gate must be a bool"):
        build_layer(config, single_rank, single_rank, output_gate="yes")


def test_packed_documents_restart_positions(single_rank):
    """THD: each document equals transformers run on that document alone (positions from 0)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from layers.mixers.mla.layer import mla_state_dict_from_hf

    torch.manual_seed(3)
    hf, rotary = _hf_deepseek(16, True, "yarn")
    config = make_config()
    layer = build_layer(config, single_rank, single_rank)
    layer.load_state_dict(mla_state_dict_from_hf(hf.state_dict(), config))
    lengths = [5, 9, 2]
    cu = torch.tensor([0, 5, 14, 16], dtype=torch.int32)
    x = torch.randn(1, sum(lengths), 32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9)
    out, _ = _run_ours(layer, x, packed)
    refs = []
    for doc in torch.split(x, lengths, dim=1):
        n = doc.shape[1]
        cos, sin = rotary(doc, torch.arange(n)[None])
        refs.append(hf(doc, (cos, sin), _causal_mask(n))[0])
    assert rel_err(out, torch.cat(refs, dim=1)) <= 1e-5


@pytest.mark.parametrize("block_size", [3, 1024])
def test_core_attention_against_plain_softmax(block_size):
    from layers.mixers.attention.eager import eager_causal_attention

    torch.manual_seed(4)
    T, H = 16, 2
    q, k = torch.randn(1, T, H, 5, requires_grad=True), torch.randn(1, T, H, 5, requires_grad=True)
    v = torch.randn(1, T, H, 3, requires_grad=True)
    cu = torch.tensor([0, 4, 12, 16])
    doc_of = torch.repeat_interleave(torch.arange(3), torch.tensor([4, 8, 4]))
    ids = torch.tensor([0, 1, 14, 15, 6, 7, 8, 9])                 # a zigzag shard, out of order
    out = eager_causal_attention(q[:, ids], k, v, scale=0.4, q_ids=ids, cu_seqlens=cu, block_size=block_size)
    ref = plain_attention(q, k, v, 0.4, doc_of)[:, ids]
    assert rel_err(out, ref) <= 1e-6
    full = eager_causal_attention(q, k, v, scale=0.4, cu_seqlens=cu, block_size=block_size)
    assert rel_err(full, plain_attention(q, k, v, 0.4, doc_of)) <= 1e-6
    causal = eager_causal_attention(q, k, v, scale=0.4)
    assert rel_err(causal, plain_attention(q, k, v, 0.4)) <= 1e-6


def test_block_masks_stay_small():
    from layers.mixers.attention.masking import query_blocks

    T = 4096
    cu = torch.tensor([0, 1024, 2048, 4096])
    blocks = query_blocks(torch.arange(T), cu, T, block_size=512)
    # a mask never exceeds block x longest document (2048), far below T^2
    assert max(0 if b.mask is None else b.mask.numel() for b in blocks) <= 512 * 2048
    assert sum(b.mask is None for b in blocks) == 3                # first block of every document is a square


def test_npu_adapter_call_contract(monkeypatch):
    """The Ascend path calls torch_npu.npu_fusion_attention with its documented parameters."""
    from layers.mixers.attention import causal_attention

    calls = []

    def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                             atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=2147483647,
                             next_tockens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None,
                             actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False):
        calls.append((input_layout, sparse_mode, actual_seq_qlen))
        if input_layout == "TND":
            ends = [0] + list(actual_seq_qlen)
            doc_of = torch.repeat_interleave(torch.arange(len(ends) - 1), torch.tensor(ends).diff())
            out = plain_attention(query[None], key[None], value[None], scale, doc_of)[0]
        elif sparse_mode == 2:
            assert atten_mask.shape == (2048, 2048) and bool(atten_mask[0, 1]) and not bool(atten_mask[1, 0])
            out = plain_attention(query, key, value, scale)
        else:
            assert sparse_mode == 0 and atten_mask.dtype == torch.bool
            s = torch.einsum("bqhd,bkhd->bhqk", query.double(), key.double()) * scale
            out = torch.einsum("bhqk,bkhd->bqhd", s.masked_fill(atten_mask, float("-inf")).softmax(-1),
                               value.double())
        return (out.to(query.dtype), None, None, None, 0, 0, 0)

    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu_fusion_attention=npu_fusion_attention))
    torch.manual_seed(5)
    q, k, v = torch.randn(1, 8, 2, 4), torch.randn(1, 8, 2, 4), torch.randn(1, 8, 2, 3)
    cu = torch.tensor([0, 3, 8])
    doc_of = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
    assert rel_err(causal_attention(q, k, v, scale=0.5, backend="npu"), plain_attention(q, k, v, 0.5)) <= 1e-6
    assert rel_err(causal_attention(q, k, v, scale=0.5, cu_seqlens=cu, backend="npu"),
                   plain_attention(q, k, v, 0.5, doc_of)) <= 1e-6
    ids = torch.tensor([0, 7, 4])
    assert rel_err(causal_attention(q[:, ids], k, v, scale=0.5, q_ids=ids, cu_seqlens=cu, backend="npu"),
                   plain_attention(q, k, v, 0.5, doc_of)[:, ids]) <= 1e-6
    assert [c[0] for c in calls] == ["BSND", "TND", "BSND"] and calls[1][2] == [3, 8]


def test_npu_backend_missing_names_package(monkeypatch):
    from layers.mixers.attention import causal_attention

    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(RuntimeError, match="torch_npu"):
        causal_attention(torch.randn(1, 4, 1, 2), torch.randn(1, 4, 1, 2), torch.randn(1, 4, 1, 2), scale=1.0,
                         backend="npu")


def test_checkpoint_names_and_conversion_roundtrip(single_rank):
    from layers.mixers.mla.layer import mla_state_dict_from_hf, mla_state_dict_to_hf

    torch.manual_seed(6)
    hf, _ = _hf_deepseek(16, False, "yarn")
    config = make_config()
    layer = build_layer(config, single_rank, single_rank)
    ours = mla_state_dict_from_hf(hf.state_dict(), config, rope_interleave=False)
    back = mla_state_dict_to_hf(ours, config, rope_interleave=False)
    assert set(back) == set(hf.state_dict())
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())
    sharded = layer.sharded_state_dict(prefix="decoder.layers.0.self_attention.",
                                     metadata={"dp_cp_group": single_rank})
    assert sharded["decoder.layers.0.self_attention.kv_layernorm.weight"].key == \
        "decoder.layers.0.self_attention.linear_kv_up_proj.layer_norm_weight"
    assert sharded["decoder.layers.0.self_attention.q_layernorm.weight"].key == \
        "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight"
    assert sharded["decoder.layers.0.self_attention.linear_q_up_proj.weight"].global_shape == (48, 16)
    te_named = {TE: v for TE, v in ((k.replace("q_layernorm.weight", "linear_q_up_proj.layer_norm_weight")
                                     .replace("kv_layernorm.weight", "linear_kv_up_proj.layer_norm_weight"), v)
                                    for k, v in ours.items())}
    layer.load_state_dict(te_named)                                   # TE names load into our norms
    assert torch.equal(layer.q_layernorm.weight, ours["q_layernorm.weight"])


def test_dist_checkpoint_roundtrip(single_rank, tmp_path):
    from megatron.core import dist_checkpointing

    torch.manual_seed(7)
    config = make_config()
    saved = build_layer(config, single_rank, single_rank)
    with torch.no_grad():
        for p in saved.parameters():
            p.normal_()
    metadata = {"dp_cp_group": single_rank}
    dist_checkpointing.save(saved.sharded_state_dict(prefix="attn.", metadata=metadata), str(tmp_path))
    loaded = build_layer(config, single_rank, single_rank)
    state = dist_checkpointing.load(loaded.sharded_state_dict(prefix="attn.", metadata=metadata), str(tmp_path))
    loaded.load_state_dict({k[len("attn."):]: v for k, v in state.items()})
    for (name, a), (_, b) in zip(saved.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), name


def test_input_errors(single_rank):
    from megatron.core.transformer.enums import AttnMaskType

    config = make_config()
    with pytest.raises(ValueError, match="causal"):
        build_layer(config, single_rank, single_rank, attn_mask_type=AttnMaskType.padding)
    with pytest.raises(ValueError, match="strategy"):
        build_layer(config, single_rank, single_rank, cp_strategy="ring")
    layer = build_layer(config, single_rank, single_rank)
    x = torch.randn(4, 1, 32)
    with pytest.raises(ValueError, match="inference"):
        layer(x, inference_context=object())
    with pytest.raises(ValueError, match="rotary"):
        layer(x, rotary_pos_emb=torch.zeros(4, 1, 1, 4))
    causal = torch.ones(4, 4, dtype=torch.bool).triu(1)[None, None]
    out_masked, _ = layer(x, attention_mask=causal)           # megatron's plain causal mask is accepted
    assert torch.equal(out_masked, layer(x)[0])
    padding = causal.clone()
    padding[..., 0] = True                                     # a padding mask the causal layer cannot honour
    with pytest.raises(ValueError, match="non-causal attention_mask"):
        layer(x, attention_mask=padding)
    from megatron.core.packed_seq_params import PackedSeqParams

    bad = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(x, packed_seq_params=bad)
    assert build_layer(config, single_rank, single_rank, cp_comm_type="a2a").cp_strategy == "expanded_ulysses"
    assert build_layer(config, single_rank, single_rank, cp_comm_type="p2p").cp_strategy == "latent"
