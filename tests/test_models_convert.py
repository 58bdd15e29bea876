"""The conversion engine (``hp_megatron.convert``) with the architectures' rules: a ``save_pretrained`` directory of
each tiny model -> megatron-core dist checkpoint -> HF directory is bit-exact, and the dist checkpoint loads into the
preset's GPTModel through ``sharded_state_dict`` with transformers' logits."""
from __future__ import annotations

import glob
import os

import pytest
import torch

from dist import rel_err
from models_case import read_checkpoint, single_rank, tiny_hf_model, token_batch  # noqa: F401


@pytest.mark.parametrize("arch", ["qwen3_next", "deepseek_v3", "kimi_linear"])
def test_engine_round_trip_and_load(single_rank, arch, tmp_path):
    from megatron.core import dist_checkpointing
    from safetensors.torch import load_file

    from hp_megatron.convert.engine import checkpoint_directory, hf_to_mcore, mcore_to_hf
    from hp_megatron.models import build_model

    hf_model, hf_config = tiny_hf_model(arch, str(tmp_path / "hf"))
    hf_to_mcore(str(tmp_path / "hf"), str(tmp_path / "mcore"))
    mcore_to_hf(str(tmp_path / "mcore"), str(tmp_path / "back"))
    original = read_checkpoint(str(tmp_path / "hf"))
    back = {}
    for path in glob.glob(os.path.join(tmp_path / "back", "*.safetensors")):
        back.update(load_file(path))
    assert set(back) == set(original)
    assert all(torch.equal(back[k], original[k]) for k in original)

    model = build_model(hf_config)
    sharded = model.sharded_state_dict()
    state = dist_checkpointing.load(sharded, checkpoint_directory(str(tmp_path / "mcore")))
    model.load_state_dict({k: v for k, v in state.items() if k in sharded}, strict=True)  # not common.pt's extras
    ids, _ = token_batch()
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
        assert rel_err(logits, hf_model(input_ids=ids).logits) <= 1e-4
