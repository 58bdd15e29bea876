"""MLA context parallelism on gloo ranks: every strategy (P = 2, 4; BSHD rows and packed THD documents in
Megatron's zigzag layout; TP x CP with sequence parallelism) equals the single-rank layer on the same global
input (output, input gradient and every parameter gradient summed over CP ranks), and the bytes each rank
moves equal the closed forms of ``layers.cp.mla.mla_comm_bytes``; one case with Ling 3.0's output gate. One spawn per
world size serves all cases."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.dist import run_distributed_once, share_spawn
from tests.support.reference import rel_err

STRATEGIES = ("latent", "latent_ulysses", "expanded_ulysses")
HIDDEN = 32


def _cases(world_size):
    cases = [dict(strategy=s, fmt=f, tp=1, q_lora=16) for s in STRATEGIES for f in ("bshd", "thd")]
    cases.append(dict(strategy="latent", fmt="bshd", tp=1, q_lora=None, heads=3))     # any head count
    if world_size == 2:                                  # TP = 2 without CP (with and without SP)
        cases += [dict(strategy="latent", fmt="bshd", tp=2, q_lora=16, sp=True),
                  dict(strategy="latent", fmt="thd", tp=2, q_lora=None, sp=False)]
    if world_size == 4:
        cases += [dict(strategy="latent_ulysses", fmt="bshd", tp=2, q_lora=16, sp=True),
                  dict(strategy="latent", fmt="thd", tp=2, q_lora=None, sp=False),
                  dict(strategy="expanded_ulysses", fmt="thd", tp=2, q_lora=16, sp=True),
                  # Ling 3.0's head-wise output gate
                  dict(strategy="latent", fmt="thd", tp=2, q_lora=None, sp=True, output_gate=True)]
    return cases


def _case_id(case):
    return "-".join(f"{k}={v}" for k, v in case.items())


def _tp_shard(name, tensor, tp_rank, tp):
    from layers.mixers.mla.layer import _tp_slice

    return _tp_slice(name, tensor, tp_rank, tp)


def _run_case(rank, world_size, groups, case):
    from megatron.core.packed_seq_params import PackedSeqParams
    from tests.support.mla_layer import build_layer, make_config

    from layers.cp.accounting import CommStats
    from layers.cp.mla import mla_comm_bytes
    from layers.cp.plan import local_seq_index

    tp, sp = case["tp"], case.get("sp", False)
    heads = case.get("heads", 4)
    tp_rank, cp_rank = rank % tp, rank // tp
    cp_size = world_size // tp
    config = make_config(q_lora_rank=case["q_lora"], heads=heads, tp=tp, sequence_parallel=sp)
    ref_config = make_config(q_lora_rank=case["q_lora"], heads=heads)
    torch.manual_seed(11)
    gate = {"output_gate": True} if case.get("output_gate") else {}
    ref = build_layer(ref_config, groups["self"], groups["self"], **gate)
    with torch.no_grad():
        for p in ref.parameters():                      # norms too, so their gradients are exercised
            p.add_(0.1 * torch.randn_like(p))
    layer = build_layer(config, groups["tp"], groups["cp"], cp_strategy=case["strategy"], **gate)
    layer.comm_stats = CommStats()
    layer.load_state_dict({k: _tp_shard(k, v, tp_rank, tp) for k, v in ref.state_dict().items()})

    if case["fmt"] == "bshd":
        B, T, cu = 2, 16, None
        packed = None
    else:
        B, T = 1, 32
        cu = torch.tensor([0, 8, 24, 32], dtype=torch.int32)
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=16,
                                 max_seqlen_kv=16)
    torch.manual_seed(12)
    x = torch.randn(T, B, HIDDEN)
    grad_out = torch.randn(T, B, HIDDEN)

    x_ref = x.clone().requires_grad_(True)
    out_ref, _ = ref(x_ref, packed_seq_params=packed)
    (out_ref * grad_out).sum().backward()

    idx = local_seq_index(cp_size, cp_rank, "zigzag", T, cu)
    x_loc = x.index_select(0, idx)
    g_loc = grad_out.index_select(0, idx)
    if sp:                                              # sequence parallel: this TP rank's slice of the CP shard
        x_loc, g_loc = x_loc.chunk(tp, 0)[tp_rank], g_loc.chunk(tp, 0)[tp_rank]
    x_loc = x_loc.clone().requires_grad_(True)
    out, _ = layer(x_loc, packed_seq_params=packed)
    (out * g_loc).sum().backward()

    out_expect, xg_expect = out_ref.detach().index_select(0, idx), x_ref.grad.index_select(0, idx)
    if sp:
        out_expect, xg_expect = out_expect.chunk(tp, 0)[tp_rank], xg_expect.chunk(tp, 0)[tp_rank]
    result = {"out": rel_err(out, out_expect), "x_grad": rel_err(x_loc.grad, xg_expect), "params": {}}
    ref_params = dict(ref.named_parameters())
    for name, p in layer.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=groups["cp"])                       # DDP sums over DP x CP
        if sp and getattr(p, "sequence_parallel", False):
            dist.all_reduce(grad, group=groups["tp"])                   # megatron all-reduces SP norm grads
        expect = _tp_shard(name, ref_params[name].grad, tp_rank, tp)
        result["params"][name] = rel_err(grad, expect)

    stats = layer.comm_stats
    closed = mla_comm_bytes(case["strategy"], world_size=cp_size, tokens_per_rank=B * T // cp_size,
                            heads=heads // tp, qk_head_dim=config.qk_head_dim,
                            qk_pos_emb_head_dim=config.qk_pos_emb_head_dim, v_head_dim=config.v_head_dim,
                            kv_lora_rank=config.kv_lora_rank, element_size=4)
    result["bytes"] = {phase: (stats.totals(phase=phase)["bytes_sent"], stats.totals(phase=phase)["bytes_received"],
                               closed[phase]) for phase in ("forward", "backward")}
    return result


def _worker(rank, world_size, cases):
    from hp_megatron.platform import apply_cpu_shims

    apply_cpu_shims(0)
    from megatron.core import parallel_state

    parallel_state._set_global_memory_buffer()     # sequence-parallel linears all-gather into it (freed below)
    try:
        return _run_cases(rank, world_size, cases)
    finally:
        parallel_state.destroy_model_parallel()


def _run_cases(rank, world_size, cases):
    singles = [dist.new_group([r]) for r in range(world_size)]
    groups_by_tp = {}
    for tp in sorted({c["tp"] for c in cases}):
        tp_groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world_size, tp)]
        cp_groups = [dist.new_group(list(range(t, world_size, tp))) for t in range(tp)]
        groups_by_tp[tp] = {"self": singles[rank], "tp": tp_groups[rank // tp], "cp": cp_groups[rank % tp]}
    return [_run_case(rank, world_size, groups_by_tp[c["tp"]], c) for c in cases]


for _P in (2, 4):  # one spawn per P shared with the other CP modules (tests/support/dist.py)
    share_spawn(_worker, (_P,), _cases(_P))


def _results(world_size):
    return run_distributed_once(_worker, world_size, _cases(world_size))


PARAMS = [(P, i, c) for P in (2, 4) for i, c in enumerate(_cases(P))]


@pytest.mark.parametrize("world_size,index,case", PARAMS, ids=[f"P{P}-{_case_id(c)}" for P, _, c in PARAMS])
def test_cp_equals_single_rank(world_size, index, case):
    for rank, per_rank in enumerate(_results(world_size)):
        res = per_rank[index]
        assert res["out"] <= 1e-5, (rank, res)
        assert res["x_grad"] <= 1e-4, (rank, res)
        bad = {k: v for k, v in res["params"].items() if not v <= 1e-4}
        assert not bad, (rank, bad)


@pytest.mark.parametrize("world_size,index,case", PARAMS, ids=[f"P{P}-{_case_id(c)}" for P, _, c in PARAMS])
def test_cp_bytes_match_closed_forms(world_size, index, case):
    for rank, per_rank in enumerate(_results(world_size)):
        for phase, (sent, received, closed) in per_rank[index]["bytes"].items():
            assert sent == received == closed, (rank, phase, sent, received, closed)


def test_latent_moves_10x_less_than_ring_for_deepseek_v3():
    from layers.cp.mla import mla_comm_bytes
    from tests.support.mla_layer import ring_comm_bytes

    dims = dict(heads=128, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, kv_lora_rank=512)
    for P in (2, 8, 64):
        latent = mla_comm_bytes("latent", world_size=P, tokens_per_rank=4096, **dims)
        ring = ring_comm_bytes(world_size=P, tokens_per_rank=4096, **dims)
        assert ring["forward"] >= 10 * latent["forward"]


def test_strategy_errors():
    from layers.cp.mla import check_strategy, mla_comm_bytes

    with pytest.raises(ValueError, match="strategy"):
        check_strategy("ring_attention")
    with pytest.raises(ValueError, match="strategy"):
        mla_comm_bytes("bogus", world_size=2, tokens_per_rank=4, heads=2, qk_head_dim=2, qk_pos_emb_head_dim=2,
                       v_head_dim=2, kv_lora_rank=2)
