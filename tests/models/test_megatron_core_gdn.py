"""megatron-core's own GatedDeltaNet (``megatron.core.ssm.gated_delta_net``, 0.17+) beside ours.

In this process (no kernel runs): a ``torch_dist`` checkpoint of megatron-core's GPTModel and of its HybridModel
with its GDN layers (TE modules stood in, tests/support/te_standin.py) converts to ours and back bit-exactly
(``hp_megatron.models.megatron_gdn``); their HybridModel's checkpoint goes on through ``gpt-to-hybrid``
(``hp_megatron.convert.migrate``) into our HybridModel, bit-exact; and the key maps refuse what has no counterpart.

In one spawn of 2 gloo ranks with Triton's interpreter (their layer calls FLA's Triton kernels; on CPU the
interpreter runs them): their layer against ours on the same weights, in fp32 — output, input gradient and every
parameter gradient (theirs gathered by their own ``sharded_state_dict``, ours by ``global_parts``):

* single rank, BSHD (our eager and triton backends) and packed THD;
* TP2, with their and our ``sharded_state_dict`` compared piece by piece (keys, global shapes and offsets);
* CP2, their all-to-all against each of our CP methods with our eager backend (p2p, allgather,
  grouped_allgather_p2p, recursive_doubling, ulysses; the Ulysses x state hybrid needs a Ulysses degree strictly
  between 1 and the CP size, so none exists at CP2), BSHD and packed THD (our triton backend under CP equals our
  eager one: tests/backends/test_backend_triton_interpreter.py);
* CP2 with one key head: megatron-core refuses it (its config check, and its layer fails), ours runs it;
* their GPTModel / HybridModel against ours after the key mapping: logits and all parameter gradients.

Their out_norm weight is shared by the heads that TP splits; its gradient here is summed over TP as megatron's
``finalize_model_grads`` does under sequence parallelism (without SP megatron-core leaves it per-rank partial,
NVIDIA/Megatron-LM issue 7452; ours sums it in the layer). Cost: 27 s wall, 39 CPU s for the file on an idle
2-core machine (the spawn 16 s: ~6 s start-up of 2 fresh ranks that import FLA, then single-rank cases ~4.5 s, the
parallel ones ~1-1.3 s each; the interpreter's first launch of each FLA kernel in a process dominates).
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tests.support import triton_interpreter
from tests.support.dist import run_case, run_distributed_cases
from tests.support.reference import rel_err

WORLD = 2
OUT_TOL, GRAD_TOL = 1e-5, 1e-4   # fp32 FLA kernels (theirs) vs our fp32 eager / FLA (ours): docs/layers.md
METHODS = ("p2p", "allgather", "grouped_allgather_p2p", "recursive_doubling", "ulysses")
REASON = triton_interpreter.available()
# megatron-core's HybridModel and the GDN whose CP this compares (all-to-all, packed THD): megatron-core 0.19
# (looked up without importing megatron-core: the spawned ranks import this module before the interpreter is on)
_MEGATRON = importlib.util.find_spec("megatron")
_CORE = next((os.path.join(p, "core") for p in getattr(_MEGATRON, "submodule_search_locations", None) or ()
              if os.path.isfile(os.path.join(p, "core", "__init__.py"))), None)   # the one megatron.core resolves to
MCORE_REASON = (None if _CORE is not None and os.path.isdir(os.path.join(_CORE, "models", "hybrid"))
                else "megatron-core < 0.19: no HybridModel / GDN all-to-all CP")

# (key, tp, cp, thd, our eager CP methods, our triton CP methods); single-rank cases run on one rank each
SINGLE = {0: ("single-bshd", 1, 1, False, ("none",), ("none",)), 1: ("single-thd", 1, 1, True, ("none",), ())}
PARALLEL = [("tp2-bshd", 2, 1, False, ("none",), ()), ("cp2-bshd", 1, 2, False, METHODS, ()),
            ("cp2-thd", 1, 2, True, METHODS, ())]
MODELS = {0: "gpt", 1: "hybrid"}


# ------------------------------------------------------------------------------------------------ in the spawn
def _packed():
    from megatron.core.packed_seq_params import PackedSeqParams

    from tests.support.delta_layer_cases import DOCS

    cu = torch.tensor([0] + torch.tensor(DOCS).cumsum(0).tolist(), dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(DOCS),
                           max_seqlen_kv=max(DOCS))


def _run(layer, x, dy, thd):
    x = x.clone().requires_grad_(True)
    y, bias = layer(x, None, packed_seq_params=_packed() if thd else None)
    assert bias is None
    y.backward(dy)
    return y.detach(), x.grad


def _summed(layer, tp_group, cp_group):
    """Parameter gradients as megatron's finalize_model_grads leaves them: summed over CP (the data-parallel x CP
    reduction), norm weights also over TP (what it does for ``sequence_parallel`` parameters)."""
    import torch.distributed as dist

    grads = {}
    for name, p in layer.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=cp_group)
        if "out_norm" in name and type(layer).__module__.startswith("megatron"):
            dist.all_reduce(g, group=tp_group)
        grads[p] = g
    return grads


def layer_case(tp, cp, thd, methods, triton_methods, dims=None):
    """Their layer vs ours at one layout: relative errors per our (backend, method)."""
    import torch.distributed as dist

    from tests.support.delta_layer_cases import BATCH, SEQ, cp_token_index, groups
    from tests.support.mcore_gdn import HIDDEN, build_ours, build_theirs, gather_global, layer_config, load_global

    dims = dims or {}
    gen = torch.Generator().manual_seed(11)
    batch = 1 if thd else BATCH
    x, dy = torch.randn(SEQ, batch, HIDDEN, generator=gen), torch.randn(SEQ, batch, HIDDEN, generator=gen)
    parts = build_ours(layer_config(**dims), *groups(1, 1), init_seed=5).global_parts()
    tp_group, cp_group = groups(tp, cp)
    index = cp_token_index("zigzag", cp, dist.get_rank(cp_group), thd)

    theirs = build_theirs(layer_config(tp, cp, **dims), tp_group, cp_group)
    load_global(theirs, parts)
    y_t, dx_t = _run(theirs, x[index], dy[index], thd)
    grads = _summed(theirs, tp_group, cp_group)
    dw_t = gather_global(theirs, grads.get, tp_group)

    results = {}
    for backend, method in [("eager", m) for m in methods] + [("triton", m) for m in triton_methods]:
        options = {"backend": backend}
        if cp > 1:
            options.update(cp_method=method, **({"cp_group_size": 2} if method == "grouped_allgather_p2p" else {}))
        ours = build_ours(layer_config(tp, cp, **dims), tp_group, cp_group, **options)
        ours.load_global_parts(parts)
        y_o, dx_o = _run(ours, x[index], dy[index], thd)
        grads = _summed(ours, tp_group, cp_group)
        dw_o = ours.global_parts({n: grads[p] for n, p in ours.named_parameters()})
        assert sorted(dw_o) == sorted(dw_t), (sorted(dw_o), sorted(dw_t))
        results[f"{backend}-{method}"] = {"out": rel_err(y_o, y_t), "x_grad": rel_err(dx_o, dx_t),
                                          **{f"d:{n}": rel_err(dw_o[n], dw_t[n]) for n in dw_t}}
    return results


def layout_case():
    """Their and our sharded_state_dict at TP2: the same pieces (key, offset) with the same global and local
    shapes on this rank."""
    from tests.support.delta_layer_cases import groups
    from tests.support.mcore_gdn import build_ours, build_theirs, layer_config, layout_of

    tp_group, cp_group = groups(2, 1)
    theirs, ours = (build(layer_config(2, 1), tp_group, cp_group) for build in (build_theirs, build_ours))
    return {"theirs": layout_of(theirs), "ours": layout_of(ours)}


def one_key_head_case():
    """CP2 with one key head (two value heads): their config check and their layer refuse it; ours runs it and
    matches its single-rank run."""
    import torch.distributed as dist
    from megatron.core.transformer import TransformerConfig

    from tests.support.delta_layer_cases import SEQ, cp_token_index, groups
    from tests.support.mcore_gdn import HIDDEN, MODEL_FIELDS, build_ours, build_theirs, layer_config

    dims = dict(linear_num_key_heads=1, linear_num_value_heads=2)
    out = {}
    try:
        TransformerConfig(**{**MODEL_FIELDS, **dims}, num_layers=1, context_parallel_size=2,
                          experimental_attention_variant="gated_delta_net", linear_attention_freq=[1])
        out["config"] = "accepted"
    except (AssertionError, ValueError) as err:
        out["config"] = f"{type(err).__name__}: {err}"
    gen = torch.Generator().manual_seed(3)
    x, dy = torch.randn(SEQ, 1, HIDDEN, generator=gen), torch.randn(SEQ, 1, HIDDEN, generator=gen)
    tp_group, cp_group = groups(1, 2)
    index = cp_token_index("zigzag", 2, dist.get_rank(cp_group), False)
    try:
        _run(build_theirs(layer_config(1, 2, **dims), tp_group, cp_group), x[index], dy[index], False)
        out["layer"] = "ran"
    except Exception as err:  # noqa: BLE001 - whatever their layer raises is the result
        out["layer"] = f"{type(err).__name__}: {str(err)[:200]}"
    ref = build_ours(layer_config(**dims), *groups(1, 1), init_seed=5)
    y_ref, dx_ref = _run(ref, x, dy, False)
    ours = build_ours(layer_config(1, 2, **dims), tp_group, cp_group, init_seed=5, cp_method="p2p")
    y, dx = _run(ours, x[index], dy[index], False)
    out.update(out_err=rel_err(y, y_ref[index]), x_grad_err=rel_err(dx, dx_ref[index]))
    return out


def model_case(kind):
    """Their model, its weights through the key map into ours: logits and every parameter gradient."""
    from hp_megatron.models.megatron_gdn import gpt_key_map, hybrid_key_map
    from tests.support.mcore_gdn import (GPT_MOE, GPT_PATTERN, HYBRID_PATTERN, VOCAB, gpt_model, hybrid_model,
                                         our_model, randomize)

    theirs = gpt_model() if kind == "gpt" else hybrid_model()
    key_map = gpt_key_map(GPT_PATTERN, GPT_MOE) if kind == "gpt" else hybrid_key_map(HYBRID_PATTERN)
    randomize(theirs, 7)
    ours = our_model(key_map)
    tensors = {k: v for k, v in theirs.state_dict().items() if torch.is_tensor(v)}
    converted = key_map.state_dict_to_ours(tensors)
    wanted = {k for k, v in ours.state_dict().items() if torch.is_tensor(v)}
    assert set(converted) == wanted, sorted(set(converted) ^ wanted)
    result = ours.load_state_dict(converted, strict=False)
    assert all(k.endswith("_extra_state") for k in result.missing_keys), result.missing_keys
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (1, 24), generator=gen)
    positions = torch.arange(24)[None]
    dlogits = torch.randn(1, 24, VOCAB, generator=gen)
    causal = torch.ones(1, 1, 24, 24, dtype=torch.bool).triu(1)   # megatron's mask (True: masked)
    logits = {}
    for name, model in (("theirs", theirs), ("ours", ours)):
        out = model(tokens, positions, causal)
        (out * dlogits).sum().backward()
        logits[name] = out.detach()
    grads_t = key_map.state_dict_to_ours({n: p.grad for n, p in theirs.named_parameters()})
    grads_o = {n: p.grad for n, p in ours.named_parameters()}
    assert sorted(grads_t) == sorted(grads_o)
    return {"out": rel_err(logits["ours"], logits["theirs"]),
            **{f"d:{n}": rel_err(grads_o[n], grads_t[n]) for n in grads_o}}


def worker(rank, world):
    """Every case of the spawn on this rank; per case its result or {"error": traceback}."""
    triton_interpreter.enable()   # before megatron-core (its GDN module) imports FLA
    import megatron.core.jit
    from megatron.core import parallel_state

    megatron.core.jit.disable_jit_fuser()   # before their GDN is imported: its @jit_fuser functions run uncompiled
    from hp_megatron.platform import apply_cpu_shims
    from tests.support.delta_layer_cases import groups

    parallel_state.initialize_model_parallel(1, 1)
    for layout in ((1, 1), (2, 1), (1, 2)):
        groups(*layout)   # collective: every rank, same order
    results = {}

    def attempt(key, fn, *args, collective=False):
        run_case(results, key, fn, *args, collective=collective, before=lambda: apply_cpu_shims(2024))

    key, *case = SINGLE[rank]
    attempt(key, layer_case, *case)
    for key, *case in PARALLEL:
        attempt(key, layer_case, *case, collective=True)
    attempt("tp2-layout", layout_case, collective=True)
    attempt("cp2-one_key_head", one_key_head_case, collective=True)
    attempt(f"model-{MODELS[rank]}", model_case, MODELS[rank])
    parallel_state.destroy_model_parallel()
    return results


def _errors(key):
    values = run_distributed_cases(worker, WORLD, key)
    for value in values:
        assert "error" not in value, value["error"]
    return values


def _check(errs, label):
    bad = {n: e for n, e in errs.items() if not e <= (OUT_TOL if n == "out" else GRAD_TOL)}
    assert not bad, (label, bad, errs)


mcore019 = pytest.mark.skipif(MCORE_REASON is not None, reason=MCORE_REASON or "")
spawn = pytest.mark.skipif(REASON is not None or MCORE_REASON is not None,
                           reason=f"megatron-core 0.19's GDN running FLA's kernels: {REASON or MCORE_REASON}")


@spawn
@pytest.mark.parametrize("key", [SINGLE[r][0] for r in sorted(SINGLE)] + [k for k, *_ in PARALLEL])
def test_their_layer_equals_ours(key):
    for per_rank in _errors(key):
        assert per_rank, key
        for label, errs in per_rank.items():
            _check(errs, f"{key}/{label}")


@spawn
def test_their_sharded_state_dict_is_ours_at_tp2():
    for value in _errors("tp2-layout"):
        assert value["theirs"] == value["ours"]
        assert len(value["theirs"]) == 13   # 6 in_proj parts, 3 conv parts, A_log, dt_bias, out_norm, out_proj


@spawn
def test_one_key_head_at_cp2_their_cp_refuses_ours_runs():
    for value in _errors("cp2-one_key_head"):
        assert "linear_num_key_heads" in value["config"], value
        assert value["layer"] != "ran", value
        assert value["out_err"] <= OUT_TOL and value["x_grad_err"] <= GRAD_TOL, value


@spawn
@pytest.mark.parametrize("kind", sorted(MODELS.values()))
def test_their_model_equals_ours_after_the_key_map(kind):
    (errs,) = _errors(f"model-{kind}")
    _check(errs, kind)


# ------------------------------------------------------------------------------------------------ in this process
def _save(model, path):
    from megatron.core import dist_checkpointing

    os.makedirs(path)
    dist_checkpointing.save(model.sharded_state_dict(), path)


def _load(model, path):
    from megatron.core import dist_checkpointing

    from hp_megatron.checkpoint import find_checkpoint

    state = dist_checkpointing.load(model.sharded_state_dict(), find_checkpoint(path) or path)
    model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()})


def _tensors(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


@mcore019
@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
def test_checkpoint_to_ours_and_back_is_bit_exact(kind, tmp_path, single_rank):
    from hp_megatron.models.megatron_gdn import gpt_key_map, hybrid_key_map
    from tests.support.mcore_gdn import GPT_MOE, GPT_PATTERN, HYBRID_PATTERN, gpt_model, hybrid_model, our_model

    build = gpt_model if kind == "gpt" else hybrid_model
    key_map = gpt_key_map(GPT_PATTERN, GPT_MOE) if kind == "gpt" else hybrid_key_map(HYBRID_PATTERN)
    theirs, ours = build(), our_model(key_map)
    original = _tensors(theirs)
    assert any(k.endswith("in_proj.layer_norm_weight") for k in original)   # the TE-fused input norm
    _save(theirs, str(tmp_path / "theirs"))
    key_map.checkpoint_to_ours(str(tmp_path / "theirs"), str(tmp_path / "ours"), target=ours)
    _load(ours, str(tmp_path / "ours"))
    converted = _tensors(ours)
    assert converted.keys() == key_map.state_dict_to_ours(original).keys()
    for key, value in key_map.state_dict_to_ours(original).items():
        assert torch.equal(converted[key], value), key

    # without a target: the same tensors, and the source's objects under the new keys
    from hp_megatron.checkpoint import find_checkpoint
    from hp_megatron.checkpoint.dcp_io import ChunkReader

    key_map.checkpoint_to_ours(str(tmp_path / "theirs"), str(tmp_path / "plain"))
    checked, plain = (ChunkReader(find_checkpoint(str(tmp_path / name))) for name in ("ours", "plain"))
    source = ChunkReader(str(tmp_path / "theirs"))
    assert plain.tensors == checked.tensors
    model_objects = [k for k in source.objects if not k.startswith("common_state")]   # megatron-core 0.19's common
    plain_objects = [k for k in plain.objects if not k.startswith("common_state")]    # state, in both
    assert sorted(plain_objects) == sorted(key_map.to_ours(k) for k in model_objects)
    assert plain.read_objects(plain_objects) == {key_map.to_ours(k): v
                                                 for k, v in source.read_objects(model_objects).items()}

    if kind == "hybrid":   # their HybridModel -> our GPTModel -> (gpt-to-hybrid) our HybridModel, bit-exact
        from hp_megatron.convert.migrate import migrate_gpt_to_hybrid
        from hp_megatron.hybrid_model.numbering import LayerNumbering

        ours_hybrid = our_model(key_map, "hybrid")
        assert ours_hybrid.hybrid_layer_pattern == HYBRID_PATTERN
        migrate_gpt_to_hybrid(str(tmp_path / "ours"), str(tmp_path / "ours_hybrid"), HYBRID_PATTERN)
        _load(ours_hybrid, str(tmp_path / "ours_hybrid"))
        migrated, numbering = _tensors(ours_hybrid), LayerNumbering(HYBRID_PATTERN)
        expected = {numbering.gpt_to_hybrid(k): v for k, v in key_map.state_dict_to_ours(original).items()}
        assert sorted(k for k in migrated if not k.endswith("_extra_state")) == sorted(expected)
        for key, value in expected.items():
            assert torch.equal(migrated[key], value), key

    key_map.checkpoint_to_theirs(str(tmp_path / "ours"), str(tmp_path / "back"), target=theirs)
    fresh = build()
    _load(fresh, str(tmp_path / "back"))
    back = _tensors(fresh)
    assert back.keys() == original.keys()
    for key, value in original.items():
        assert torch.equal(back[key], value), key


def test_key_maps_refuse_what_has_no_counterpart():
    from hp_megatron.models.megatron_gdn import gpt_key_map, hybrid_key_map

    gpt = gpt_key_map("GA")
    assert gpt.to_ours("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.1.input_layernorm.weight"
    for key in ("decoder.layers.0.self_attention.in_proj.bias", "decoder.layers.0.self_attention.out_proj.bias",
                "decoder.layers.0.self_attention.in_proj.layer_norm_bias"):
        with pytest.raises(ValueError, match="bias"):
            gpt.to_ours(key)
    with pytest.raises(ValueError, match="no counterpart"):
        gpt.to_ours("mtp.layers.0.enorm.weight")
    hybrid = hybrid_key_map("G-|*E")
    assert (hybrid.pattern, hybrid.moe_layers) == ("GA", (False, True))
    assert hybrid.to_ours("decoder.layers.3.mlp.router.weight") == "decoder.layers.1.mlp.router.weight"
    assert hybrid.to_theirs("decoder.layers.1.input_layernorm.weight") == \
        "decoder.layers.2.self_attention.linear_qkv.layer_norm_weight"
    assert hybrid.to_ours("decoder.final_norm.weight") == "decoder.final_layernorm.weight"
    for pattern in ("M-G-", "GG-", "G-/G-", "G"):
        with pytest.raises(ValueError, match="hybrid_layer_pattern"):
            hybrid_key_map(pattern)
