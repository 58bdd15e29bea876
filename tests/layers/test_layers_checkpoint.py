"""Distributed checkpoints of the GDN / KDA mixers: save under TP2 x CP2 (+SP), load under TP1, same outputs.

Runs inside the spawn of ``test_layers_delta_parallel`` (one set of 4 gloo ranks serves both files):
:func:`checkpoint_round_trip` builds both layers through megatron-core's ``parallel_state`` (TP=2, CP=2, the
path a Megatron model takes), records their outputs on this rank's shard of a global input, saves them with
``dist_checkpointing``, re-initialises megatron with TP=1, CP=1 (DP=4), builds fresh layers with other initial
weights, loads the checkpoint and runs the full input.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.dist import rel_err

KINDS = ("gdn", "kda")


def checkpoint_round_trip(rank, world_size, directory, tp=2, cp=2):
    """Per-rank results: output and weight differences after the TP x CP (+SP) -> TP1 round trip."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    from hp_megatron.platform import apply_cpu_shims
    from tests.layers.test_layers_delta_parallel import DIMS, HIDDEN, SEQ, _config, _cp_token_index

    from layers import GatedDeltaNet, KimiDeltaAttention

    classes = {"gdn": GatedDeltaNet, "kda": KimiDeltaAttention}
    x = torch.randn(SEQ, 2, HIDDEN, generator=torch.Generator().manual_seed(5))

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, 1, context_parallel_size=cp)
    apply_cpu_shims(31)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    index = _cp_token_index("zigzag", cp, parallel_state.get_context_parallel_rank(), False).chunk(tp)[tp_rank]
    saved = {k: classes[k](_config(tp, cp, tp > 1), None, layer_number=4, **DIMS[k]) for k in KINDS}
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
    loaded_layers = {k: classes[k](_config(1, 1, False), None, layer_number=4, init_seed=999, **DIMS[k])
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


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tests.layers.test_layers_delta_parallel import spawn_results

    per_rank = spawn_results(tmp_path_factory)
    errors = [r["checkpoint"]["error"] for r in per_rank if "error" in r["checkpoint"]]
    assert not errors, errors[0]
    return [r["checkpoint"] for r in per_rank]


@pytest.mark.parametrize("kind", KINDS)
def test_tp2_cp2_checkpoint_loads_under_tp1(results, kind):
    for rank_result in results:
        r = rank_result[kind]
        assert r["weights_changed"] > 0  # the fresh layer started from other weights
        assert r["weights_max_abs"] == 0.0
        assert r["out"] <= 1e-5


def test_fused_parameters_are_saved_as_logical_parts(results):
    """Fused parameters are stored as their global logical parts (megatron-core GatedDeltaNet's key scheme)."""
    from tests.layers.test_layers_delta_parallel import DIMS, HIDDEN

    shapes = results[0]["saved_shapes"]
    g, k = DIMS["gdn"], DIMS["kda"]
    gdn_qk, gdn_v = g["num_key_heads"] * g["key_head_dim"], g["num_value_heads"] * g["value_head_dim"]
    expected = {
        "gdn.in_proj.weight.query": (gdn_qk, HIDDEN), "gdn.in_proj.weight.key": (gdn_qk, HIDDEN),
        "gdn.in_proj.weight.value": (gdn_v, HIDDEN), "gdn.in_proj.weight.z": (gdn_v, HIDDEN),
        "gdn.in_proj.weight.beta": (g["num_value_heads"], HIDDEN),
        "gdn.in_proj.weight.alpha": (g["num_value_heads"], HIDDEN),
        "gdn.conv1d.weight.query": (gdn_qk, 1, 4), "gdn.conv1d.weight.value": (gdn_v, 1, 4),
        "gdn.A_log": (g["num_value_heads"],), "gdn.out_proj.weight": (HIDDEN, gdn_v),
        "kda.gate_down_proj.weight.forget": (k["value_head_dim"], HIDDEN),
        "kda.dt_bias": (k["num_value_heads"] * k["key_head_dim"],),
        "kda.forget_gate_up_proj.weight": (k["num_value_heads"] * k["key_head_dim"], k["value_head_dim"]),
    }
    for key, shape in expected.items():
        assert shapes.get(key) == shape, (key, shapes.get(key))
    assert "gdn.in_proj.weight" not in shapes and "gdn.conv1d.weight" not in shapes
