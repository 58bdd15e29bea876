"""GDN / KDA mixers under TP x SP x CP on gloo ranks against the single-rank layer, and their distributed checkpoint
round trip: the cases, the per-rank case runner and the one 4-rank spawn that serves tests/layers (parallel
equivalence, checkpoints, gradient accumulation: ``tp_replicated_cases``); tests/backends runs :func:`run_case`
with backend="triton".

Each rank builds the reference layer on its own (singleton groups) and the parallel layer on the case's TP/CP
groups (megatron order tp-cp-dp), both initialised from the default seed, so matching outputs also show that
initialisation does not depend on the layout. :func:`checkpoint_round_trip` saves both layers under TP2 x CP2
(+SP) through megatron-core's ``parallel_state`` and ``dist_checkpointing`` and loads them under TP1.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tests.support import tp_replicated_cases
from tests.support.dist import run_distributed
from tests.support.reference import rel_err

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
# half of DIMS' heads, GDN keeping GVA: the triton backend's cases through Triton's interpreter, whose cost grows with
# the programs of each kernel grid (tests/backends, tests/layers/test_layers_recompute.py)
HALF_HEADS = {"gdn": dict(num_key_heads=2, num_value_heads=4), "kda": dict(num_key_heads=2, num_value_heads=2)}
OUT_TOL, GRAD_TOL = 1e-5, 1e-4
KINDS = ("gdn", "kda")
METHODS = ("p2p", "allgather", "grouped_allgather_p2p", "recursive_doubling", "ulysses")


def _cases():
    """(case id, dict(kind, tp, cp, sp, thd, options))."""
    cases = []

    def add(kind, tp, cp, sp, thd, packed_cp_group=False, dims=None, **options):
        label = "-".join([kind, f"tp{tp}", f"cp{cp}"] + (["sp"] if sp else []) + (["thd"] if thd else ["bshd"])
                         + (["cp_group_in_packed_seq_params"] if packed_cp_group else [])
                         + [f"{k}={v}" for k, v in {**(dims or {}), **options}.items()])
        cases.append((label, dict(kind=kind, tp=tp, cp=cp, sp=sp, thd=thd, packed_cp_group=packed_cp_group,
                                  options=options, dims=dims or {})))

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
    # OLMo-Hybrid's GDN: beta = 2 sigmoid(b) with K != V, under a state-passing method and Ulysses
    olmo = dict(allow_neg_eigval=True, value_head_dim=16)
    add("gdn", 2, 2, True, True, dims=olmo, cp_method="p2p")
    add("gdn", 1, 2, False, False, dims=olmo, cp_method="ulysses")
    # Ling 3.0's KDA: full-rank gates (in_proj parts) with the safe gate
    add("kda", 2, 2, True, True, dims=dict(full_rank_gates=True, safe_gate=True, lower_bound=-5.0), cp_method="p2p")
    return cases


CASES = _cases()

_GROUPS: dict = {}


def groups(tp, cp):
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


def cp_token_index(layout, cp, cp_rank, thd):
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


def layer_config(tp, cp, sp):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
                             params_dtype=torch.float32, gradient_accumulation_fusion=False,
                             bias_dropout_fusion=False, tensor_model_parallel_size=tp, context_parallel_size=cp,
                             sequence_parallel=sp)


def build_layer(kind, tp_group, cp_group, config, options):
    """Build with explicit process groups (``pg_collection``)."""
    from megatron.core import process_groups_config as pgc

    from layers import GatedDeltaNet, KimiDeltaAttention

    cls = GatedDeltaNet if kind == "gdn" else KimiDeltaAttention
    groups = {"pg_collection": pgc.ProcessGroupCollection(tp=tp_group, cp=cp_group)}
    return cls(config, None, layer_number=3, **groups, **{**DIMS[kind], **options})


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


def run_case(case):
    kind, tp, cp, sp, thd = case["kind"], case["tp"], case["cp"], case["sp"], case["thd"]
    options = case["options"]
    gen = torch.Generator().manual_seed(11)
    batch = 1 if thd else BATCH
    x = torch.randn(SEQ, batch, HIDDEN, generator=gen)
    grad_out = torch.randn(SEQ, batch, HIDDEN, generator=gen)
    packed = _packed(thd)

    dims = case.get("dims", {})  # head counts / dims replacing DIMS[kind] in both layers
    solo = groups(1, 1)
    ref = build_layer(kind, *solo, layer_config(1, 1, False), dict(dims))
    x_ref = x.clone().requires_grad_(True)
    y_ref, _ = ref(x_ref, attention_mask=_causal_mask(torch.arange(SEQ)), packed_seq_params=packed)
    y_ref.backward(grad_out)
    ref_grads = ref.global_parts(_grads(ref))

    tp_group, cp_group = groups(tp, cp)
    if case["packed_cp_group"]:  # the layer's own CP group is trivial; the batch brings the real one
        if "cp_group" not in getattr(_packed(True), "__dataclass_fields__", {}):
            return {"skipped": "PackedSeqParams has no cp_group before megatron-core 0.16"}
        packed = _packed(thd, cp_group)
        layer = build_layer(kind, tp_group, groups(tp, 1)[1], layer_config(tp, cp, sp), {**dims, **options})
    else:
        layer = build_layer(kind, tp_group, cp_group, layer_config(tp, cp, sp), {**dims, **options})
    cp_index = cp_token_index(options.get("cp_layout", "zigzag"), cp, dist.get_rank(cp_group), thd)
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
        groups(*layout)  # collective: create every group up front, on every rank, in one order
    results = {}
    for label, case in case_list:
        apply_cpu_shims(2024)  # same torch.initial_seed() for both layers: the default init seed
        results[label] = _guarded(run_case, case)
    results["checkpoint"] = _guarded(checkpoint_round_trip, rank, world_size, checkpoint_dir)
    results["tp_replicated"] = tp_replicated_cases.run_all()
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
    """The per-rank results of the one spawn serving tests/layers/test_layers_delta_parallel.py (each case of
    ``CASES`` by label) and test_layers_checkpoint.py (``"checkpoint"``); cached in this process."""
    if "results" not in _SPAWN:
        checkpoint_dir = str(tmp_path_factory.mktemp("delta_mixer_checkpoint"))
        _SPAWN["results"] = run_distributed(_worker, WORLD, CASES, checkpoint_dir)
    return _SPAWN["results"]


def checkpoint_round_trip(rank, world_size, directory, tp=2, cp=2):
    """Per-rank results: output and weight differences after the TP x CP (+SP) -> TP1 round trip."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    from hp_megatron.platform import apply_cpu_shims

    from layers import GatedDeltaNet, KimiDeltaAttention

    classes = {"gdn": GatedDeltaNet, "kda": KimiDeltaAttention}
    x = torch.randn(SEQ, 2, HIDDEN, generator=torch.Generator().manual_seed(5))

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, 1, context_parallel_size=cp)
    apply_cpu_shims(31)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    index = cp_token_index("zigzag", cp, parallel_state.get_context_parallel_rank(), False).chunk(tp)[tp_rank]
    saved = {k: classes[k](layer_config(tp, cp, tp > 1), None, layer_number=4, **DIMS[k]) for k in KINDS}
    saved_out = {k: layer(x[index])[0].detach() for k, layer in saved.items()}
    saved_parts = {k: layer.global_parts() for k, layer in saved.items()}
    sharded = {}
    for kind, layer in saved.items():
        sharded.update(layer.sharded_state_dict(prefix=f"{kind}."))
    dist_checkpointing.save(sharded, directory)
    dist.barrier()

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)
    apply_cpu_shims(32)
    loaded_layers = {k: classes[k](layer_config(1, 1, False), None, layer_number=4, init_seed=999, **DIMS[k])
                     for k in KINDS}
    before = {k: layer.global_parts() for k, layer in loaded_layers.items()}
    sharded = {}
    for kind, layer in loaded_layers.items():
        sharded.update(layer.sharded_state_dict(prefix=f"{kind}."))
    state = dist_checkpointing.load(sharded, directory)
    results = {}
    for kind, layer in loaded_layers.items():
        layer.load_state_dict({k[len(kind) + 1:]: v for k, v in state.items() if k.startswith(f"{kind}.")})
        parts = layer.global_parts()
        out = layer(x)[0].detach()
        results[kind] = {
            "out": rel_err(out[index], saved_out[kind]),
            "weights_max_abs": max(float((parts[n] - saved_parts[kind][n]).abs().max()) for n in parts),
            "weights_changed": max(float((before[kind][n] - saved_parts[kind][n]).abs().max())
                                   for n in parts if n != "out_norm.weight"),
        }
    results["saved_shapes"] = {k: tuple(v.global_shape)
                               for k, v in dist_checkpointing.load_tensors_metadata(directory).items()}
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)
    return results
