"""``method="auto"``: the cost model and the choice on synthetic calibrations, and on 4 gloo ranks the real
calibration, the identical decision on every rank and a GDN layer built with auto against the chosen method."""
from __future__ import annotations

import json
import math
import time

import pytest
import torch
import torch.distributed as dist

from layers.cp.auto import rank_candidates
from layers.cp.calibration import FORMAT, fit_line
from layers.cp.cost_model import (COLLECTIVES, Calibration, Candidate, DeltaLayerShape, LinearFit, MLALayerShape,
                                  delta_candidates, mla_candidates, predict_delta, state_exchange_seconds)
from tests.support.dist import run_distributed


def synthetic(alpha, beta, *, gamma=1e12, op_rate=1e12, gemm_rate=1e12, a2a_alpha=None, relay_alpha=None):
    """A calibration with one alpha/beta for every collective (all-to-all and relay latency optionally apart)
    and kernel fits for the shapes below."""
    fits = {c: LinearFit(alpha, beta) for c in ("all_gather", "send_recv")}
    fits["all_to_all"] = LinearFit(alpha if a2a_alpha is None else a2a_alpha, beta)
    fits["relay"] = LinearFit(alpha if relay_alpha is None else relay_alpha, beta)
    kern = {"op": LinearFit(0.0, op_rate), "augmented": LinearFit(0.0, op_rate), "summary": LinearFit(0.0, op_rate),
            "gemm": LinearFit(0.0, gemm_rate)}
    return Calibration(collectives=fits, fold_flops=gamma, key="synthetic",
                       kernels={k: dict(kern) for k in ("gdn/eager/K128/V128/float32", "kda/eager/K64/V64/float32",
                                                         "mla/gemm/float32")})


def gdn(heads=16, value_heads=32, T=131072, layout="zigzag", **kw):
    return DeltaLayerShape(kind="gdn", batch=1, seq_len=T, heads=heads, value_heads=value_heads, k_dim=128,
                           v_dim=128, layout=layout, hidden=2048, act_bytes=2, **kw)


def labels(cands):
    return [c.label for c in cands]


def test_candidates_enumerate_every_valid_configuration():
    assert labels(delta_candidates(4, 4, 4)) == [
        "p2p", "allgather", "grouped_allgather_p2p(g=2)", "recursive_doubling",
        "ulysses2 x p2p", "ulysses2 x allgather", "ulysses2 x recursive_doubling", "ulysses"]
    # heads not divisible by P (nor by 2): no Ulysses at all, grouped with g = 2 and 3 at P = 6
    assert labels(delta_candidates(6, 3, 3)) == [
        "p2p", "allgather", "grouped_allgather_p2p(g=2)", "grouped_allgather_p2p(g=3)", "recursive_doubling",
        "ulysses3 x p2p", "ulysses3 x allgather", "ulysses3 x recursive_doubling"]
    assert "ulysses" not in labels(delta_candidates(4, 3, 6))
    assert labels(mla_candidates(4, 6)) == ["latent"]
    assert labels(mla_candidates(4, 8)) == ["latent", "latent_ulysses", "expanded_ulysses"]


def test_state_exchange_follows_the_closed_forms():
    cal = synthetic(1e-5, 4e10, gamma=5e13, relay_alpha=3e-6)
    HV, K, V, P = 32, 128, 128, 8
    m, s = HV * K * (K + V) * 4, HV * K * V * 4
    apply_ = 2 * HV * K * K * V / 5e13
    got = state_exchange_seconds("allgather", "zigzag", P, num_chains=1, heads=HV, k_dim=K, v_dim=V, calibration=cal)
    assert got == pytest.approx(1e-5 * 3 + 2 * (P - 1) * m / 4e10 + (2 * P - 1) * apply_)
    got = state_exchange_seconds("p2p", "contiguous", P, num_chains=1, heads=HV, k_dim=K, v_dim=V, calibration=cal)
    assert got == pytest.approx((P - 1) * (3e-6 + s / 4e10) + P * apply_)       # hand-overs on the relay fit
    compose = 2 * HV * K * K * (K + V) / 5e13
    got = state_exchange_seconds("recursive_doubling", "contiguous", P, num_chains=1, heads=HV, k_dim=K, v_dim=V,
                                 calibration=cal)
    assert got == pytest.approx(3 * 1e-5 + 3 * m / 4e10 + 3 * compose)      # log2 P simultaneous rounds
    got = state_exchange_seconds("grouped_allgather_p2p", "contiguous", P, num_chains=1, heads=HV, k_dim=K, v_dim=V,
                                 calibration=cal, group_size=2)
    assert got == pytest.approx(1e-5 + m / 4e10 + 3 * (3e-6 + s / 4e10) + (P - 1) * apply_)


def test_oversubscribed_host_prices_relay_apart_from_simultaneous_exchange():
    """More ranks than cores: a ring shift (every rank sending at once) waits for time slices, a relayed
    hand-over (one pair active, the others idle) does not. The calibration measures both; p2p's walk is priced
    on the relay, recursive doubling's rounds on the ring shift, so the cheap relay makes p2p the choice at
    small P, and a slow relay (a high-latency chain) makes the log-round methods win again."""
    shape = gdn(heads=3, value_heads=3, T=6144)
    fast_relay = rank_candidates(shape, 3, synthetic(1.5e-3, 1e12, relay_alpha=2e-4))
    assert fast_relay.choice == Candidate("p2p")
    comm = {c.label: p["comm"] for c, p in fast_relay.ranking}
    # zigzag P=3, chain owners 0 1 2 2 1 0: 4 hand-overs and 6 applied maps per scan, forward and backward;
    # recursive doubling: ceil(log2 6) = 3 rounds
    apply_ = 2 * 3 * 128 ** 3 / 1e12
    assert comm["p2p"] == pytest.approx(2 * (4 * (2e-4 + 3 * 128 * 128 * 4 / 1e12) + 6 * apply_))
    assert comm["recursive_doubling"] > 2 * 3 * 1.5e-3
    slow_relay = rank_candidates(shape, 3, synthetic(1.5e-3, 1e12, relay_alpha=2e-3))
    order = [c.label for c, _ in slow_relay.ranking]
    assert slow_relay.choice.method != "p2p"
    assert order.index("p2p") > min(order.index("allgather"), order.index("recursive_doubling")), order


def test_high_latency_avoids_sequential_walks():
    """alpha = 1 ms per step, infinite bandwidth: p2p's 2(P-1) hand-overs lose to one all-gather."""
    d = rank_candidates(gdn(heads=3, value_heads=3, T=8192), 16, synthetic(1e-3, 1e15))
    assert d.choice.method in ("allgather", "recursive_doubling")
    comm = dict((c.label, p["comm"]) for c, p in d.ranking)
    assert comm["p2p"] > 5 * d.predicted["comm"]              # 30 hand-overs against 4 all-gather rounds


def test_high_bandwidth_many_heads_picks_ulysses():
    """Fast all-to-all and heads divisible by P: Ulysses (no summary pass, no chain) wins on compute."""
    cal = synthetic(1e-6, 1e13, op_rate=1e11)
    d = rank_candidates(gdn(heads=16, value_heads=32), 8, cal)
    assert d.choice == Candidate("ulysses")
    assert d.runner_up[1]["total"] > d.predicted["total"]


def test_straggler_cost_is_charged_per_synchronization():
    """A calibrated straggler cost per synchronization: every candidate pays it for the conv halo (2), the state
    scan (2) and Ulysses' all-to-alls (4), forward + backward. Ulysses, cheaper on compute, has two
    synchronizations more than a state method and loses once each costs more than half its lead."""
    import dataclasses

    shape = gdn(heads=4, value_heads=4, T=4096)
    plain = synthetic(1e-6, 1e13, op_rate=1e11)
    before = {c.label: p["total"] for c, p in rank_candidates(shape, 4, plain).ranking}
    assert rank_candidates(shape, 4, plain).choice == Candidate("ulysses")
    lead = min(t for label, t in before.items() if label != "ulysses") - before["ulysses"]
    stalled = dataclasses.replace(plain, sync=LinearFit(lead, 1e30))          # per synchronization: the lead
    after = {c.label: p["total"] for c, p in rank_candidates(shape, 4, stalled).ranking}
    syncs = {"p2p": 4, "allgather": 4, "grouped_allgather_p2p(g=2)": 4, "recursive_doubling": 4, "ulysses": 6,
             "ulysses2 x p2p": 8, "ulysses2 x allgather": 8, "ulysses2 x recursive_doubling": 8}
    assert sorted(after) == sorted(syncs)
    for label, n in syncs.items():
        assert after[label] - before[label] == pytest.approx(n * lead, rel=1e-9), label
    assert rank_candidates(shape, 4, stalled).choice.method != "ulysses"
    # a share of the phase before each synchronization: 10 % of the compute split into n + 1 phases
    share = dataclasses.replace(plain, sync=LinearFit(0.0, 10.0))
    p2p = predict_delta(shape, 4, Candidate("p2p"), share)
    base = predict_delta(shape, 4, Candidate("p2p"), plain)
    assert p2p["comm"] - base["comm"] == pytest.approx(4 * 0.1 * base["compute"] / 5)


def test_measured_candidates_decide_and_are_logged():
    """The model's ranking stays; the choice is the fastest of the timed candidates, and the log says so."""
    d = rank_candidates(gdn(heads=4, value_heads=4, T=4096), 4, synthetic(1e-6, 1e13, op_rate=1e11))
    top = [c for c, _ in d.ranking[:3]]
    m = d.with_measurements(zip(top, (0.030, 0.020, 0.025)))
    assert m.choice == top[1] and m.ranking == d.ranking and m.predicted == d.ranking[1][1]
    line = m.log_line()
    assert line.startswith(d.log_line()) and line.endswith(
        f"; timed on the layer: {top[0].label} 30.0, {top[1].label} 20.0, {top[2].label} 25.0 ms -> {top[1].label}")


def test_measure_count_is_validated():
    from megatron.core.transformer import TransformerConfig

    from layers import GatedDeltaNet

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    with pytest.raises(ValueError, match="cp_auto_measure must be an int >= 0"):
        GatedDeltaNet(config, None, layer_number=1, num_key_heads=4, key_head_dim=8, cp_method="auto",
                      cp_auto_measure=-1)


def test_heads_not_divisible_never_chooses_ulysses_over_p():
    cal = synthetic(1e-6, 1e13, op_rate=1e11)
    d = rank_candidates(gdn(heads=6, value_heads=6), 4, cal)
    assert d.choice.method != "ulysses" and all(c.method != "ulysses" for c, _ in d.ranking)
    assert d.choice.ulysses_degree == 2          # the hybrid still shortens the chain and skips half the work


def test_low_bandwidth_large_p_prefers_log_volume():
    """Slow network, many ranks, no Ulysses: the all-gather's (P-1) maps cost more than log P rounds."""
    d = rank_candidates(gdn(heads=5, value_heads=5, T=1 << 20), 256, synthetic(2e-6, 1e9))
    assert d.choice.method in ("recursive_doubling", "grouped_allgather_p2p")
    times = dict((c.label, p["total"]) for c, p in d.ranking)
    assert times["allgather"] > 2 * d.predicted["total"]


def test_layout_imbalance_of_packed_documents():
    """Contiguous THD with one short and one long document: the compute follows the chunk-padded pieces of the
    slowest rank, so a configuration's compute grows with the number of pieces a rank pads."""
    cal = synthetic(1e-6, 1e12, op_rate=1e10)
    even = DeltaLayerShape(kind="gdn", batch=1, seq_len=4096, heads=4, value_heads=4, k_dim=128, v_dim=128,
                           layout="contiguous", cu_seqlens=(0, 4096))
    ragged = DeltaLayerShape(kind="gdn", batch=1, seq_len=4096, heads=4, value_heads=4, k_dim=128, v_dim=128,
                             layout="contiguous", cu_seqlens=(0, 1, 2, 3, 4096))
    a = predict_delta(even, 4, Candidate("allgather"), cal)["compute"]
    b = predict_delta(ragged, 4, Candidate("allgather"), cal)["compute"]
    assert b > a                                # three 1-token documents each pad a chunk on rank 0


def test_zigzag_packed_documents_count_every_piece():
    """Zigzag THD cuts every document into 2P parts: 16 documents of 256 tokens give each of P=4 ranks 32 pieces
    of 32 tokens. With FLA's 64-token chunks (native summaries) each is padded to a chunk, twice the work of one
    4096-token row; the eager kernels chunk them by 32 (no padding, smaller intra-chunk products). Ulysses keeps
    whole documents (no padding)."""
    cal = synthetic(1e-6, 1e12, op_rate=1e10)
    for native in (True, False):
        kw = dict(kind="kda", batch=1, seq_len=4096, heads=4, value_heads=4, k_dim=64, v_dim=64,
                  native_summaries=native)
        docs = DeltaLayerShape(cu_seqlens=tuple(range(0, 4097, 256)), **kw)
        row = DeltaLayerShape(**kw)
        width = 64 if native else 128                     # the generic path's one pass is V + K wide
        expected = 2.0 if native else (2 * 32 * (3 * 64 + width) + 6 * 64 * width) / (
            2 * 64 * (3 * 64 + width) + 6 * 64 * width)
        for cand in (Candidate("p2p"), Candidate("allgather")):
            ratio = predict_delta(docs, 4, cand, cal)["compute"] / predict_delta(row, 4, cand, cal)["compute"]
            assert ratio == pytest.approx(expected, rel=1e-6), native
        assert predict_delta(docs, 4, Candidate("ulysses"), cal)["compute"] == pytest.approx(
            predict_delta(row, 4, Candidate("ulysses"), cal)["compute"])
    assert rank_candidates(docs, 4, cal).choice == Candidate("ulysses")


def test_mla_strategies():
    shape = MLALayerShape(batch=1, seq_len=32768, heads=8, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
                          kv_lora_rank=512)
    # expanding K/V for every head on every rank dominates: latent_ulysses expands only its heads
    d = rank_candidates(shape, 8, synthetic(1e-6, 1e12, gemm_rate=1e12))
    assert d.choice.method in ("latent_ulysses", "expanded_ulysses")
    odd = MLALayerShape(batch=1, seq_len=4096, heads=6, qk_head_dim=64, qk_pos_emb_head_dim=32, v_head_dim=64,
                        kv_lora_rank=128)
    assert rank_candidates(odd, 4, synthetic(1e-6, 1e12)).choice.method == "latent"


def test_fit_recovers_alpha_beta_and_rejects_noise_signs():
    xs = [1e4, 1e5, 1e6]
    fit = fit_line(xs, [3 * 2e-5 + x / 5e9 for x in xs], steps=3)
    assert fit.alpha == pytest.approx(2e-5) and fit.beta == pytest.approx(5e9) and fit.residual < 1e-9
    flat = fit_line(xs, [1.1e-4, 1e-4, 0.9e-4])         # no bandwidth term measurable: latency only
    assert flat.alpha > 0 and flat.beta >= 1e14


def test_calibration_json_round_trip(tmp_path):
    from layers.cp.calibration import _read, save

    cal = synthetic(1e-5, 4e10)
    cal.key = "P=4|test"
    path = tmp_path / "cal.json"
    save(cal, str(path))
    other = synthetic(2e-5, 1e10)
    other.key = "P=2|test"
    save(other, str(path))
    data = json.loads(path.read_text())
    assert sorted(data) == ["P=2|test", "P=4|test"]
    back = Calibration.from_json(_read(str(path))["P=4|test"])
    assert back.collectives == cal.collectives and back.kernels == cal.kernels and back.sync is None
    cal.sync = LinearFit(1e-3, 20.0, 0.05)
    save(cal, str(path))
    assert Calibration.from_json(_read(str(path))["P=4|test"]).sync == cal.sync


def test_auto_rejects_explicit_group_size():
    from layers.cp.subgroups import check_auto_leaves_free

    with pytest.raises(ValueError, match="chooses group_size and ulysses_degree itself"):
        check_auto_leaves_free(2, None)


def test_auto_flags_become_config_fields():
    import argparse

    from hp_megatron.arguments import add_hp_arguments, hp_config_from_args

    parser = argparse.ArgumentParser()
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=64)
    add_hp_arguments(parser)
    fields = hp_config_from_args(parser.parse_args(["--hp-cp-method", "auto", "--hp-mla-cp-strategy", "auto",
                                                    "--hp-cp-calibration", "cal.json"]))
    assert (fields["delta_cp_method"], fields["mla_cp_strategy"], fields["hp_cp_calibration"]) == (
        "auto", "auto", "cal.json")
    with pytest.raises(ValueError, match="needs --hp-cp-method auto"):
        hp_config_from_args(parser.parse_args(["--hp-cp-calibration", "cal.json"]))


# -- 4 gloo ranks ---------------------------------------------------------------------------------------------
P = 4
HIDDEN, SEQ, BATCH = 32, 32, 1


def _worker(rank, world_size, path):
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    from hp_megatron.platform import apply_cpu_shims
    from layers import GatedDeltaNet
    from layers.cp import build_cp_context
    from layers.cp import auto as auto_mod
    from layers.cp.calibration import calibrate, load_or_calibrate

    tuner = auto_mod.auto_tuner()

    out = {"concurrent": _concurrent_timing(rank)}
    solo = dist.new_group([rank], use_local_synchronization=True)
    try:
        calibrate(solo)
        out["solo"] = None
    except ValueError as err:
        out["solo"] = str(err)
    cal, source = load_or_calibrate(None, path)
    out["source"] = source
    out["fits"] = {k: (v.alpha, v.beta) for k, v in cal.collectives.items()}
    out["sync"] = (cal.sync.alpha, cal.sync.beta)
    out["calibration_line"] = auto_mod.calibration_line(cal, source)
    out["reload"] = load_or_calibrate(None, path)[1]
    bad = path + ".bad"
    if rank == 0:
        with open(bad, "w") as f:
            f.write("{not json")
    dist.barrier()
    try:                           # rank 0 reads the file: its error must reach every rank (no rank left waiting)
        load_or_calibrate(None, bad)
        out["bad_file"] = None
    except ValueError as err:
        out["bad_file"] = type(err).__name__
    # rank-dependent calibrations: rank 0's decision must still win everywhere
    skew = synthetic(1e-6 if rank == 0 else 1.0, 1e13, op_rate=1e11)
    shape = DeltaLayerShape(kind="kda", batch=1, seq_len=1024, heads=4, value_heads=4, k_dim=64, v_dim=64)
    decision = tuner.decide(None, shape, calibration=skew)
    out["skewed"] = decision.choice.label
    ctx = build_cp_context(None, layout="zigzag", **decision.choice.context_kwargs())
    out["ctx"] = (ctx.method, ctx.group_size, ctx.ulysses_degree)

    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=P)
    apply_cpu_shims(7)
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
                               params_dtype=torch.float32, context_parallel_size=P)
    dims = dict(num_key_heads=4, num_value_heads=4, key_head_dim=8, value_head_dim=8, init_seed=5)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    part = SEQ // (2 * P)
    idx = torch.tensor([t for c in (rank, 2 * P - 1 - rank) for t in range(c * part, (c + 1) * part)])
    results = {}
    for label in ("auto", "chosen"):
        opts = {"cp_method": "auto", "cp_calibration": path} if label == "auto" else {}
        if label == "chosen":
            opts = {"cp_method": results["auto"]["method"][0], "cp_group_size": results["auto"]["method"][1],
                    "cp_ulysses_degree": results["auto"]["method"][2]}
        layer = GatedDeltaNet(config, None, layer_number=1, **dims, **opts)
        hook_calls = []                # megatron's DDP accumulates main_grad in such hooks: one call per backward
        for p in layer.parameters():
            p.register_post_accumulate_grad_hook(lambda p, hook_calls=hook_calls: hook_calls.append(1))
        xl = x[idx].clone().requires_grad_(True)
        y, _ = layer(xl)
        y.square().sum().backward()
        method = layer.cp_auto_choice(layer.cp_group) or (layer.cp_method, layer.cp_group_size,
                                                          layer.cp_ulysses_degree)
        results[label] = {"y": y.detach(), "dx": xl.grad, "method": method,
                          "hook_calls": len(hook_calls) / len(list(layer.parameters())),
                          "grads": {n: p.grad.clone() for n, p in layer.named_parameters()}}
    model_only = GatedDeltaNet(config, None, layer_number=1, **dims, cp_method="auto", cp_calibration=path,
                               cp_auto_measure=0)
    model_only(x[idx].clone())
    out["model_only"] = model_only.cp_auto_choice(model_only.cp_group)
    # megatron's full activation recompute runs the first forward under no_grad: calibration and timing still run
    recomputed = GatedDeltaNet(config, None, layer_number=1, **{**dims, "num_key_heads": 2, "num_value_heads": 2},
                               cp_method="auto", cp_calibration=path)
    with torch.no_grad():
        recomputed(x[idx].clone())
    out["no_grad"] = recomputed.cp_auto_choice(recomputed.cp_group)
    # megatron's hybrid CP: a micro-batch's PackedSeqParams.cp_group may be another group, here a pair
    from megatron.core.packed_seq_params import PackedSeqParams

    pair = [dist.new_group(r) for r in ([0, 1], [2, 3])][rank // 2]
    quarter = SEQ // 4
    idx2 = torch.tensor([t for c in (rank % 2, 3 - rank % 2) for t in range(c * quarter, (c + 1) * quarter)])
    y_pair, _ = model_only(x[idx2].clone(), packed_seq_params=PackedSeqParams(qkv_format="sbhd", cp_group=pair))
    y_full, _ = model_only(x.clone(), packed_seq_params=PackedSeqParams(qkv_format="sbhd", cp_group=solo))
    out["per_group"] = {"cp": model_only.cp_auto_choice(model_only.cp_group), "pair": model_only.cp_auto_choice(pair),
                        "dy": (y_pair - y_full[idx2]).abs().max().item()}
    out["layer"] = {"method": results["auto"]["method"], "hook_calls": results["auto"]["hook_calls"],
                    "dy": (results["auto"]["y"] - results["chosen"]["y"]).abs().max().item(),
                    "ddx": (results["auto"]["dx"] - results["chosen"]["dx"]).abs().max().item(),
                    "dgrad": max((results["auto"]["grads"][n] - g).abs().max().item()
                                 for n, g in results["chosen"]["grads"].items())}
    out["mla"] = _mla_auto_vs_chosen(parallel_state.get_context_parallel_group(), path)
    out["log"] = list(tuner.log)
    parallel_state.destroy_model_parallel()
    return out


NAP_S, WINDOW_S = 0.005, 0.05


def _concurrent_timing(rank):
    """``time_concurrently`` on a nap of (rank + 1) x NAP_S: the wall-clock start of every call on this rank."""
    from layers.cp.calibration import time_concurrently

    starts = []

    def nap():
        starts.append(time.time())
        time.sleep(NAP_S * (rank + 1))
    (per_call,) = time_concurrently([nap], None, torch.device("cpu"), repeats=3, min_window=WINDOW_S)
    return {"per_call": per_call, "starts": starts}


def _mla_auto_vs_chosen(cp_group, path):
    """An MLA layer with cp_strategy="auto" against the same weights with the strategy it chose."""
    from tests.support.mla_layer import build_layer, make_config

    config = make_config(heads=4)
    config.hp_cp_calibration = path
    solo = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    torch.manual_seed(3)
    ys = {}
    auto = build_layer(config, solo, cp_group, cp_strategy="auto")
    T = 16
    idx = torch.tensor([t for c in (dist.get_rank(), 2 * P - 1 - dist.get_rank())
                        for t in range(c * T // (2 * P), (c + 1) * T // (2 * P))])
    x = torch.randn(T, 1, 32, generator=torch.Generator().manual_seed(4))[idx]
    ys["auto"] = auto(x)[0]
    strategy = auto.cp_auto_choice(cp_group)
    chosen = build_layer(config, solo, cp_group, cp_strategy=strategy)
    chosen.load_state_dict(auto.state_dict())
    ys["chosen"] = chosen(x)[0]
    return {"strategy": strategy, "dy": (ys["auto"] - ys["chosen"]).abs().max().item()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cp_auto") / "calibration.json")
    return run_distributed(_worker, P, path), path


def test_calibration_measures_then_reuses_the_file(ranks):
    results, path = ranks
    assert results[0]["source"].startswith("measured in")
    assert all(r["reload"] == f"loaded from {path}" for r in results)
    assert all(r["bad_file"] == "JSONDecodeError" for r in results)
    assert all(r["fits"] == results[0]["fits"] for r in results)       # max-reduced: one fit for all ranks
    assert sorted(results[0]["fits"]) == sorted(COLLECTIVES)
    for alpha, beta in results[0]["fits"].values():
        assert 0 <= alpha < 1.0 and 1e6 < beta and math.isfinite(alpha)
    assert all(r["sync"] == results[0]["sync"] for r in results)
    alpha, beta = results[0]["sync"]                  # straggler cost: s per synchronization, 1 / share of a phase
    assert 0 <= alpha < 0.1 and beta > 1.0
    assert " sync " in results[0]["calibration_line"] and "of the phase before it" in results[0]["calibration_line"]
    data = json.loads(open(path).read())
    key, pair_key = sorted(data, reverse=True)        # the CP group of 4, and the pairs of the per-group case
    assert key.startswith(f"P={P}|hosts=1x{P}|gloo|") and key.endswith(f"|{FORMAT}")
    assert pair_key.startswith("P=2|hosts=1x2|gloo|") and pair_key.endswith(f"|{FORMAT}")
    kernels = data[key]["kernels"]
    assert sorted(kernels["gdn/eager/K8/V8/float32"]) == ["augmented", "gemm", "op"]   # eager: the generic pass
    assert list(kernels["gdn/eager/K8/V8/float32/H4/HV4/hidden32/layer"]) == ["rest"]


def test_timing_runs_every_rank_at_once_and_takes_the_slowest(ranks):
    """Calibration timings: each window starts at a group barrier on every rank (without it rank 0, napping
    NAP_S against rank 3's 4 NAP_S, would run ahead by n x 3 NAP_S per window), holds the fewest calls n
    that make it last WINDOW_S on the slowest rank, and the result, per call, is the slowest rank's, identical
    everywhere."""
    results, _ = ranks
    runs = [r["concurrent"] for r in results]
    assert len({len(c["starts"]) for c in runs}) == 1
    n, rest = divmod(len(runs[0]["starts"]) - 2, 3)        # warm-up, sizing call, then 3 windows of n calls
    assert rest == 0 and n >= 2 and (n - 1) * P * NAP_S < WINDOW_S
    for w in range(3):
        starts = [c["starts"][2 + w * n] for c in runs]
        assert max(starts) - min(starts) < 0.02, (w, starts)
    assert len({c["per_call"] for c in runs}) == 1
    assert P * NAP_S <= runs[0]["per_call"] < 3 * P * NAP_S
    assert all("at least 2 ranks, got P=1" in r["solo"] for r in results)


def test_decision_is_rank_zeros_on_every_rank(ranks):
    results, _ = ranks
    # rank 0 sees cheap latency and chooses Ulysses; the others' calibration would forbid any communication
    assert {r["skewed"] for r in results} == {"ulysses"}
    assert {r["ctx"] for r in results} == {("ulysses", None, P)}


def test_layer_with_auto_equals_the_chosen_method(ranks):
    results, _ = ranks
    assert len({r["layer"]["method"] for r in results}) == 1
    assert results[0]["layer"]["method"][0] in ("p2p", "allgather", "grouped_allgather_p2p", "recursive_doubling",
                                                "ulysses")
    for r in results:
        assert r["layer"]["dy"] == 0 and r["layer"]["ddx"] == 0 and r["layer"]["dgrad"] == 0
        assert r["layer"]["hook_calls"] == 1          # the calibration runs touched no parameter gradient
    lines = [line for line in results[0]["log"] if line.startswith("[hp_megatron cp auto] GDN")]
    assert len(lines) == 4 and all("runner-up" in line and "ms fwd+bwd" in line for line in lines)
    measured, model_only, no_grad, pair = lines      # the default times the model's 3 best on the layer
    assert ", P=2: " in pair and "timed on the layer" not in pair
    assert " H=2 HV=2 " in no_grad and no_grad.endswith(f"ms -> {_label(results[0]['no_grad'])}")
    assert len({r["no_grad"] for r in results}) == 1
    timed = measured.split("; timed on the layer: ")[1]
    assert len(timed.split(", ")) == 3 and timed.endswith(f"ms -> {_label(results[0]['layer']['method'])}")
    assert "timed on the layer" not in model_only    # cp_auto_measure=0: the model's best
    model_best = model_only.split(", P=4: ")[1].split(" ")[0]
    assert _label(results[0]["model_only"]) == model_best and len({r["model_only"] for r in results}) == 1


def test_layer_with_auto_decides_per_cp_group(ranks):
    """A micro-batch on another CP group (megatron's hybrid CP) gets its own decision, valid at its size, and the
    layer computes there what it computes on one rank."""
    results, _ = ranks
    for r in results:
        per_group = r["per_group"]
        assert per_group["cp"] == r["model_only"] and per_group["pair"] is not None, per_group
        method, group_size, degree = per_group["pair"]
        assert group_size in (None, 1, 2) and degree in (None, 1, 2), per_group
        assert per_group["dy"] < 1e-5, per_group
    assert results[0]["per_group"]["pair"] == results[1]["per_group"]["pair"]


def _label(choice):
    method, group_size, degree = choice
    return Candidate(method, group_size, degree).label


def test_mla_with_auto_equals_the_chosen_strategy(ranks):
    results, _ = ranks
    assert len({r["mla"]["strategy"] for r in results}) == 1
    assert results[0]["mla"]["strategy"] in ("latent", "latent_ulysses", "expanded_ulysses")
    assert all(r["mla"]["dy"] == 0 for r in results)
    assert sum(line.startswith("[hp_megatron cp auto] MLA") for line in results[0]["log"]) == 1
