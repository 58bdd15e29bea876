"""Distributed checkpoints of the GDN / KDA mixers: save under TP2 x CP2 (+SP), load under TP1, same outputs.

Runs inside the spawn of ``test_layers_delta_parallel`` (one set of 4 gloo ranks serves both files):
``checkpoint_round_trip`` (tests/support/delta_layer_cases.py) builds both layers through megatron-core's
``parallel_state`` (TP=2, CP=2, the path a Megatron model takes), records their outputs on this rank's shard of a global
input, saves them with ``dist_checkpointing``, re-initialises megatron with TP=1, CP=1 (DP=4), builds fresh layers with
other initial weights, loads the checkpoint and runs the full input.
"""
from __future__ import annotations

import pytest

from tests.support.delta_layer_cases import DIMS, HIDDEN, KINDS, spawn_results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
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
