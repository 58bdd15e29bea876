"""TP x SP x CP of the GDN / KDA mixers on gloo ranks against the single-rank layer (TP=1, CP=1).

One spawn of 4 ranks runs every case: each rank builds the reference layer on its own (singleton groups) and
the parallel layer on the case's TP/CP groups (megatron order tp-cp-dp), both initialised from the default
seed, so matching outputs also show that initialisation does not depend on the layout. Each rank feeds its
shard of the same global input (CP layout, then sequence-parallel split) and compares its shard of the output
and input gradient with the reference; parameter gradients are summed over CP (and over TP for
sequence-parallel replicated weights), as megatron's DDP and grad finalization do, then gathered over TP into
global tensors and compared with the reference's.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.dist import rel_err, run_distributed

WORLD = 4
HIDDEN = 32
SEQ = 48
BATCH = 2
DOCS = (16, 8, 24)  # THD documents: each a multiple of 2 * CP for CP <= 4
# GDN's default A_init_range (1, 16) decays so fast that the A_log / dt_bias gradients are sums of tiny terms
# with heavy cancellation: there even the fp32 single-rank layer is 3.6e-4 away from an fp64 run (the CP runs
# are closer). A milder decay keeps the fp32 reference accurate to ~2e-5, so the 1e-4 bound tests the CP path.
DIMS = {"gdn": dict(num_key_heads=4, num_value_heads=8, key_head_dim=8, value_head_dim=8, A_init_range=(0.5, 2.0)),
        "kda": dict(num_key_heads=4, num_value_heads=4, key_head_dim=8, value_head_dim=8)}
OUT_TOL, GRAD_TOL = 1e-5, 1e-4
METHODS = ("p2p", "allgather", "grouped_allgather_p2p", "recursive_doubling", "ulysses")


def _cases():
    """(case id, dict(kind, tp, cp, sp, thd, options))."""
    cases = []

    def add(kind, tp, cp, sp, thd, packed_cp_group=False, **options):
        label = "-".join([kind, f"tp{tp}", f"cp{cp}"] + (["sp"] if sp else []) + (["thd"] if thd else ["bshd"])
                         + (["cp_group_in_packed_seq_params"] if packed_cp_group else [])
                         + [f"{k}={v}" for k, v in options.items()])
        cases.append((label, dict(kind=kind, tp=tp, cp=cp, sp=sp, thd=thd, packed_cp_group=packed_cp_group,
                                  options=options)))

    for kind in ("gdn", "kda"):
        add(kind, 2, 1, False, False)
        add(kind, 2, 1, True, False)
        add(kind, 2, 1, True, True)
        for method in METHODS:
            extra = {"cp_group_size": 2} if method == "grouped_allgather_p2p" else {}
            add(kind, 1, 2, False, False, cp_method=method, **extra)
            add(kind, 2, 2, True, False, cp_method=method, **extra)
            add(kind, 2, 2, False, True, cp_method=method, **extra)
        add(kind, 1, 4, False, False, cp_method="grouped_allgather_p2p", cp_group_size=2)
        add(kind, 1, 4, False, True, cp_method="p2p", cp_ulysses_degree=2)
        add(kind, 1, 4, False, False, cp_method="recursive_doubling")
        add(kind, 2, 2, False, False, cp_method="p2p", cp_layout="contiguous")
        add(kind, 2, 2, True, True, cp_method="allgather", cp_layout="contiguous")
        add(kind, 2, 2, False, True, packed_cp_group=True, cp_method="allgather")  # hybrid CP (mcore >= 0.16)
    return cases


CASES = _cases()

_GROUPS: dict = {}


def _groups(tp, cp):
    """This rank's (tp group, cp group) for a TP x CP layout in megatron's tp-cp-dp order (collective)."""
    if (tp, cp) not in _GROUPS:
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = {}
        for dp in range(world // (tp * cp)):
            for c in range(cp):
                ranks = [dp * tp * cp + c * tp + t for t in range(tp)]
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine["tp"] = group
            for t in range(tp):
                ranks = [dp * tp * cp + c * tp + t for c in range(cp)]
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine["cp"] = group
        _GROUPS[(tp, cp)] = (mine["tp"], mine["cp"])
    return _GROUPS[(tp, cp)]


def _cp_token_index(layout, cp, cp_rank, thd):
    """Indices of this CP rank's tokens along the global sequence (BSHD rows, or the packed THD stream)."""
    def zigzag(start, length):
        part = length // (2 * cp)
        return [start + i for c in (cp_rank, 2 * cp - 1 - cp_rank) for i in range(c * part, (c + 1) * part)]

    if layout == "contiguous":
        part = SEQ // cp
        return torch.arange(cp_rank * part, (cp_rank + 1) * part)
    if not thd:
        return torch.tensor(zigzag(0, SEQ))
    index, start = [], 0
    for length in DOCS:
        index += zigzag(start, length)
        start += length
    return torch.tensor(index)


def _config(tp, cp, sp):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
                             params_dtype=torch.float32, gradient_accumulation_fusion=False,
                             bias_dropout_fusion=False, tensor_model_parallel_size=tp, context_parallel_size=cp,
                             sequence_parallel=sp)


def _layer(kind, tp_group, cp_group, config, options):
    """Build with explicit process groups: ``pg_collection`` (megatron-core 0.15+) or ``model_comm_pgs`` (0.14)."""
    from megatron.core import process_groups_config as pgc

    from layers import GatedDeltaNet, KimiDeltaAttention

    cls = GatedDeltaNet if kind == "gdn" else KimiDeltaAttention
    if hasattr(pgc, "ProcessGroupCollection"):
        groups = {"pg_collection": pgc.ProcessGroupCollection(tp=tp_group, cp=cp_group)}
    else:
        groups = {"model_comm_pgs": pgc.ModelCommProcessGroups(tp=tp_group, cp=cp_group)}
    return cls(config, None, layer_number=3, **groups, **DIMS[kind], **options)


def _packed(thd, cp_group=None):
    """THD PackedSeqParams with global boundaries; ``cp_group`` set as megatron-core 0.16's hybrid CP does."""
    if not thd:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0] + torch.tensor(DOCS).cumsum(0).tolist(), dtype=torch.int32)
    extra = {} if cp_group is None else {"cp_group": cp_group, "local_cp_size": dist.get_world_size(cp_group)}
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(DOCS),
                           max_seqlen_kv=max(DOCS), **extra)


def _causal_mask(rows):
    """megatron's bool mask (True = masked) for query tokens at global positions ``rows``, all SEQ keys."""
    return (torch.arange(SEQ)[None, :] > rows[:, None])[None, None]


def _grads(layer):
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in layer.named_parameters()}


def _run_case(case):
    kind, tp, cp, sp, thd = case["kind"], case["tp"], case["cp"], case["sp"], case["thd"]
    options = case["options"]
    gen = torch.Generator().manual_seed(11)
    batch = 1 if thd else BATCH
    x = torch.randn(SEQ, batch, HIDDEN, generator=gen)
    grad_out = torch.randn(SEQ, batch, HIDDEN, generator=gen)
    packed = _packed(thd)

    solo = _groups(1, 1)
    ref = _layer(kind, *solo, _config(1, 1, False), {})
    x_ref = x.clone().requires_grad_(True)
    y_ref, _ = ref(x_ref, attention_mask=_causal_mask(torch.arange(SEQ)), packed_seq_params=packed)
    y_ref.backward(grad_out)
    ref_grads = ref.global_parts(_grads(ref))

    tp_group, cp_group = _groups(tp, cp)
    if case["packed_cp_group"]:  # the layer's own CP group is trivial; the batch brings the real one
        if "cp_group" not in getattr(_packed(True), "__dataclass_fields__", {}):
            return {"skipped": "PackedSeqParams has no cp_group before megatron-core 0.16"}
        packed = _packed(thd, cp_group)
        layer = _layer(kind, tp_group, _groups(tp, 1)[1], _config(tp, cp, sp), options)
    else:
        layer = _layer(kind, tp_group, cp_group, _config(tp, cp, sp), options)
    cp_index = _cp_token_index(options.get("cp_layout", "zigzag"), cp, dist.get_rank(cp_group), thd)
    index = cp_index.chunk(tp)[dist.get_rank(tp_group)] if sp else cp_index
    x_local = x[index].clone().requires_grad_(True)
    # megatron's causal mask for this CP rank's query rows (the layer checks it is causal, then ignores it)
    y_local, bias = layer(x_local, attention_mask=_causal_mask(cp_index), packed_seq_params=packed)
    assert bias is None
    y_local.backward(grad_out[index])

    grads = _grads(layer)
    for name, grad in grads.items():
        if cp > 1:
            dist.all_reduce(grad, group=cp_group)
        if sp and getattr(dict(layer.named_parameters())[name], "sequence_parallel", False):
            dist.all_reduce(grad, group=tp_group)
    par_grads = layer.global_parts(grads)
    assert sorted(par_grads) == sorted(ref_grads)
    return {"out": rel_err(y_local, y_ref[index]), "x_grad": rel_err(x_local.grad, x_ref.grad[index]),
            "param_grads": {n: rel_err(par_grads[n], ref_grads[n]) for n in ref_grads}}


def _worker(rank, world_size, case_list, checkpoint_dir):
    from megatron.core import parallel_state

    from hp_megatron.platform import apply_cpu_shims

    parallel_state.initialize_model_parallel(1, 1)  # megatron's global buffers (SP all-gather); groups are ours
    for layout in sorted({(1, 1)} | {(case["tp"], case["cp"]) for _, case in case_list}):
        _groups(*layout)  # collective: create every group up front, on every rank, in one order
    results = {}
    for label, case in case_list:
        apply_cpu_shims(2024)  # same torch.initial_seed() for both layers: the default init seed
        results[label] = _guarded(_run_case, case)
    from tests.layers.test_layers_checkpoint import checkpoint_round_trip

    results["checkpoint"] = _guarded(checkpoint_round_trip, rank, world_size, checkpoint_dir)
    parallel_state.destroy_model_parallel()
    return results


def _guarded(fn, *args):
    """Run one case; report its exception as a result so the spawn keeps serving the other cases."""
    try:
        return fn(*args)
    except Exception as err:
        import traceback

        return {"error": f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=8)}"}


_SPAWN: dict = {}


def spawn_results(tmp_path_factory):
    """The per-rank results of the one spawn serving this file and ``test_layers_checkpoint`` (cached)."""
    if "results" not in _SPAWN:
        checkpoint_dir = str(tmp_path_factory.mktemp("delta_mixer_checkpoint"))
        _SPAWN["results"] = run_distributed(_worker, WORLD, CASES, checkpoint_dir)
    return _SPAWN["results"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_results(tmp_path_factory)


@pytest.mark.parametrize("label", [label for label, _ in CASES])
def test_parallel_matches_single_rank(results, label):
    per_rank = [r[label] for r in results]
    errors = [r["error"] for r in per_rank if "error" in r]
    assert not errors, errors[0]
    if "skipped" in per_rank[0]:
        pytest.skip(per_rank[0]["skipped"])
    assert max(r["out"] for r in per_rank) <= OUT_TOL
    assert max(r["x_grad"] for r in per_rank) <= GRAD_TOL
    worst = {n: max(r["param_grads"][n] for r in per_rank) for n in per_rank[0]["param_grads"]}
    bad = {n: e for n, e in worst.items() if e > GRAD_TOL}
    assert not bad, bad
