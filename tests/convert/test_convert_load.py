"""A converted checkpoint loads into a real megatron-core GPTModel at TP1 and TP2 (2 gloo ranks).

A tiny random ``LlamaForCausalLM`` (transformers) is saved in shards, converted with ``hf_to_mcore``, and loaded by
megatron-core's own ``dist_checkpointing.load`` through the model's ``sharded_state_dict`` (the path of
Megatron-LM's ``--load`` and of examples/pretrain). The loaded TP1 weights equal the conversion rules applied to
the HF tensors bit for bit; the logits at TP1 (data parallel over both ranks) and TP2 equal transformers' logits.
One spawn serves every case.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.support.dist import run_distributed_once
from tests.support.models_case import LLAMA_VOCAB, converted_tiny_model, read_safetensors
from tests.support.paths import EXAMPLE
from tests.support.reference import rel_err

SEQ = 12


def load_and_run(rank, world_size, hf_dir, ckpt_dir, tokens, resaved_dir, moe_hf_dir, moe_ckpt_dir):
    """Per rank: for TP in (1, 2), load the checkpoint into a fresh GPTModel and return its full logits; at TP1
    also the largest difference between the loaded weights and the rules applied to the HF tensors. At TP2 the
    model is saved again by megatron-core itself into ``resaved_dir`` (TP-sharded chunks, as training writes)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from hp_megatron.convert.safetensors_io import HFCheckpoint
    from hp_megatron.models import get_architecture
    from hp_megatron.platform import apply_cpu_shims

    llama = get_architecture("llama")
    hf = HFCheckpoint(hf_dir)
    results = {}
    for tp in (1, 2):
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tp, 1)
        apply_cpu_shims(100 + tp)
        model = llama.build_model(hf.config, tensor_model_parallel_size=tp)
        before = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt_dir)  # as Megatron-LM does
        model.load_state_dict(state["model"])
        results["common"] = (state["checkpoint_version"], state["iteration"], state["hf_config"]["model_type"])
        if tp == 1:
            rules = {r.mcore_key: r for r in llama.conversion_rules(hf.config)}
            diffs = [float((model.state_dict()[k] - rule.to_mcore([hf.read(x) for x in rule.hf_keys])).abs().max())
                     for k, rule in rules.items()]
            results["weights_max_abs"] = max(diffs)
            results["weights_changed"] = min(float((model.state_dict()[k] - before[k]).abs().max()) for k in rules
                                             if "layernorm" not in k)
        with torch.no_grad():
            positions = torch.arange(tokens.shape[1]).expand_as(tokens)
            logits = model(tokens, positions, attention_mask=None)
            results[f"logits_tp{tp}"] = gather_from_tensor_model_parallel_region(logits)
        if tp == 2:
            dist_checkpointing.save({"model": model.sharded_state_dict(), "iteration": 5}, resaved_dir)
            results["example_load"] = _example_load(hf.config, os.path.dirname(ckpt_dir), tokens)
        dist.barrier()
    results["pp2_weights_max_abs"] = _pipeline_stage_load(hf, ckpt_dir)
    results["ep2"] = _expert_parallel_load(moe_hf_dir, moe_ckpt_dir)
    parallel_state.destroy_model_parallel()
    return results


def _pipeline_stage_load(hf, ckpt_dir):
    """PP=2: this rank's stage (one layer; embedding or final norm + output layer) loads exactly the rules'
    tensors of its global layer numbers. Returns the largest difference."""
    from megatron.core import dist_checkpointing, parallel_state

    from hp_megatron.models import get_architecture
    from hp_megatron.platform import apply_cpu_shims

    llama = get_architecture("llama")
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 2)
    apply_cpu_shims(7)
    model = llama.build_model(hf.config, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt_dir)["model"])
    offset = parallel_state.get_pipeline_model_parallel_rank()  # one layer per stage
    max_abs, compared = _difference_to_rules(model, llama.conversion_rules(hf.config), hf,
                                             r"^(decoder\.layers\.)(\d+)\.", offset)
    return max_abs if compared > 5 else float("nan")  # a stage holds a layer's 6 tensors at least


def _expert_parallel_load(hf_dir, ckpt_dir):
    """EP=2 on a converted Qwen3-Next (4 routed experts): each rank's local experts and every other tensor are
    exactly the rules' tensors of their global expert indices. Returns (largest difference, tensors compared)."""
    from megatron.core import dist_checkpointing, parallel_state

    from hp_megatron.convert.safetensors_io import HFCheckpoint
    from hp_megatron.models import get_architecture
    from hp_megatron.platform import apply_cpu_shims

    hf = HFCheckpoint(hf_dir)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    apply_cpu_shims(9)
    arch = get_architecture(hf.config["model_type"])
    model = arch.build_model(hf.config, expert_model_parallel_size=2, params_dtype=torch.float32)
    model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt_dir)["model"])
    first = parallel_state.get_expert_model_parallel_rank() * 2  # 2 local experts of 4
    return _difference_to_rules(model, arch.conversion_rules(hf.config), hf, r"(local_experts\.)(\d+)\.", first)


def _difference_to_rules(model, rules, hf, local_index: str, offset: int):
    """(largest |loaded - rule(HF)|, tensors compared) over ``model``'s state, whose local layer or expert
    numbers (group 2 of the regex ``local_index``) are the global ones minus ``offset``."""
    import re

    rules = {r.mcore_key: r for r in rules}
    diffs = []
    for key, value in model.state_dict().items():
        if key.endswith("_extra_state"):
            continue
        rule = rules[re.sub(local_index, lambda m: f"{m[1]}{int(m[2]) + offset}.", key)]
        diffs.append(float((value - rule.to_mcore([hf.read(x) for x in rule.hf_keys])).abs().max()))
    return max(diffs), len(diffs)


def _example_load(hf_config, ckpt_root, tokens):
    """examples/pretrain's find_checkpoint + load_checkpoint on the converted (release) root:
    (iteration, consumed samples, logits)."""
    import sys
    from types import SimpleNamespace

    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from hp_megatron.models import get_architecture

    sys.path.insert(0, EXAMPLE)
    from checkpointing import find_checkpoint, load_checkpoint

    model = get_architecture("llama").build_model(hf_config, tensor_model_parallel_size=2)
    iteration, consumed = load_checkpoint(find_checkpoint(ckpt_root), SimpleNamespace(module=model), None, None)
    with torch.no_grad():
        logits = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), attention_mask=None)
    return iteration, consumed, gather_from_tensor_model_parallel_region(logits)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("convert_load")
    hf_dir, ckpt = str(tmp / "hf"), str(tmp / "mcore")
    model = converted_tiny_model("llama", hf_dir, ckpt)
    tokens = torch.randint(0, LLAMA_VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(tokens).logits
    resaved = tmp / "resaved_tp2"
    resaved.mkdir()
    moe_hf_dir, moe_ckpt = str(tmp / "qwen3_next_hf"), str(tmp / "qwen3_next_mcore")   # a tiny Qwen3-Next
    converted_tiny_model("qwen3_next", moe_hf_dir, moe_ckpt)
    per_rank = run_distributed_once(load_and_run, 2, hf_dir, ckpt + "/release", tokens, str(resaved), moe_hf_dir,
                                    moe_ckpt + "/release")
    return expected, per_rank, hf_dir, str(resaved), tmp


def test_loaded_weights_are_the_rules_applied_to_hf_tensors(setup):
    _, per_rank, *_ = setup
    for r in per_rank:
        assert r["common"] == (3.0, 0, "llama")
        assert r["weights_changed"] > 0  # the fresh model started from other weights
        assert r["weights_max_abs"] == 0.0


@pytest.mark.parametrize("tp", [1, 2])
def test_logits_match_transformers(setup, tp):
    expected, per_rank, *_ = setup
    for r in per_rank:
        assert rel_err(r[f"logits_tp{tp}"], expected) <= 1e-5


def test_pipeline_stages_load_their_layers(setup):
    _, per_rank, *_ = setup
    for r in per_rank:
        assert r["pp2_weights_max_abs"] == 0.0


def test_expert_parallel_ranks_load_their_experts(setup):
    _, per_rank, *_ = setup
    for r in per_rank:
        max_abs, compared = r["ep2"]
        assert compared > 20 and max_abs == 0.0


def test_example_starts_from_the_converted_release_checkpoint(setup):
    expected, per_rank, *_ = setup
    for r in per_rank:
        iteration, consumed, logits = r["example_load"]
        assert (iteration, consumed) == (0, 0)
        assert rel_err(logits, expected) <= 1e-5


def test_checkpoint_saved_by_megatron_at_tp2_exports_to_the_original_hf_tensors(setup):
    """mcore-to-hf reads the TP-sharded chunks megatron-core wrote (SwiGLU halves interleaved per rank)."""
    import json

    from hp_megatron.convert import mcore_to_hf
    from hp_megatron.models import get_architecture

    _, _, hf_dir, resaved, tmp = setup
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    mcore_to_hf(resaved, str(tmp / "from_tp2"), get_architecture("llama"), hf_config=config)

    original, exported = read_safetensors(hf_dir), read_safetensors(str(tmp / "from_tp2"))
    assert sorted(exported) == sorted(original)
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key
