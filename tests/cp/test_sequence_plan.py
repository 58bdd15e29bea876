"""One sequence plan per micro-batch: the data slicer and every mixer agree token by token.

Random document lengths (1 and odd lengths included; zigzag pads each document to a multiple of 2P as megatron's
``cu_seqlens_q_padded`` does), P in {2, 3, 4}, both layouts. Without processes: the slicer's positions are the
plan's, every rank's tokens form a permutation of the stream, the gather order inverts it, and the plan is cached
on the micro-batch. One spawn of 4 gloo ranks: GDN, KDA, MLA and the softmax core attention run on the slicer's
shards under CP and equal their single-rank run sliced by the slicer (P = 3 runs on ranks 0-2).
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from tests.support.dist import share_spawn
from tests.support.helpers import FakeGroup
from tests.support.reference import rel_err

WORLD = 4
HIDDEN = 16
TOL = 1e-5


def _documents(P: int, layout: str, seed: int):
    """(real lengths, padded cu_seqlens [N+1]): lengths 1, odd and random; padded per the layout's constraint."""
    rng = random.Random(seed)
    lengths = [1, 2 * rng.randint(1, 4) + 1] + [rng.randint(1, 9) for _ in range(rng.randint(1, 3))]
    rng.shuffle(lengths)
    if layout == "zigzag":
        padded = [-(-n // (2 * P)) * 2 * P for n in lengths]
    else:   # contiguous: only the stream length must divide by P; pad the last document
        padded = list(lengths)
        padded[-1] += -sum(padded) % P
    cu = torch.tensor([0] + torch.tensor(padded).cumsum(0).tolist(), dtype=torch.int32)
    return lengths, cu


def _packed(cu):
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                           cu_seqlens_kv_padded=cu, max_seqlen_q=int((cu[1:] - cu[:-1]).max()),
                           max_seqlen_kv=int((cu[1:] - cu[:-1]).max()))


CASES = [(P, layout, fmt, seed) for P in (2, 3, 4) for layout in ("zigzag", "contiguous") for fmt in ("thd", "bshd")
         for seed in (0, 1)]


@pytest.mark.parametrize("P,layout,fmt,seed", CASES)
def test_slicer_is_the_plan(P, layout, fmt, seed):
    from hp_megatron.data import get_batch_on_this_cp_rank
    from layers.cp.plan import build_chain_plan
    from layers.cp.sequence import plan_for_batch

    if fmt == "thd":
        _, cu = _documents(P, layout, seed)
        T, packed = int(cu[-1]), _packed(cu)
    else:
        cu, T, packed = None, 2 * P * (seed + 2), None
    tokens = torch.arange(T).view(1, T)
    seen = []
    for r in range(P):
        got = get_batch_on_this_cp_rank({"tokens": tokens}, packed, cp_group=FakeGroup(P, r), layout=layout)["tokens"]
        plan = plan_for_batch(packed, P, r, layout, T)
        assert got.flatten().tolist() == plan.local_index.tolist()
        # the state engine's chain plan places the same tokens in the same order
        assert build_chain_plan(P, r, layout, batch=1, seq_len=T, cu_seqlens=cu).seq_index.tolist() \
            == plan.local_index.tolist()
        if packed is not None:   # cached on the micro-batch: every later layer gets this very object
            assert plan_for_batch(packed, P, r, layout, T) is plan
        seen += got.flatten().tolist()
    assert sorted(seen) == list(range(T))
    assert plan.gathered_index.tolist() == seen
    assert plan.gathered_index[plan.to_global].tolist() == list(range(T))


def test_plan_rejects_what_the_model_rejects():
    from layers.cp.sequence import sequence_plan

    with pytest.raises(ValueError, match="strictly increasing"):
        sequence_plan(2, 0, "zigzag", 8, torch.tensor([0, 4, 4, 8]))
    with pytest.raises(ValueError, match=r"\(1, 6\)"):
        sequence_plan(2, 0, "zigzag", 10, torch.tensor([0, 4, 10]))
    packed = _packed(torch.tensor([0, 4, 8], dtype=torch.int32))
    packed.cu_seqlens_kv_padded = torch.tensor([0, 2, 8], dtype=torch.int32)
    from layers.cp.sequence import packed_cu_seqlens

    with pytest.raises(ValueError, match="identical query and key document boundaries"):
        packed_cu_seqlens(packed)


# ------------------------------------------------------------------------------------------- mixers on ranks
def _delta_layer(kind, cp_group, solo, layout):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    from layers import GatedDeltaNet, KimiDeltaAttention

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, use_cpu_initialization=True,
                               params_dtype=torch.float32, gradient_accumulation_fusion=False,
                               bias_dropout_fusion=False)
    cls = GatedDeltaNet if kind == "gdn" else KimiDeltaAttention
    return cls(config, None, layer_number=2, pg_collection=ProcessGroupCollection(tp=solo, cp=cp_group),
               num_key_heads=2, key_head_dim=8, cp_layout=layout, init_seed=5)


def _mla_layer(cp_group, solo, layout):
    from tests.support.mla_layer import build_layer, make_config

    torch.manual_seed(7)
    return build_layer(make_config(hidden=HIDDEN, heads=2), solo, cp_group, cp_strategy="latent", cp_layout=layout)


def _attention(cp_group, solo, layout):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    from layers.mixers.attention.context_parallel import ContextParallelDotProductAttention

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, kv_channels=4,
                               attention_dropout=0.0, use_cpu_initialization=True)
    return ContextParallelDotProductAttention(config, 1, layout=layout,
                                              pg_collection=ProcessGroupCollection(tp=solo, cp=cp_group))


def _mixer_case(P, layout, fmt, seed, cp_group, solo):
    from hp_megatron.data import get_batch_on_this_cp_rank

    if fmt == "thd":
        _, cu = _documents(P, layout, seed)
        T, B = int(cu[-1]), 1
    else:
        cu, T, B = None, 4 * P, 2
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, B, HIDDEN, generator=gen)
    qkv = torch.randn(3, T, B, 4, 4, generator=gen)
    # fresh PackedSeqParams per run, as every micro-batch brings its own
    packed = (lambda: _packed(cu)) if cu is not None else (lambda: None)
    local = packed()
    # the data slicer's shard (batch-first tensors, as the data path holds them)
    x_loc = get_batch_on_this_cp_rank({"x": x.transpose(0, 1)}, local, cp_group=cp_group, layout=layout)["x"]
    x_loc = x_loc.transpose(0, 1)
    qkv_loc = [t.transpose(0, 1) for t in get_batch_on_this_cp_rank(
        {n: t.transpose(0, 1) for n, t in zip("qkv", qkv)}, local, cp_group=cp_group, layout=layout).values()]
    idx = get_batch_on_this_cp_rank({"i": torch.arange(T).view(1, T)}, local, cp_group=cp_group,
                                    layout=layout)["i"].flatten()
    out = {}
    for name, build in (("gdn", lambda g: _delta_layer("gdn", g, solo, layout)),
                        ("kda", lambda g: _delta_layer("kda", g, solo, layout)),
                        ("mla", lambda g: _mla_layer(g, solo, layout))):
        ref, _ = build(solo)(x, packed_seq_params=packed())
        got, _ = build(cp_group)(x_loc, packed_seq_params=local)
        out[name] = rel_err(got, ref.index_select(0, idx))
    squeeze = (lambda t: t.squeeze(1)) if cu is not None else (lambda t: t)   # THD core attention: [t, n, d]
    ref = _attention(solo, solo, layout)(*map(squeeze, qkv), None, packed_seq_params=packed())
    got = _attention(cp_group, solo, layout)(*map(squeeze, qkv_loc), None, packed_seq_params=local)
    out["attention"] = rel_err(got, ref.index_select(0, idx))
    return out


def _worker(rank, world_size):
    from hp_megatron.platform import apply_cpu_shims

    apply_cpu_shims(2024)
    groups = {P: dist.new_group(list(range(P))) for P in (2, 3)}    # collective, every rank, one order
    groups[4] = dist.group.WORLD
    solo = {r: dist.new_group([r]) for r in range(world_size)}[rank]
    results = {}
    for P, layout, fmt, seed in CASES:
        if seed or rank >= P:
            continue
        try:
            results[(P, layout, fmt)] = _mixer_case(P, layout, fmt, seed, groups[P], solo)
        except Exception as err:   # report, keep serving the other cases
            results[(P, layout, fmt)] = f"{type(err).__name__}: {err}"
    return results


_results = share_spawn(_worker, (WORLD,))  # one spawn for the CP modules (tests/support/dist.py)
MIXER_CASES = sorted({(P, layout, fmt) for P, layout, fmt, _ in CASES})


@pytest.mark.parametrize("P,layout,fmt", MIXER_CASES)
def test_every_mixer_agrees_with_the_slicer(P, layout, fmt):
    results = _results(WORLD)
    for rank in range(P):
        res = results[rank][(P, layout, fmt)]
        assert isinstance(res, dict), res
        assert max(res.values()) < TOL, (rank, res)
