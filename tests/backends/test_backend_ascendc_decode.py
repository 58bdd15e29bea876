"""backend="ascendc" decode: fla-npu's recurrent kernels (``recurrent_gated_delta_rule``, ``recurrent_kda``)
through the CPU stand-in, against the eager decode step, and the GDN / KDA layers generating through them.

Steps: N = 3 sequences, K = V = 128, four tokens in a row from a random fp32 state, every flag combination the
layers use (in-kernel L2 norm, beta sigmoid, gate with and without dt_bias; KDA's sigmoid gate form inside the
kernel and, for a bound outside [-5, 0), in PyTorch), GVA; outputs and the updated state after every token
<= 1e-5 relative against the eager step (fp32 stand-in), and 2e-2 in fla-npu's bf16 contract. The layers:
prefill through the chunked ops, then one token per step, equal to the training forward at every position.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from layers.ops import delta_rule_step
from layers.ops.ascendc import runtime
from tests.support.ascendc_standin import KNOBS, STANDIN, forget_fla_npu, install_standin
from tests.support.generation import generate
from tests.support.reference import rel_err

pytestmark = pytest.mark.skipif(os.environ.get("HP_ASCEND_REAL") == "1", reason="targets the stand-in")
N, K, V, STEPS, TOL, BF16_TOL = 3, 128, 128, 4, 1e-5, 2e-2


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.setattr(runtime, "DEVICE", runtime.DEVICE)
    monkeypatch.setattr(runtime, "KERNEL_DTYPES", runtime.KERNEL_DTYPES)
    yield install_standin()
    if STANDIN in sys.path:
        sys.path.remove(STANDIN)
    forget_fla_npu()
    for name in KNOBS:
        os.environ.pop(name, None)


def _steps(kind, H, HV, flags, seed, dtype=torch.float32):
    """STEPS tokens of inputs (in ``dtype``), the initial state, and the flags' gate parameters."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)
    params = {}
    if flags.get("use_gate_in_kernel"):
        params["A_log"] = rand(HV).mul(0.3)
        if flags.pop("dt_bias", True):
            params["dt_bias"] = rand(HV * K if kind == "kda" else HV).mul(0.3)
    tokens = []
    for _ in range(STEPS):
        g = rand(N, 1, HV, K) if kind == "kda" else rand(N, 1, HV)
        if not flags.get("use_gate_in_kernel"):
            g = -torch.nn.functional.softplus(g)                      # a log decay
        q, k = rand(N, 1, H, K), rand(N, 1, H, K)
        if not flags.get("use_qk_l2norm_in_kernel"):
            q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
        beta = rand(N, 1, HV) if flags.get("use_beta_sigmoid_in_kernel") else torch.rand(N, 1, HV, generator=gen)
        tokens.append([x.to(dtype) for x in (q, k, rand(N, 1, HV, V), g, beta)])
    return tokens, rand(N, HV, K, V).mul(0.1), params


IN_KERNEL = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True)
CASES = [
    ("gdn", "plain_gva", 1, 2, {}),
    ("gdn", "in_kernel", 2, 2, dict(IN_KERNEL)),
    ("gdn", "in_kernel_no_dt_bias", 1, 2, dict(IN_KERNEL, dt_bias=False)),
    ("kda", "plain_gva", 1, 2, {}),
    ("kda", "softplus_gate", 2, 2, dict(IN_KERNEL)),
    ("kda", "sigmoid_gate", 1, 2, dict(IN_KERNEL, lower_bound=-3.0)),
    ("kda", "bound_outside_kernel_range", 1, 1, dict(IN_KERNEL, lower_bound=-8.0, dt_bias=False)),
]


def _run(kind, H, HV, flags, seed, dtype=torch.float32):
    """Per token the (o, state) errors of the ascendc step against the eager step."""
    tokens, state0, params = _steps(kind, H, HV, dict(flags), seed, dtype)
    flags = {k: v for k, v in flags.items() if k != "dt_bias"}
    states = {"ascendc": state0.clone(), "eager": state0.clone()}
    errors = []
    for q, k, v, g, beta in tokens:
        outs = {}
        for backend, state in states.items():
            xs = [x if backend == "ascendc" else x.float() for x in (q, k, v, g, beta)]
            outs[backend] = delta_rule_step(kind, *xs, state, **flags, **params, backend=backend)
        errors.append((rel_err(outs["ascendc"].float(), outs["eager"]), rel_err(states["ascendc"], states["eager"])))
    return errors, outs["ascendc"].dtype


@pytest.mark.parametrize("kind,name,H,HV,flags", [pytest.param(*c, id=f"{c[0]}-{c[1]}") for c in CASES])
def test_step_matches_eager(standin, kind, name, H, HV, flags):
    standin.CALLS.clear()
    errors, _ = _run(kind, H, HV, flags, seed=len(name))
    assert max(max(e) for e in errors) <= TOL, errors
    assert set(standin.CALLS) == {f"npu_recurrent_{'gated_delta_rule' if kind == 'gdn' else 'kda'}"}


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_step_bf16_contract(monkeypatch, kind):
    """fla-npu's dtypes (bf16 q/k/v and GDN beta, no ALLOW_FP32): errors at the bf16 level, output bf16."""
    monkeypatch.setattr(runtime, "DEVICE", runtime.DEVICE)
    monkeypatch.setattr(runtime, "KERNEL_DTYPES", runtime.KERNEL_DTYPES)
    install_standin(fp32=False)
    try:
        errors, dtype = _run(kind, 1, 2, dict(IN_KERNEL), seed=3, dtype=torch.bfloat16)
        assert dtype == torch.bfloat16
        assert max(max(e) for e in errors) <= BF16_TOL, errors
        with pytest.raises(TypeError, match="bfloat16"):
            _run(kind, 1, 2, {}, seed=3, dtype=torch.float16)
    finally:
        sys.path.remove(STANDIN)
        forget_fla_npu()


def test_step_limits(standin):
    q, v = torch.zeros(1, 1, 1, 64), torch.zeros(1, 1, 1, 64)
    with pytest.raises(ValueError, match=r"recurrent_gated_delta_rule.*K = V = 128"):
        delta_rule_step("gdn", q, q, v, torch.zeros(1, 1, 1), torch.ones(1, 1, 1), torch.zeros(1, 1, 64, 64),
                        backend="ascendc")
    q, v = torch.zeros(1, 1, 1, 128), torch.zeros(1, 1, 1, 64)
    with pytest.raises(ValueError, match=r"recurrent_kda.*V in"):
        delta_rule_step("kda", q, q, v, torch.zeros(1, 1, 1, 128), torch.ones(1, 1, 1), torch.zeros(1, 1, 128, 64),
                        backend="ascendc")


def test_recurrent_kernel_contracts(standin):
    """The stand-in's recurrent kernels reject what fla-npu's wrappers reject (each message as fla-npu words it)."""
    T, x = 2, torch.randn(2, 1, 128)
    lengths, index = torch.tensor([0, 1, 1], dtype=torch.int32), torch.arange(2, dtype=torch.int32)
    beta, g = torch.rand(T, 1), torch.zeros(T, 1)
    with pytest.raises(RuntimeError, match="prefix entry"):
        standin.recurrent_gated_delta_rule(x, x, x, torch.zeros(2, 1, 128, 128), beta=beta, scale=1.0,
                                           actual_seq_lengths=lengths[:1], ssm_state_indices=index, g=g)
    with pytest.raises(TypeError, match="int32"):
        standin.recurrent_gated_delta_rule(x, x, x, torch.zeros(2, 1, 128, 128), beta=beta, scale=1.0,
                                           actual_seq_lengths=lengths.long(), ssm_state_indices=index, g=g)
    with pytest.raises(RuntimeError, match="floating-point"):
        standin.recurrent_gated_delta_rule(x, x, x, torch.zeros(2, 1, 128, 128), beta=beta, scale=1,
                                           actual_seq_lengths=lengths, ssm_state_indices=index, g=g)
    with pytest.raises(RuntimeError, match="state shape"):     # V-first [blocks, HV, V, K]
        standin.recurrent_gated_delta_rule(x, x, torch.randn(2, 1, 64), torch.zeros(2, 1, 128, 64), beta=beta,
                                           scale=1.0, actual_seq_lengths=lengths, ssm_state_indices=index, g=g)
    q4 = x[:, None]
    with pytest.raises(RuntimeError, match="inplace_final_state=True requires initial_state"):
        standin.recurrent_kda(q4, q4, q4, torch.zeros(2, 1, 1, 128), torch.rand(2, 1, 1))
    with pytest.raises(RuntimeError, match=r"lower_bound must be in \[-5, 0\)"):
        standin.recurrent_kda(q4, q4, q4, torch.zeros(2, 1, 1, 128), torch.rand(2, 1, 1),
                              torch.zeros(2, 1, 128, 128), use_gate_in_kernel=True, A_log=torch.zeros(1),
                              safe_gate=True, lower_bound=-6.0)
    with pytest.raises(RuntimeError, match="A_log must be float32"):
        standin.recurrent_kda(q4, q4, q4, torch.zeros(2, 1, 1, 128), torch.rand(2, 1, 1),
                              torch.zeros(2, 1, 128, 128), use_gate_in_kernel=True, A_log=torch.zeros(1).bfloat16())


# ------------------------------------------------------------------------------------------ layers
HIDDEN = 32
LAYER_DIMS = {"gdn": dict(num_key_heads=1, num_value_heads=2, key_head_dim=K, value_head_dim=V),
              "kda": dict(num_key_heads=1, num_value_heads=1, key_head_dim=K, value_head_dim=V)}


def _layer(kind, backend):
    from megatron.core.transformer import TransformerConfig

    from layers import GatedDeltaNet, KimiDeltaAttention

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
                               params_dtype=torch.float32, gradient_accumulation_fusion=False,
                               bias_dropout_fusion=False)
    torch.manual_seed(11)
    cls = GatedDeltaNet if kind == "gdn" else KimiDeltaAttention
    return cls(config, None, layer_number=1, backend=backend, **LAYER_DIMS[kind]).eval()


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_layer_generation(single_rank, standin, kind):
    """Prefill 3 tokens (chunked ops), then 1-token steps (recurrent kernels) for 2 sequences: every position
    equals the ascendc layer's training forward and the eager layer's."""
    layer, eager = _layer(kind, "ascendc"), _layer(kind, "eager")
    eager.load_state_dict(layer.state_dict())
    x = torch.randn(6, 2, HIDDEN, generator=torch.Generator().manual_seed(7))
    standin.CALLS.clear()
    with torch.no_grad():
        full, _ = layer(x)
        eager_full, _ = eager(x)
    got, _ = generate(layer, x, (3, 1, 1, 1), (2,))
    assert max(rel_err(got[t], full[t]) for t in range(6)) <= 1e-4
    assert max(rel_err(got[t], eager_full[t]) for t in range(6)) <= 1e-4
    assert f"npu_recurrent_{'gated_delta_rule' if kind == 'gdn' else 'kda'}" in standin.CALLS


def test_build_without_recurrent_exports(standin, monkeypatch):
    """A build whose export table lacks the recurrent kernels (tag v26.6.0) gets one error naming the build."""
    import types

    fake = types.ModuleType("fla_npu.ops.ascendc")
    for name in standin.__all__:
        if "recurrent" not in name:
            setattr(fake, name, getattr(standin, name))
    monkeypatch.setitem(sys.modules, "fla_npu.ops.ascendc", fake)
    runtime.load_ops.cache_clear()
    runtime.require_api.cache_clear()
    q, v = torch.zeros(1, 1, 1, 128), torch.zeros(1, 1, 1, 128)
    with pytest.raises(RuntimeError, match=r"recurrent_gated_delta_rule \(missing\).*8a63cf3e"):
        delta_rule_step("gdn", q, q, v, torch.zeros(1, 1, 1), torch.ones(1, 1, 1), torch.zeros(1, 1, 128, 128),
                        backend="ascendc")
    runtime.load_ops.cache_clear()
    runtime.require_api.cache_clear()
