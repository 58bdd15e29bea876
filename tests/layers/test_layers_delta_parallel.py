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

from tests.support import tp_replicated_cases
from tests.support.delta_layer_cases import CASES, GRAD_TOL, OUT_TOL, spawn_results


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


@pytest.mark.parametrize("run", tp_replicated_cases.RUNS, ids=lambda r: tp_replicated_cases.run_label(*r))
def test_gradient_accumulation_sums_replicated_grads_over_tp_once(results, run):
    """Two micro-batches at TP2 through megatron's DDP and finalization: every gradient equals the single-rank
    layer's; the output norm's TP sum costs one all-reduce per micro-batch with megatron's finalize_model_grads
    and no SP (the hook), none in the backward passes otherwise, and one per step in the finalization (ours
    without SP; megatron's coalesced layer-norm sum with SP)."""
    kind, sp, finalize = run
    per_rank = [r["tp_replicated"][tp_replicated_cases.run_label(*run)] for r in results]
    errors = [r["error"] for r in per_rank if "error" in r]
    assert not errors, errors[0]
    worst = {n: max(r["param_grads"][n] for r in per_rank) for n in per_rank[0]["param_grads"]}
    assert not {n: e for n, e in worst.items() if e > GRAD_TOL}, worst
    other = "ours" if finalize == "megatron" else "megatron"
    twin = [r["tp_replicated"][tp_replicated_cases.run_label(kind, sp, other)] for r in results]
    hooks = sum(r["backward_all_reduces"] for r in per_rank) - sum(r["backward_all_reduces"] for r in twin)
    if sp:
        assert {r["backward_all_reduces"] for r in per_rank} == {0}, per_rank
        assert {r["finalize_all_reduces"] for r in per_rank} == {1}, per_rank
    elif finalize == "megatron":
        assert hooks == len(per_rank) * tp_replicated_cases.MICRO, (per_rank, twin)   # one norm weight per layer
        assert {r["finalize_all_reduces"] for r in per_rank} == {0}, per_rank
    else:
        assert {r["finalize_all_reduces"] for r in per_rank} == {1}, per_rank
