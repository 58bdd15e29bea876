"""Lean layers: FLA's fused gated RMSNorm on the triton backend, and eager ops that keep only their inputs.

* The triton backend's gated norm (FLA's ``rms_norm_gated``, run by Triton's interpreter in one spawned process)
  must match the eager norm: output and the gradients of x, gate and weight, SiLU (GDN) and sigmoid (KDA), with
  and without the zero-centred weight.
* Our GDN / KDA layers with ``backend="triton"`` (fused norm, FLA's conv and delta-rule kernels) must match the
  same layers with ``backend="eager"`` on packed documents (THD, three documents): output, input gradient and
  every parameter gradient, fp32.
* The eager ops (delta rule, conv, gated norm) save for backward only storages of their inputs: the chunked
  intermediates are recomputed in backward (``layers.ops.eager.recompute``); the fp64 references of
  tests/ops/test_delta_rule.py and tests/ops/test_conv.py check the recomputed gradients.
"""
from __future__ import annotations

import pytest
import torch

from tests.support import triton_interpreter
from tests.support.dist import case_result, run_distributed_cases
from tests.support.reference import rel_err

TOL = 1e-5    # fp32 kernels vs fp32 eager (observed ~1e-7 for the norm, ~1e-6 for the layers)
LAYER_TOL = 1e-4   # the layer tolerance of tests/layers/test_layers_delta_parallel.py
# GDN's A_log / dt_bias gradients are sums over every token of the scalar gate gradient, with heavy cancellation:
# FLA's fp32 gate backward and the eager one differ by 1.1e-4 with the eager norm on both sides (before the
# fused norm) and by 2.7e-4 with FLA's fused norm, whose output differs from the eager norm's by 2e-7.
GDN_GATE_TOL = 1e-3
HIDDEN = 64
DIMS = {"gdn": dict(num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=16),
        "kda": dict(num_key_heads=2, num_value_heads=2, key_head_dim=16, value_head_dim=16)}
DOCS = (20, 37, 23)
NORM_CASES = [(act, zc) for act in ("silu", "sigmoid") for zc in (False, True)]
REASON = triton_interpreter.available()
interpreted = pytest.mark.skipif(REASON is not None, reason=f"triton interpreter tests: {REASON or ''}")


def _norm_case(activation, zero_centered):
    from layers.shared.norm import GatedRMSNorm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 11, 3, 32, generator=gen)
    gate = torch.randn(2, 11, 3, 32, generator=gen)
    dy = torch.randn(2, 11, 3, 32, generator=gen)
    results = {}
    for backend in ("eager", "triton"):
        norm = GatedRMSNorm(None, 32, eps=1e-6, activation=activation, zero_centered_gamma=zero_centered,
                            backend=backend)
        with torch.no_grad():
            norm.weight.copy_(torch.linspace(-0.5, 0.5, 32) + (0.0 if zero_centered else 1.0))
        xs, gs = x.clone().requires_grad_(), gate.clone().requires_grad_()
        y = norm(xs, gs)
        (y * dy).sum().backward()
        results[backend] = dict(y=y.detach(), x=xs.grad, gate=gs.grad, weight=norm.weight.grad)
    return {name: rel_err(results["triton"][name], results["eager"][name]) for name in results["eager"]}


def _layer(kind, backend):
    from megatron.core.transformer import TransformerConfig

    from layers import GatedDeltaNet, KimiDeltaAttention

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
                               params_dtype=torch.float32, gradient_accumulation_fusion=False,
                               bias_dropout_fusion=False, layernorm_epsilon=1e-6)
    cls = GatedDeltaNet if kind == "gdn" else KimiDeltaAttention
    return cls(config, None, layer_number=1, backend=backend, init_seed=7, **DIMS[kind])


def _layer_case(kind):
    """Largest relative error of the triton layer against the eager layer (packed documents), per tensor."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(DOCS).cumsum(0).tolist()], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(DOCS),
                             max_seqlen_kv=max(DOCS))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(sum(DOCS), 1, HIDDEN, generator=gen)
    dy = torch.randn(sum(DOCS), 1, HIDDEN, generator=gen)
    results = {}
    for backend in ("eager", "triton"):
        layer = _layer(kind, backend)
        with torch.no_grad():   # the norm weight off its constant init, so its gradient is checked for real
            layer.out_norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
        xs = x.clone().requires_grad_()
        y, _ = layer(xs, None, packed_seq_params=packed)
        (y * dy).sum().backward()
        results[backend] = dict(y=y.detach(), dx=xs.grad, **{n: p.grad for n, p in layer.named_parameters()})
    missing = [n for n, g in results["triton"].items() if g is None]
    if missing:
        raise AssertionError(f"triton layer has no gradient for {missing}")
    return {name: rel_err(results["triton"][name], results["eager"][name]) for name in results["eager"]}


def worker(rank, world):
    """One process: the interpreter on before FLA is imported, then every case (streamed to the parent)."""
    from hp_megatron.platform import single_rank_megatron

    triton_interpreter.enable()
    torch.manual_seed(0)
    results = {}

    def report(key, value):
        results[key] = value
        case_result(key, value)

    for activation, zero_centered in NORM_CASES:
        report(("norm", activation, zero_centered), _norm_case(activation, zero_centered))
    with single_rank_megatron(0):   # megatron-core's parallel state on the spawn's one-rank gloo group
        for kind in ("gdn", "kda"):
            report(("layer", kind), _layer_case(kind))
    return results


@interpreted
@pytest.mark.parametrize("activation,zero_centered", NORM_CASES)
def test_triton_gated_norm_matches_eager(activation, zero_centered):
    errors = run_distributed_cases(worker, 1, ("norm", activation, zero_centered))[0]
    bad = {n: f"{e:.2e}" for n, e in errors.items() if not e <= TOL}
    assert not bad, f"FLA's fused gated RMSNorm differs from the eager norm: {bad}"


@interpreted
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_triton_layer_matches_eager_layer_packed(kind):
    errors = run_distributed_cases(worker, 1, ("layer", kind))[0]
    assert {"y", "dx", "out_norm.weight", "in_proj.weight", "conv1d.weight", "A_log", "dt_bias"} <= set(errors)
    tol = {n: GDN_GATE_TOL if kind == "gdn" and n in ("A_log", "dt_bias") else LAYER_TOL for n in errors}
    bad = {n: f"{e:.2e}" for n, e in errors.items() if not e <= tol[n]}
    assert not bad, f"triton layer vs eager layer (packed documents): {bad}"


def _saved_storages(run):
    ptrs = set()

    def pack(t):
        ptrs.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return ptrs, out


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_eager_delta_rule_saves_only_inputs(kind):
    from layers.ops import chunk_gated_delta_rule, chunk_kda

    gen = torch.Generator().manual_seed(0)
    B, T, H, HV, K, V = 1, 150, 2, 4, 16, 8
    q, k = (torch.randn(B, T, H, K, generator=gen).requires_grad_() for _ in range(2))
    v = torch.randn(B, T, HV, V, generator=gen).requires_grad_()
    g = torch.randn(B, T, HV, *(() if kind == "gdn" else (K,)), generator=gen).requires_grad_()
    beta = torch.randn(B, T, HV, generator=gen).requires_grad_()
    A_log = torch.rand(HV, generator=gen).requires_grad_()
    dt_bias = torch.randn(HV * (1 if kind == "gdn" else K), generator=gen).requires_grad_()
    state = torch.randn(3, HV, K, V, generator=gen).requires_grad_()
    op = chunk_gated_delta_rule if kind == "gdn" else chunk_kda
    inputs = (q, k, v, g, beta, A_log, dt_bias, state)
    saved, (o, final) = _saved_storages(lambda: op(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
        cu_seqlens=torch.tensor([0, 40, 100, 150])))
    assert saved == {t.untyped_storage().data_ptr() for t in inputs}
    (o.sum() + final.sum()).backward()
    assert all(t.grad is not None for t in inputs)


def test_eager_conv_and_gated_norm_save_only_inputs():
    from layers.shared.norm import gated_rms_norm
    from layers.ops import causal_conv1d

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 30, 12, generator=gen).requires_grad_()
    weight = torch.randn(12, 4, generator=gen).requires_grad_()
    bias = torch.randn(12, generator=gen).requires_grad_()
    saved, y = _saved_storages(lambda: causal_conv1d(x, weight, bias=bias, activation="silu"))
    assert saved == {t.untyped_storage().data_ptr() for t in (x, weight, bias)}
    gate = torch.randn(2, 30, 12, generator=gen).requires_grad_()
    norm_weight = torch.rand(12, generator=gen).requires_grad_()
    saved, out = _saved_storages(lambda: gated_rms_norm(y, gate, norm_weight, 1e-6, "silu"))
    assert saved == {t.untyped_storage().data_ptr() for t in (y, gate, norm_weight)}
    out.sum().backward()
    assert all(t.grad is not None for t in (x, weight, bias, gate, norm_weight))
