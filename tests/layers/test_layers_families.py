"""The layer features of the 2026 families against transformers' own modules (single rank, fp32, eager), forward
and input / parameter gradients:

* GDN ``allow_neg_eigval`` (beta = 2 sigmoid(b)) with key head dim != value head dim: ``OlmoHybridGatedDeltaNet``
  (separate ``q/k/v/a/b/g_proj``), batched rows over more than one 64-token chunk;
* KDA ``full_rank_gates`` with the safe gate: ``BailingHybridDeltaAttention`` (Ling 3.0: ``forget_gate.f_proj``,
  ``g_proj`` at full rank);
* per-layer SwiGLU clipping: megatron-core's MLP with :class:`ClippedSwiGLUInput` against ``BailingHybridMLP``
  (shared experts) and ``BailingHybridExperts`` (routed), inputs large enough that most units clip; the layer
  spec of a MoE layer carries each layer's limits;
* the refusals of post-norm layers and whole-projection q/k norms (their numbers: the OLMo-Hybrid model tests in
  tests/models, against transformers at TP1 and TP2 x CP2).

Their CP / TP runs are cases of the shared spawn of tests/layers/test_layers_delta_parallel.py.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.support.helpers import use_transformers_torch_path
from tests.support.reference import rel_err

HIDDEN = 32
TOL = 1e-5
OLMO_GDN = dict(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=16)


def _config(**overrides):
    from megatron.core.transformer import TransformerConfig

    kw = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
              params_dtype=torch.float32, gradient_accumulation_fusion=False, bias_dropout_fusion=False)
    return TransformerConfig(**{**kw, **overrides})


def _olmo_hybrid_gdn(seed, allow_neg_eigval):
    from transformers import OlmoHybridConfig
    from transformers.models.olmo_hybrid import modeling_olmo_hybrid

    cls = use_transformers_torch_path(modeling_olmo_hybrid).OlmoHybridGatedDeltaNet
    torch.manual_seed(seed)
    cfg = OlmoHybridConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                           layer_types=["linear_attention", "full_attention"],
                           linear_num_key_heads=OLMO_GDN["num_key_heads"],
                           linear_num_value_heads=OLMO_GDN["num_value_heads"],
                           linear_key_head_dim=OLMO_GDN["key_head_dim"],
                           linear_value_head_dim=OLMO_GDN["value_head_dim"],
                           linear_allow_neg_eigval=allow_neg_eigval, linear_a_log_min=0.5, linear_a_log_max=4.0)
    layer = cls(cfg, layer_idx=0).float()
    with torch.no_grad():
        layer.o_norm.weight.uniform_(0.5, 1.5)
        layer.b_proj.weight.mul_(4.0)   # beta spread over (0, 2): some transitions with negative eigenvalues
    return layer


def olmo_hybrid_gdn_parts(state: dict, prefix: str = "") -> dict:
    """``OlmoHybridGatedDeltaNet``'s tensors (in memory: one ``conv1d`` of the q | k | v channels) -> our GDN's
    global parts."""
    names = {"in_proj.weight.query": "q_proj.weight", "in_proj.weight.key": "k_proj.weight",
             "in_proj.weight.value": "v_proj.weight", "in_proj.weight.z": "g_proj.weight",
             "in_proj.weight.beta": "b_proj.weight", "in_proj.weight.alpha": "a_proj.weight",
             "A_log": "A_log", "dt_bias": "dt_bias", "out_norm.weight": "o_norm.weight",
             "out_proj.weight": "o_proj.weight"}
    parts = {ours: state[prefix + theirs] for ours, theirs in names.items()}
    conv = state[prefix + "conv1d.weight"]
    key = OLMO_GDN["num_key_heads"] * OLMO_GDN["key_head_dim"]
    parts.update(zip(("conv1d.weight.query", "conv1d.weight.key", "conv1d.weight.value"),
                     conv.split([key, key, conv.shape[0] - 2 * key], 0)))
    return parts


@pytest.mark.parametrize("allow_neg_eigval", [True, False])
def test_gdn_allow_neg_eigval_matches_olmo_hybrid(single_rank, allow_neg_eigval):
    from layers import GatedDeltaNet

    hf = _olmo_hybrid_gdn(0, allow_neg_eigval)
    ours = GatedDeltaNet(_config(), None, layer_number=1, norm_eps=1e-5, allow_neg_eigval=allow_neg_eigval,
                         **OLMO_GDN)
    ours.load_global_parts(olmo_hybrid_gdn_parts(hf.state_dict()))
    torch.manual_seed(1)
    x = torch.randn(2, 70, HIDDEN)
    grad_out = torch.randn(2, 70, HIDDEN)
    x_ref = x.clone().requires_grad_(True)
    hf(x_ref).backward(grad_out)
    x_ours = x.transpose(0, 1).clone().requires_grad_(True)
    y, _ = ours(x_ours, attention_mask=None)
    y.backward(grad_out.transpose(0, 1))
    with torch.no_grad():
        y_ref = hf(x)
    assert rel_err(y.transpose(0, 1), y_ref) <= TOL
    assert rel_err(x_ours.grad.transpose(0, 1), x_ref.grad) <= TOL
    grads = ours.global_parts({n: p.grad for n, p in ours.named_parameters()})
    assert rel_err(grads["in_proj.weight.beta"], hf.b_proj.weight.grad) <= TOL
    assert rel_err(grads["A_log"], hf.A_log.grad) <= 1e-4


def test_gdn_allow_neg_eigval_is_a_bool(single_rank):
    from layers import GatedDeltaNet

    with pytest.raises(TypeError, match="allow_neg_eigval must be a bool"):
        GatedDeltaNet(_config(), None, layer_number=1, allow_neg_eigval=1, **OLMO_GDN)


LING_KDA = dict(num_key_heads=4, num_value_heads=4, key_head_dim=8, value_head_dim=8)


def _bailing_kda(seed):
    from transformers import BailingHybridConfig
    from transformers.models.bailing_hybrid import modeling_bailing_hybrid

    cls = use_transformers_torch_path(modeling_bailing_hybrid).BailingHybridDeltaAttention
    torch.manual_seed(seed)
    cfg = BailingHybridConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=LING_KDA["num_key_heads"],
                              head_dim=LING_KDA["key_head_dim"], layer_group_size=2, kda_safe_gate=True,
                              kda_lower_bound=-5.0, rms_norm_eps=1e-6, pad_token_id=None, eos_token_id=None)
    layer = cls(cfg, layer_idx=0).float()
    with torch.no_grad():   # the forget gate's parameters are torch.empty until _init_weights
        fg = layer.forget_gate
        fg.A_log.copy_(torch.empty_like(fg.A_log).uniform_(0.5, 2.0).log())
        fg.dt_bias.uniform_(-2.0, 1.0)
        layer.o_norm.weight.uniform_(0.5, 1.5)
    return layer


def bailing_kda_parts(state: dict, prefix: str = "") -> dict:
    """``BailingHybridDeltaAttention``'s tensors (in memory: one ``conv1d``) -> our KDA's global parts
    (``full_rank_gates``)."""
    names = {"in_proj.weight.query": "q_proj.weight", "in_proj.weight.key": "k_proj.weight",
             "in_proj.weight.value": "v_proj.weight", "in_proj.weight.beta": "b_proj.weight",
             "in_proj.weight.forget": "forget_gate.f_proj.weight", "in_proj.weight.output": "g_proj.weight",
             "A_log": "forget_gate.A_log", "dt_bias": "forget_gate.dt_bias", "out_norm.weight": "o_norm.weight",
             "out_proj.weight": "o_proj.weight"}
    parts = {ours: state[prefix + theirs] for ours, theirs in names.items()}
    parts.update(zip(("conv1d.weight.query", "conv1d.weight.key", "conv1d.weight.value"),
                     state[prefix + "conv1d.weight"].chunk(3, 0)))
    return parts


def test_kda_full_rank_gates_match_ling(single_rank):
    from layers import KimiDeltaAttention

    hf = _bailing_kda(0)
    ours = KimiDeltaAttention(_config(), None, layer_number=1, full_rank_gates=True, safe_gate=True, lower_bound=-5.0,
                              norm_eps=1e-6, **LING_KDA)
    assert not hasattr(ours, "gate_down_proj")
    ours.load_global_parts(bailing_kda_parts(hf.state_dict()))
    torch.manual_seed(1)
    x = torch.randn(2, 70, HIDDEN)
    grad_out = torch.randn(2, 70, HIDDEN)
    x_ref = x.clone().requires_grad_(True)
    y_ref = hf(x_ref)
    y_ref.backward(grad_out)
    x_ours = x.transpose(0, 1).clone().requires_grad_(True)
    y, _ = ours(x_ours, attention_mask=None)
    y.backward(grad_out.transpose(0, 1))
    assert rel_err(y.transpose(0, 1), y_ref) <= TOL
    assert rel_err(x_ours.grad.transpose(0, 1), x_ref.grad) <= TOL
    grads = ours.global_parts({n: p.grad for n, p in ours.named_parameters()})
    assert rel_err(grads["in_proj.weight.forget"], hf.forget_gate.f_proj.weight.grad) <= TOL
    assert rel_err(grads["in_proj.weight.output"], hf.g_proj.weight.grad) <= TOL
    assert rel_err(grads["dt_bias"], hf.forget_gate.dt_bias.grad) <= 1e-4
    with pytest.raises(ValueError, match="full_rank_gates=True has no low-rank gate projections"):
        KimiDeltaAttention(_config(), None, layer_number=1, full_rank_gates=True, gate_low_rank_dim=4, **LING_KDA)


def _megatron_mlp(config, limit, ffn):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from hp_megatron.decoder.swiglu_limits import ClippedSwiGLUInput

    fc1 = ModuleSpec(module=ClippedSwiGLUInput, params={"limit": limit}) if limit else ColumnParallelLinear
    return MLP(config, MLPSubmodules(linear_fc1=fc1, linear_fc2=RowParallelLinear), ffn_hidden_size=ffn)


@pytest.mark.parametrize("limit", [0.75, 0])
def test_swiglu_limits_match_ling(single_rank, limit):
    from transformers import BailingHybridConfig
    from transformers.models.bailing_hybrid.modeling_bailing_hybrid import BailingHybridExperts, BailingHybridMLP

    from hp_megatron.decoder.swiglu_limits import silu_inverse

    assert abs(torch.nn.functional.silu(torch.tensor(silu_inverse(7.0), dtype=torch.float64)).item() - 7.0) < 1e-12
    cfg = BailingHybridConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, head_dim=8,
                              moe_intermediate_size=16, num_local_experts=2, layer_group_size=2, pad_token_id=None,
                              eos_token_id=None, expert_swiglu_limit_list=[0, limit],
                              share_expert_swiglu_limit_list=[0, limit])
    torch.manual_seed(0)
    shared = BailingHybridMLP(cfg, intermediate_size=16, layer_idx=1).float()
    experts = BailingHybridExperts(cfg, layer_idx=1).float()
    torch.nn.init.normal_(experts.gate_up_proj, std=0.3)
    torch.nn.init.normal_(experts.down_proj, std=0.3)
    config = _config(gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
                     ffn_hidden_size=16)
    x = 3.0 * torch.randn(40, HIDDEN)
    for name, ref_fn, (w_gate_up, w_down) in (
            ("shared", lambda t: shared(t),
             (torch.cat([shared.gate_proj.weight, shared.up_proj.weight]), shared.down_proj.weight)),
            ("expert", lambda t: experts(t, torch.zeros(len(t), 1, dtype=torch.long), torch.ones(len(t), 1)),
             (experts.gate_up_proj[0], experts.down_proj[0]))):
        ours = _megatron_mlp(config, limit, 16)
        with torch.no_grad():
            ours.linear_fc1.weight.copy_(w_gate_up)
            ours.linear_fc2.weight.copy_(w_down)
        x_ref, x_ours = x.clone().requires_grad_(True), x[:, None].clone().requires_grad_(True)
        ref = ref_fn(x_ref)
        out, _ = ours(x_ours)
        grad = torch.randn_like(ref)
        (ref * grad).sum().backward()
        (out[:, 0] * grad).sum().backward()
        assert rel_err(out[:, 0], ref) <= TOL, name
        assert rel_err(x_ours.grad[:, 0], x_ref.grad) <= TOL, name
    gate, up = (x @ w_gate_up.T).chunk(2, -1)
    if limit:   # the case clips: most units, and both halves
        assert (torch.nn.functional.silu(gate) > limit).float().mean() > 0.2 and (up.abs() > limit).any()


def test_swiglu_limits_in_the_layer_spec(single_rank):
    from hp_megatron.config import HybridTransformerConfig
    from hp_megatron.decoder.moe_layers import with_moe_mlp
    from hp_megatron.decoder.swiglu_limits import ClippedSwiGLUInput, with_swiglu_limits
    from hp_megatron.specs import get_hybrid_layer_spec

    spec = get_hybrid_layer_spec("A")
    config = HybridTransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, num_moe_experts=2,
                                     use_cpu_initialization=True, hp_swiglu_limits=(0, 7.0),
                                     hp_shared_swiglu_limits=(0, 5.0))
    moe = with_moe_mlp(config, spec.submodules.layer_types["A"], spec.submodules.moe_mlp)
    assert with_swiglu_limits(config, moe, 1) is moe
    limited = with_swiglu_limits(config, moe, 2)
    sub = getattr(limited.mlp, "submodules", None) or limited.mlp.keywords["submodules"]
    experts = getattr(sub.experts, "submodules", None) or sub.experts.keywords["submodules"]
    shared = sub.shared_experts.keywords["submodules"] if hasattr(sub.shared_experts, "keywords") else \
        sub.shared_experts.submodules
    assert (experts.linear_fc1.module, experts.linear_fc1.params) == (ClippedSwiGLUInput, {"limit": 7.0})
    assert (shared.linear_fc1.module, shared.linear_fc1.params) == (ClippedSwiGLUInput, {"limit": 5.0})
    with pytest.raises(ValueError, match=r"hp_swiglu_limits must hold one number >= 0 per layer"):
        with_swiglu_limits(HybridTransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4,
                                                   hp_swiglu_limits=(1.0,)), moe, 1)


def test_post_norm_and_projection_norm_refusals(single_rank):
    """Post-norm layers take dense MLPs and registered symbols; whole-projection key norms need the key heads split
    over TP (not replicated)."""
    from megatron.core.transformer import TransformerConfig

    from hp_megatron.config import HybridTransformerConfig
    from hp_megatron.decoder.post_norm import with_post_norm
    from hp_megatron.decoder.qk_norm import KeyProjectionRMSNorm
    from hp_megatron.specs import get_hybrid_layer_spec

    base = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True)
    with pytest.raises(ValueError, match=r"hp_post_norm_symbols 'AZ': unknown symbols \['Z'\]"):
        HybridTransformerConfig(**base, hp_post_norm_symbols="AZ")
    with pytest.raises(ValueError, match=r"hp_qk_norm_scope must be one of"):
        HybridTransformerConfig(**base, hp_qk_norm_scope="channel")
    spec = get_hybrid_layer_spec("A")
    config = HybridTransformerConfig(**base, hp_post_norm_symbols="A")
    layer = spec.submodules.layer_types["A"]
    with pytest.raises(ValueError, match="has a MoE MLP; post-norm layers have dense MLPs only"):
        with_post_norm(config, "A", replace(layer, mlp=spec.submodules.moe_mlp))
    assert with_post_norm(config, "G", layer) is layer
    with pytest.raises(ValueError, match=r"the key heads \(1\) must be divisible by the tensor-parallel size 2"):
        KeyProjectionRMSNorm(config=TransformerConfig(**base, num_query_groups=1, tensor_model_parallel_size=2),
                             hidden_size=8, eps=1e-6)
