"""The conversion engine on the real architectures (hp_megatron.models: Qwen3-Next, DeepSeek-V3, Kimi Linear):
a tiny random transformers model's checkpoint goes HF -> megatron-core torch_dist -> HF bit for bit, through the
layout of the preset's GPTModel (expert axes, SwiGLU factories, GDN/KDA/MLA parameters); the checkpoint loads
with megatron-core's dist_checkpointing into that model with exactly the rules' tensors."""
from __future__ import annotations

import os

import pytest
import torch

from tests.support.models_case import read_safetensors, tiny_hf_model, to_mcore


@pytest.mark.parametrize("arch", ["qwen3_next", "deepseek_v3", "kimi_linear"])
def test_architecture_round_trip_through_torch_dist(tmp_path, arch):
    from megatron.core import dist_checkpointing
    from safetensors.torch import save_file

    from hp_megatron.convert import get_architecture, hf_to_mcore, mcore_to_hf
    from hp_megatron.platform import single_rank_megatron

    hf_dir = str(tmp_path / "hf")
    _, hf_config = tiny_hf_model(arch, hf_dir)
    state = read_safetensors(hf_dir)  # Moonshot's names for Kimi Linear's dense MLPs, as its checkpoints have
    os.remove(os.path.join(hf_dir, "model.safetensors"))
    save_file(state, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})

    hf_to_mcore(hf_dir, str(tmp_path / "mcore"))
    mcore_to_hf(str(tmp_path / "mcore"), str(tmp_path / "back"), max_shard_size="50KB")
    exported = read_safetensors(str(tmp_path / "back"))
    assert sorted(exported) == sorted(state)
    for key, tensor in state.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key

    arch_entry = get_architecture(hf_config["model_type"])
    expected = to_mcore(arch_entry.conversion_rules(hf_config), state)
    with single_rank_megatron():
        model = arch_entry.build_model(hf_config, params_dtype=torch.float32)
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(tmp_path / "mcore" / "release"))
        model.load_state_dict(loaded["model"])
        ours = model.state_dict()
        assert all(torch.equal(ours[k], v) for k, v in expected.items())
