"""HF <-> megatron-core conversion in one process: bit-exact round trips (CLI and API), transformers reloads the
exported directory, and bad input fails with the file and tensor named and nothing written."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.support.models_case import LLAMA_VOCAB, read_safetensors, tiny_llama


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("convert_engine")
    untied, untied_dir = tiny_llama(tmp)
    tied, tied_dir = tiny_llama(tmp, tied=True)
    tied = tied.to(torch.bfloat16)
    tied.save_pretrained(tied_dir, max_shard_size="20KB")  # bf16 shards, several of them
    return tmp, {"untied": (untied, untied_dir), "tied_bf16": (tied, tied_dir)}


@pytest.mark.parametrize("case", ["untied", "tied_bf16"])
def test_round_trip_is_bit_exact_and_reloads_in_transformers(hf_models, case):
    from transformers import AutoModelForCausalLM

    from hp_megatron.convert.__main__ import main

    tmp, models = hf_models
    model, hf_dir = models[case]
    ckpt, back = str(tmp / f"{case}_mcore"), str(tmp / f"{case}_back")
    assert main(["hf-to-mcore", "--load", hf_dir, "--save", ckpt, "--ckpt-iteration", "7"]) == 0
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "7"
    assert main(["mcore-to-hf", "--load", ckpt, "--save", back, "--max-shard-size", "30KB"]) == 0

    original, exported = read_safetensors(hf_dir), read_safetensors(back)
    assert sorted(exported) == sorted(original)
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    assert json.load(open(os.path.join(back, "config.json"))) == json.load(open(os.path.join(hf_dir, "config.json")))
    index = json.load(open(os.path.join(back, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"]) == set(original)

    # both loaded the same way (a model cast with .to(bf16) also casts its rotary buffer)
    reloaded = AutoModelForCausalLM.from_pretrained(back, dtype=model.dtype).eval()
    source = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=model.dtype).eval()
    tokens = torch.randint(0, LLAMA_VOCAB, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, source(tokens).logits)


def _rewrite_shard(directory, key, change):
    """Apply ``change(dict of tensors)`` to the shard holding ``key`` and refresh the index."""
    from safetensors.torch import load_file, save_file

    index_path = os.path.join(directory, "model.safetensors.index.json")
    index = json.load(open(index_path))
    shard = os.path.join(directory, index["weight_map"][key])
    tensors = load_file(shard)
    change(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != os.path.basename(shard)}
    index["weight_map"].update({k: os.path.basename(shard) for k in tensors})
    json.dump(index, open(index_path, "w"))
    return os.path.basename(shard)


def _break(directory, how):
    """Damage the copy of an HF directory; returns the strings the error must name."""
    victim = "model.layers.1.mlp.up_proj.weight"
    if how == "missing":
        _rewrite_shard(directory, victim, lambda t: t.pop(victim))
        return [victim, "missing"]
    if how == "unexpected":
        shard = _rewrite_shard(directory, victim, lambda t: t.update({"model.layers.1.mlp.extra": torch.ones(3)}))
        return ["model.layers.1.mlp.extra", shard, "unexpected"]
    if how == "shape":
        shard = _rewrite_shard(directory, victim, lambda t: t.update({victim: t[victim][:-1].clone()}))
        return ["decoder.layers.1.mlp.linear_fc1.weight", victim, shard, "shape mismatch"]
    if how == "architecture":
        config_path = os.path.join(directory, "config.json")
        config = json.load(open(config_path))
        config["model_type"] = "no_such_model"
        json.dump(config, open(config_path, "w"))
        return ["no_such_model", "llama"]
    if how == "truncated":
        index = json.load(open(os.path.join(directory, "model.safetensors.index.json")))
        shard = os.path.join(directory, index["weight_map"][victim])
        os.truncate(shard, os.path.getsize(shard) - 16)
        return [os.path.basename(shard), "truncated"]
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["missing", "unexpected", "shape", "architecture", "truncated"])
def test_bad_hf_input_names_file_and_tensor_and_writes_nothing(hf_models, how):
    from hp_megatron.convert import hf_to_mcore
    from hp_megatron.models import get_architecture

    tmp, models = hf_models
    broken = str(tmp / f"broken_{how}")
    shutil.copytree(models["untied"][1], broken)
    expected = _break(broken, how)
    save = str(tmp / f"out_{how}")
    with pytest.raises(ValueError) as info:
        hf_to_mcore(broken, save, get_architecture("llama"))
    for text in expected:
        assert text in str(info.value), (text, str(info.value))
    assert not [name for name in os.listdir(tmp) if name.startswith(f"out_{how}")]


def test_export_with_a_config_of_other_shapes_is_refused(hf_models):
    from hp_megatron.convert import hf_to_mcore, mcore_to_hf
    from hp_megatron.models import get_architecture

    llama = get_architecture("llama")
    tmp, models = hf_models
    ckpt = str(tmp / "for_wrong_config")
    hf_to_mcore(models["untied"][1], ckpt, llama)
    config = json.load(open(os.path.join(models["untied"][1], "config.json")))
    config["intermediate_size"] = 40
    with pytest.raises(ValueError, match=r"shape mismatch for decoder\.layers\.(0\.)?mlp\.linear_fc1\.weight"):
        mcore_to_hf(ckpt, str(tmp / "wrong_back"), llama, hf_config=config)
    assert not os.path.exists(tmp / "wrong_back")
    with pytest.raises(FileExistsError, match="overwrite"):
        hf_to_mcore(models["untied"][1], ckpt, llama)
