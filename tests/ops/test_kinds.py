"""Delta-rule kind descriptors (layers/ops/kinds.py): an unknown kind name is refused with the known ones named, a
third registered kind runs wherever the code is generic over the descriptor (the eager math) and is refused by
name wherever a backend has per-kind kernels it lacks (never a silent fall-through to another kind's path), and
the vendor kernel names the descriptors declare exist."""
from __future__ import annotations

import pytest
import torch

from layers.ops import kinds
from layers.ops.kinds import GDN, KDA, DeltaKind, delta_kind, register

UNKNOWN = "unknown delta-rule kind 'mamba2'; known kinds: gdn, kda"
# a third kind: KDA's math under another name and op, with no vendor kernels
TOY = DeltaKind(name="toy", op="chunk_toy", gate_per_channel=True, gate=KDA.gate, lower_bound_gate=True)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(kinds._REGISTRY, "toy", TOY)
    return TOY


def _step_inputs(per_channel: bool, seed=0):
    gen = torch.Generator().manual_seed(seed)
    N, H, HV, K, V = 3, 1, 2, 8, 4
    q, k = (torch.randn(N, 1, H, K, generator=gen) for _ in range(2))
    v = torch.randn(N, 1, HV, V, generator=gen)
    g = torch.randn((N, 1, HV) + ((K,) if per_channel else ()), generator=gen)
    beta = torch.randn(N, 1, HV, generator=gen)
    state = torch.randn(N, HV, K, V, generator=gen)
    flags = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
                 A_log=torch.randn(HV, generator=gen),
                 dt_bias=torch.randn(HV * (K if per_channel else 1), generator=gen))
    return (q, k, v, g, beta), state, flags


def test_registry_lookup():
    assert kinds.known_kinds() == ("gdn", "kda")
    assert delta_kind("gdn") is GDN and delta_kind(KDA) is KDA
    assert (GDN.gate_shape(4, 8), KDA.gate_shape(4, 8)) == ((4,), (4, 8))
    assert (GDN.dt_bias_shape(4, 8), KDA.dt_bias_shape(4, 8)) == ((4,), (32,))
    g = torch.zeros(2, 4, 8)
    assert GDN.decay(g[..., 0]).shape == (2, 4, 1, 1) and KDA.decay(g).shape == (2, 4, 8, 1)


def test_unknown_kind_names_are_refused_everywhere():
    from layers.cp.cost_model import DeltaLayerShape
    from layers.ops import delta_rule_step
    from layers.ops.delta_rule import chunk_op
    from layers.ops.summary import segment_summary

    (q, k, v, g, beta), state, _ = _step_inputs(False)
    for call in (lambda: delta_kind("mamba2"), lambda: chunk_op("mamba2"),
                 lambda: delta_rule_step("mamba2", q, k, v, g, beta, state),
                 lambda: segment_summary("mamba2", k, v, g, beta),
                 lambda: DeltaLayerShape(kind="mamba2", batch=1, seq_len=8, heads=1, value_heads=2, k_dim=8, v_dim=4)):
        with pytest.raises(ValueError, match=f"^{UNKNOWN}$"):
            call()
    with pytest.raises(ValueError, match="unknown delta-rule kind None"):
        delta_kind(None)
    stray = DeltaKind(name="gdn", op="chunk_gated_delta_rule", gate_per_channel=False, gate=GDN.gate,
                      lower_bound_gate=False)
    with pytest.raises(ValueError, match="unknown delta-rule kind 'gdn'"):   # same name, not the registered object
        delta_kind(stray)


def test_register_refuses_a_taken_name_and_non_descriptors():
    with pytest.raises(ValueError, match="^delta-rule kind 'kda' is already registered$"):
        register(DeltaKind(name="kda", op="chunk_kda", gate_per_channel=True, gate=KDA.gate, lower_bound_gate=True))
    with pytest.raises(TypeError, match="register takes a DeltaKind, got dict"):
        register({"name": "toy"})
    assert kinds.known_kinds() == ("gdn", "kda")


def test_third_kind_runs_the_generic_eager_math(toy):
    """The eager step and the eager final-state pass read only the descriptor: a kind declaring KDA's gate and
    decay form gives KDA's numbers bit for bit under its own name."""
    from layers.ops import delta_rule_step
    from layers.ops.summary import segment_summary

    inputs, state, flags = _step_inputs(True)
    s_kda, s_toy = state.clone(), state.clone()
    o_kda = delta_rule_step("kda", *inputs, s_kda, **flags)
    o_toy = delta_rule_step("toy", *inputs, s_toy, **flags)
    assert torch.equal(o_kda, o_toy) and torch.equal(s_kda, s_toy) and not torch.equal(s_kda, state)
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(1, 20, 2, 8, generator=gen), torch.randn(1, 20, 2, 4, generator=gen)
    g, beta = -torch.rand(1, 20, 2, 8, generator=gen), torch.rand(1, 20, 2, generator=gen)
    for a, b in zip(segment_summary("kda", k, v, g, beta), segment_summary("toy", k, v, g, beta)):
        assert torch.equal(a, b)


def test_third_kind_is_refused_by_every_per_kind_kernel_table(toy):
    from layers.cp import ascendc as cp_ascendc
    from layers.cp import triton as cp_triton
    from layers.cp import triton_engine_exchange
    from layers.cp.cost_model import DeltaLayerShape, projection_flops
    from layers.ops.ascendc import step as ascendc_step
    from layers.ops.backends import get_backend
    from layers.ops.delta_rule import chunk_op
    from layers.ops.summary import augmented_pass
    from layers.ops.triton import step as triton_step

    (q, k, v, g, beta), state, flags = _step_inputs(True)
    served = r"\(it serves gdn, kda\)$"
    refusals = [
        (lambda: chunk_op("toy"), r"^layers\.ops has no chunk_toy \(delta-rule kind 'toy'\)$"),
        (lambda: augmented_pass("toy", get_backend("eager"), q, k, v, g, beta, None, 1.0, {}),
         r"^backend module layers\.ops\.eager\.backend has no chunk_toy \(delta-rule kind 'toy'\)$"),
        (lambda: ascendc_step.delta_rule_step("toy", q, k, v, g, beta, state, scale=1.0, **flags),
         r"^backend='ascendc' decode has no kernels for delta-rule kind 'toy' " + served),
        (lambda: triton_step.delta_rule_step("toy", q, k, v, g, beta, state, scale=1.0, **flags),
         r"^delta-rule kind 'toy' names no 'step' kernel for backend='triton' \(it names \[\]\)$"),
        (lambda: cp_ascendc.state_passing_cp("toy", None, None, q, k, v, g, beta, scale=1.0, flags={}),
         r"^backend='ascendc' CP has no kernels for delta-rule kind 'toy' " + served),
        (lambda: cp_triton.state_passing_cp("toy", None, None, q, k, v, g, beta, scale=1.0, flags={}),
         r"^backend='triton' CP has no kernels for delta-rule kind 'toy' " + served),
        (lambda: triton_engine_exchange.native_state_passing("toy", None, None, q, k, v, g, beta, scale=1.0,
                                                             flags={}),
         r"^backend='triton' CP has no kernels for delta-rule kind 'toy' " + served),
    ]
    for call, message in refusals:
        with pytest.raises(ValueError, match=message):
            call()
    # the cost model reads the gate form, not the name: the toy kind's layer costs what KDA's does
    shape = dict(batch=1, seq_len=64, heads=2, value_heads=4, k_dim=8, v_dim=16, hidden=32)
    assert projection_flops(DeltaLayerShape(kind="toy", **shape), 64) == \
        projection_flops(DeltaLayerShape(kind="kda", **shape), 64) > \
        projection_flops(DeltaLayerShape(kind="gdn", **shape), 64)


def test_declared_ascendc_kernels_exist():
    """Each fla-npu operator a descriptor names is in the API group it names for it (what ``runtime.require_api``
    loads and checks), and the group has a dtype rule (FLA's functions: tests/backends/test_fla_pins.py)."""
    from layers.ops.ascendc import runtime

    for kind in (GDN, KDA):
        assert set(kind.kernels) == {"triton", "ascendc"}
        names = kind.kernels["ascendc"]
        assert names["chunk"] in runtime.API[names["api"]] and names["step"] in runtime.API[names["step_api"]]
        assert names["api"] in runtime.KERNEL_DTYPES_REAL and names["api"] in runtime.DTYPE_REASON


def test_ops_refuse_lower_bound_for_a_kind_without_that_gate():
    from layers.ops import delta_rule_step

    inputs, state, flags = _step_inputs(False)
    with pytest.raises(ValueError, match=r"^GDN has no lower_bound gate: lower_bound must be None and safe_gate "
                                         r"False, got -1\.0, False$"):
        delta_rule_step("gdn", *inputs, state, lower_bound=-1.0, **flags)
