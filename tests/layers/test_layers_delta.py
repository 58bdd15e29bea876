"""Single-rank equivalence of our GDN / KDA mixers with transformers' layers (the independent reference).

Weights come from randomly initialised ``Qwen3NextGatedDeltaNet`` / ``KimiLinearDeltaAttention`` through
``tests.support.hf_layers``; our layer (TP=1, CP=1, eager backend) must match their output and input gradient in fp32,
for batched rows and for packed documents (THD, compared with the reference run per document).
"""
from __future__ import annotations

import pytest
import torch

from tests.support.helpers import use_transformers_torch_path
from tests.support.reference import rel_err

HIDDEN = 32
GDN_DIMS = dict(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=16)
KDA_DIMS = dict(num_key_heads=4, key_head_dim=8)
TOL = 1e-5


def _config(**overrides):
    from megatron.core.transformer import TransformerConfig

    kw = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
              params_dtype=torch.float32, gradient_accumulation_fusion=False, bias_dropout_fusion=False)
    kw.update(overrides)
    return TransformerConfig(**kw)


def _qwen3_next_layer(seed):
    from transformers.models.qwen3_next import modeling_qwen3_next
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

    Qwen3NextGatedDeltaNet = use_transformers_torch_path(modeling_qwen3_next).Qwen3NextGatedDeltaNet

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["linear_attention"],
                          linear_num_key_heads=GDN_DIMS["num_key_heads"],
                          linear_num_value_heads=GDN_DIMS["num_value_heads"],
                          linear_key_head_dim=GDN_DIMS["key_head_dim"],
                          linear_value_head_dim=GDN_DIMS["value_head_dim"], linear_conv_kernel_dim=4,
                          rms_norm_eps=1e-6, hidden_act="silu")
    layer = Qwen3NextGatedDeltaNet(cfg, layer_idx=0).float()
    with torch.no_grad():  # move the constant-initialised parameters off their defaults
        layer.dt_bias.uniform_(-1.0, 1.0)
        layer.norm.weight.uniform_(0.5, 1.5)
    return cfg, layer


def _kimi_linear_layer(seed):
    from transformers.models.kimi_linear import modeling_kimi_linear
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    KimiLinearDeltaAttention = use_transformers_torch_path(modeling_kimi_linear).KimiLinearDeltaAttention

    torch.manual_seed(seed)
    cfg = KimiLinearConfig(hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["linear_attention"],
                           linear_attn_config={"head_dim": KDA_DIMS["key_head_dim"],
                                               "num_heads": KDA_DIMS["num_key_heads"],
                                               "short_conv_kernel_size": 4},
                           rms_norm_eps=1e-5, hidden_act="silu")
    layer = KimiLinearDeltaAttention(cfg, layer_idx=0).float()
    with torch.no_grad():  # the forget gate's parameters are torch.empty until _init_weights
        fg = layer.forget_gate
        fg.A_log.copy_(torch.empty_like(fg.A_log).uniform_(1.0, 16.0).log())
        fg.dt_bias.uniform_(-3.0, 1.0)
        layer.o_norm.weight.uniform_(0.5, 1.5)
    return cfg, layer


def _pair(kind, seed=0):
    """(transformers layer, our layer with the same weights, global parts) for ``kind``."""
    from layers import GatedDeltaNet, KimiDeltaAttention
    from tests.support.hf_layers import (gdn_dims_from_qwen3_next_config, gdn_from_qwen3_next,
                                         kda_dims_from_kimi_linear_config, kda_from_kimi_linear)

    if kind == "gdn":
        hf_cfg, hf = _qwen3_next_layer(seed)
        dims = gdn_dims_from_qwen3_next_config(hf_cfg)
        parts = gdn_from_qwen3_next(hf.state_dict(), **dims)
        ours = GatedDeltaNet(_config(layernorm_epsilon=hf_cfg.rms_norm_eps), None, layer_number=1, **dims)
    else:
        hf_cfg, hf = _kimi_linear_layer(seed)
        dims = kda_dims_from_kimi_linear_config(hf_cfg)
        parts = kda_from_kimi_linear(hf.state_dict(), **dims)
        ours = KimiDeltaAttention(_config(layernorm_epsilon=hf_cfg.rms_norm_eps), None, layer_number=1, **dims)
    ours.load_global_parts(parts)
    return hf, ours, parts, dims


def _run_ours(layer, x_bsh, packed=None):
    x = x_bsh.transpose(0, 1).detach().clone().requires_grad_(True)  # [s, b, h]
    out, bias = layer(x, attention_mask=None, packed_seq_params=packed)
    assert bias is None
    return out.transpose(0, 1), x


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_matches_transformers_bshd(single_rank, kind):
    hf, ours, _, _ = _pair(kind)
    torch.manual_seed(1)
    x = torch.randn(2, 70, HIDDEN)  # 70 tokens: more than one 64-token chunk, not a multiple of it
    grad_out = torch.randn(2, 70, HIDDEN)
    x_ref = x.clone().requires_grad_(True)
    y_ref = hf(x_ref)
    y_ref.backward(grad_out)
    y, x_ours = _run_ours(ours, x)
    y.backward(grad_out)
    assert rel_err(y, y_ref) <= TOL
    assert rel_err(x_ours.grad.transpose(0, 1), x_ref.grad) <= TOL


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_matches_transformers_packed_thd(single_rank, kind):
    from megatron.core.packed_seq_params import PackedSeqParams

    hf, ours, _, _ = _pair(kind, seed=3)
    lengths = [24, 67, 5]
    cu = torch.tensor([0, 24, 91, 96], dtype=torch.int32)
    torch.manual_seed(2)
    x = torch.randn(1, sum(lengths), HIDDEN)
    grad_out = torch.randn(1, sum(lengths), HIDDEN)
    ref_out, ref_grad = [], []
    for start, n in zip(cu[:-1].tolist(), lengths):
        xd = x[:, start:start + n].clone().requires_grad_(True)
        yd = hf(xd)
        yd.backward(grad_out[:, start:start + n])
        ref_out.append(yd.detach())
        ref_grad.append(xd.grad)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=67,
                             max_seqlen_kv=67)
    y, x_ours = _run_ours(ours, x, packed)
    y.backward(grad_out)
    assert rel_err(y, torch.cat(ref_out, dim=1)) <= TOL
    assert rel_err(x_ours.grad.transpose(0, 1), torch.cat(ref_grad, dim=1)) <= TOL


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_conversion_round_trip(single_rank, kind):
    from tests.support.hf_layers import gdn_to_qwen3_next, kda_to_kimi_linear

    hf, ours, parts, dims = _pair(kind, seed=5)
    gathered = ours.global_parts()
    assert sorted(gathered) == sorted(parts)
    for key, value in parts.items():
        assert torch.equal(gathered[key], value), key
    back = (gdn_to_qwen3_next if kind == "gdn" else kda_to_kimi_linear)(gathered, **dims)
    hf_sd = hf.state_dict()
    assert sorted(back) == sorted(hf_sd)
    for key, value in hf_sd.items():
        assert torch.equal(back[key], value), key


def test_causal_mask_accepted_and_other_masks_rejected(single_rank):
    _, ours, _, _ = _pair("gdn")
    x = torch.randn(16, 2, HIDDEN)
    causal = torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1)[None, None]
    y_none, _ = ours(x)
    y_mask, _ = ours(x, attention_mask=causal)
    assert torch.equal(y_none, y_mask)
    padding = causal.clone()
    padding[..., 3] = True
    with pytest.raises(ValueError, match="non-causal attention_mask"):
        ours(x, attention_mask=padding)
    with pytest.raises(ValueError, match="bool mask"):
        ours(x, attention_mask=causal.float())
    with pytest.raises(ValueError, match="inference"):
        ours(x, inference_context=object())


def test_option_errors(single_rank):
    from layers import GatedDeltaNet, KimiDeltaAttention

    with pytest.raises(ValueError, match="num_value_heads=3 must be a multiple of num_key_heads=2"):
        GatedDeltaNet(_config(), None, num_key_heads=2, num_value_heads=3, key_head_dim=8)
    with pytest.raises(ValueError, match="cp_method must be one of"):
        GatedDeltaNet(_config(), None, num_key_heads=2, key_head_dim=8, cp_method="ring")
    with pytest.raises(ValueError, match="cp_layout must be one of"):
        GatedDeltaNet(_config(), None, num_key_heads=2, key_head_dim=8, cp_layout="striped")
    with pytest.raises(ValueError, match="backend must be one of"):
        GatedDeltaNet(_config(), None, num_key_heads=2, key_head_dim=8, backend="cuda")
    with pytest.raises(ValueError, match="safe_gate=True requires lower_bound"):
        KimiDeltaAttention(_config(), None, num_key_heads=2, key_head_dim=8, safe_gate=True)
    with pytest.raises(ValueError, match="cp_comm_type must be one of"):
        GatedDeltaNet(_config(), None, num_key_heads=2, key_head_dim=8, cp_comm_type="ring")


def _reference_layer(kind, parts, x, *, heads, eps, lower_bound=None):
    """fp64 forward of a whole mixer from its global parts, written from the math (per-token recurrence)."""
    import torch.nn.functional as F

    from tests.support.reference import recurrent_delta_rule

    p = {n: t.detach().double() for n, t in parts.items()}
    x = x.double()  # [b, s, h]
    b, s, _ = x.shape
    q, k, v = (x @ p[f"in_proj.weight.{n}"].T for n in ("query", "key", "value"))
    qkv = torch.cat([q, k, v], dim=-1)
    weight = torch.cat([p[f"conv1d.weight.{n}"] for n in ("query", "key", "value")])[:, 0]  # [C, W]
    W = weight.shape[1]
    padded = torch.cat([qkv.new_zeros(b, W - 1, qkv.shape[-1]), qkv], dim=1)
    conv = sum(weight[:, i] * padded[:, i:i + s] for i in range(W))
    if "conv1d.bias.query" in p:
        conv = conv + torch.cat([p[f"conv1d.bias.{n}"] for n in ("query", "key", "value")])
    conv = F.silu(conv)
    H, HV, K, V = heads
    q, k, v = conv.split([H * K, H * K, HV * V], dim=-1)
    q, k, v = q.reshape(b, s, H, K), k.reshape(b, s, H, K), v.reshape(b, s, HV, V)
    beta = x @ p["in_proj.weight.beta"].T
    if kind == "gdn":
        g = x @ p["in_proj.weight.alpha"].T
        gate = (x @ p["in_proj.weight.z"].T).reshape(b, s, HV, V)
        act = F.silu
    else:
        g = ((x @ p["gate_down_proj.weight.forget"].T) @ p["forget_gate_up_proj.weight"].T).reshape(b, s, HV, K)
        gate = (x @ p["gate_down_proj.weight.output"].T) @ p["output_gate_up_proj.weight"].T
        if "output_gate_up_proj.bias" in p:
            gate = gate + p["output_gate_up_proj.bias"]
        gate = gate.reshape(b, s, HV, V)
        act = torch.sigmoid
    o, _ = recurrent_delta_rule(kind, q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True, A_log=p["A_log"],
                                dt_bias=p["dt_bias"], lower_bound=lower_bound)
    o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + eps) * p["out_norm.weight"] * act(gate)
    return o.reshape(b, s, HV * V) @ p["out_proj.weight"].T


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_options_against_fp64_layer_reference(single_rank, kind):
    """Options transformers' layers lack: conv bias (GDN), lower_bound/safe_gate and output-gate bias (KDA)."""
    from layers import GatedDeltaNet, KimiDeltaAttention

    if kind == "gdn":
        layer = GatedDeltaNet(_config(), None, layer_number=2, num_key_heads=2, num_value_heads=4,
                              key_head_dim=8, value_head_dim=4, conv_bias=True)
        lower_bound = None
    else:
        layer = KimiDeltaAttention(_config(), None, layer_number=2, num_key_heads=2, num_value_heads=4,
                                   key_head_dim=8, value_head_dim=4, gate_low_rank_dim=6, lower_bound=-5.0,
                                   safe_gate=True, output_gate_bias=True)
        assert torch.equal(layer.A_log, torch.zeros_like(layer.A_log))  # FLA: A_log zeros with safe_gate
        lower_bound = -5.0
    gen = torch.Generator().manual_seed(7)
    parts = {n: t + 0.3 * torch.randn(t.shape, generator=gen) for n, t in layer.global_parts().items()}
    layer.load_global_parts(parts)
    x = torch.randn(2, 20, HIDDEN, generator=gen)
    y, _ = _run_ours(layer, x)
    expected = _reference_layer(kind, parts, x, heads=(2, 4, 8, 4), eps=layer.norm_eps, lower_bound=lower_bound)
    assert rel_err(y, expected) <= TOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_cuda_layer_matches_transformers(single_rank, kind):
    """GPU path: parameters created on the device (use_cpu_initialization=False), eager backend, fp32, against
    transformers' pure-PyTorch path on the same GPU (the tolerance allows for TF32 where a build enables it)."""
    pytest.importorskip("transformers")
    from layers import GatedDeltaNet, KimiDeltaAttention

    hf, _, parts, dims = _pair(kind)
    cls = GatedDeltaNet if kind == "gdn" else KimiDeltaAttention
    eps = 1e-6 if kind == "gdn" else 1e-5
    ours = cls(_config(use_cpu_initialization=False, layernorm_epsilon=eps), None, layer_number=1, **dims)
    assert all(p.is_cuda for p in ours.parameters())
    ours.load_global_parts({name: t.cuda() for name, t in parts.items()})
    hf = hf.cuda()
    torch.manual_seed(1)
    x = torch.randn(2, 70, HIDDEN, device="cuda")
    grad_out = torch.randn(2, 70, HIDDEN, device="cuda")
    x_ref = x.clone().requires_grad_(True)
    hf(x_ref).backward(grad_out)
    y_ref = hf(x).detach()
    y, x_ours = _run_ours(ours, x)
    y.backward(grad_out)
    assert rel_err(y, y_ref) <= 2e-3
    assert rel_err(x_ours.grad.transpose(0, 1), x_ref.grad) <= 2e-3
