"""DSAttention under TP, SP and CP on gloo ranks (P = 2: CP2 BSHD / THD, TP2 with and without SP; P = 4: TP2 x CP2
+ SP, BSHD and THD), with the indexer loss on (dense warm-up and sparse stage), equals the single-rank layer on the
same global input: output, input gradient, every main parameter's gradient summed over CP ranks, and the indexer's
gradients averaged over CP ranks (megatron's DDP averages over DP x CP; each rank's indexer loss is the mean over its
own queries) and over TP (replicated, ``average_gradients_across_tp_domain``). CP uses the latent all-gather (each
rank gathers the latent and the indexer keys); its bytes equal ``dsa_comm_bytes``.

Top-k is discontinuous: each case asserts on the single-rank run that the k-th and (k+1)-th indexer scores of every
query that sees more than k keys differ by more than 1e-4, so no layout can pick another token by rounding."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.dist import run_distributed_once, share_spawn
from tests.support.reference import rel_err

HIDDEN, TOPK = 32, 5


def _cases(world_size):
    if world_size == 2:
        return [dict(fmt="bshd", tp=1, sparse=True), dict(fmt="thd", tp=1, sparse=False),
                dict(fmt="bshd", tp=2, sp=True, sparse=False), dict(fmt="thd", tp=2, sp=False, sparse=True)]
    return [dict(fmt="bshd", tp=2, sp=True, sparse=True), dict(fmt="thd", tp=2, sp=False, sparse=False)]


def _case_id(case):
    return "-".join(f"{k}={v}" for k, v in case.items())


def _run_case(rank, world_size, groups, case):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection

    from layers.cp.accounting import CommStats
    from layers.cp.plan import local_seq_index
    from layers.mixers.mla.dsa import DSAttention, dsa_comm_bytes
    from layers.mixers.mla.layer import _tp_slice
    from tests.support.dsa_margin import recording_margins
    from tests.support.mla_layer import make_config, mla_submodules

    tp, sp = case["tp"], case.get("sp", False)
    tp_rank, cp_rank = rank % tp, rank // tp
    cp_size = world_size // tp
    fields = dict(rope_type="rope", dsa_indexer_n_heads=4, dsa_indexer_head_dim=8, dsa_indexer_topk=TOPK,
                  dsa_indexer_k_norm_epsilon=1e-6, dsa_indexer_loss_coeff=0.3,
                  dsa_indexer_use_sparse_loss=case["sparse"])

    def build(config, tp_group, cp_group):
        return DSAttention(config, mla_submodules(), layer_number=1,
                           pg_collection=ProcessGroupCollection(tp=tp_group, cp=cp_group), block_size=5)

    torch.manual_seed(11)
    ref = build(make_config(**fields), groups["self"], groups["self"])
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn_like(p))
    layer = build(make_config(tp=tp, sequence_parallel=sp, **fields), groups["tp"], groups["cp"])
    layer.comm_stats = CommStats()
    layer.load_state_dict({k: _tp_slice(k, v, tp_rank, tp) for k, v in ref.state_dict().items()})
    ref.train(), layer.train()

    if case["fmt"] == "bshd":
        B, T, cu, packed = 2, 16, None, None
    else:
        B, T = 1, 32
        cu = torch.tensor([0, 8, 24, 32], dtype=torch.int32)
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=16,
                                 max_seqlen_kv=16)
    torch.manual_seed(12)
    x = torch.randn(T, B, HIDDEN)
    grad_out = torch.randn(T, B, HIDDEN)

    with recording_margins() as margins:
        x_ref = x.clone().requires_grad_(True)
        out_ref, _ = ref(x_ref, packed_seq_params=packed)
    (out_ref * grad_out).sum().backward()

    idx = local_seq_index(cp_size, cp_rank, "zigzag", T, cu)
    x_loc, g_loc = x.index_select(0, idx), grad_out.index_select(0, idx)
    if sp:
        x_loc, g_loc = x_loc.chunk(tp, 0)[tp_rank], g_loc.chunk(tp, 0)[tp_rank]
    x_loc = x_loc.clone().requires_grad_(True)
    out, _ = layer(x_loc, packed_seq_params=packed)
    (out * g_loc).sum().backward()

    out_expect, xg_expect = out_ref.detach().index_select(0, idx), x_ref.grad.index_select(0, idx)
    if sp:
        out_expect, xg_expect = out_expect.chunk(tp, 0)[tp_rank], xg_expect.chunk(tp, 0)[tp_rank]
    result = {"margin": min(margins), "out": rel_err(out, out_expect), "x_grad": rel_err(x_loc.grad, xg_expect),
              "params": {}}
    ref_params = dict(ref.named_parameters())
    for name, p in layer.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=groups["cp"])
        if name.startswith("indexer."):
            assert getattr(p, "average_gradients_across_tp_domain", False)
            grad /= cp_size
            dist.all_reduce(grad, group=groups["tp"])
            grad /= tp
        elif sp and getattr(p, "sequence_parallel", False):
            dist.all_reduce(grad, group=groups["tp"])
        result["params"][name] = rel_err(grad, _tp_slice(name, ref_params[name].grad, tp_rank, tp))
    if cp_size > 1:
        closed = dsa_comm_bytes(world_size=cp_size, tokens_per_rank=B * T // cp_size, qk_pos_emb_head_dim=4,
                                kv_lora_rank=12, index_head_dim=8, element_size=4)
        stats = layer.comm_stats
        result["bytes"] = {phase: (stats.totals(phase=phase)["bytes_sent"], closed[phase])
                           for phase in ("forward", "backward")}
    return result


def _worker(rank, world_size, cases):
    from hp_megatron.platform import apply_cpu_shims

    apply_cpu_shims(0)
    from megatron.core import parallel_state

    parallel_state._set_global_memory_buffer()
    try:
        singles = [dist.new_group([r]) for r in range(world_size)]
        by_tp = {}
        for tp in sorted({c["tp"] for c in cases}):
            tp_groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world_size, tp)]
            cp_groups = [dist.new_group(list(range(t, world_size, tp))) for t in range(tp)]
            by_tp[tp] = {"self": singles[rank], "tp": tp_groups[rank // tp], "cp": cp_groups[rank % tp]}
        return [_run_case(rank, world_size, by_tp[c["tp"]], c) for c in cases]
    finally:
        parallel_state.destroy_model_parallel()


for _P in (2, 4):
    share_spawn(_worker, (_P,), _cases(_P))

PARAMS = [(P, i, c) for P in (2, 4) for i, c in enumerate(_cases(P))]


@pytest.mark.parametrize("world_size,index,case", PARAMS, ids=[f"P{P}-{_case_id(c)}" for P, _, c in PARAMS])
def test_parallel_equals_single_rank(world_size, index, case):
    for rank, per_rank in enumerate(run_distributed_once(_worker, world_size, _cases(world_size))):
        res = per_rank[index]
        assert res["margin"] > 1e-4, (rank, res["margin"])
        assert res["out"] <= 1e-5, (rank, res)
        assert res["x_grad"] <= 1e-4, (rank, res)
        bad = {k: v for k, v in res["params"].items() if not v <= 1e-4}
        assert not bad, (rank, bad)
        for phase, (sent, closed) in res.get("bytes", {}).items():
            assert sent == closed, (rank, phase, sent, closed)
