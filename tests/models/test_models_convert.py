"""The conversion engine (``hp_megatron.convert``) on the real architectures' table entries (Qwen3-Next, DeepSeek-V3,
Kimi Linear, Qwen3.5-MoE, the Qwen3.5 VL checkpoint's language model): a ``save_pretrained`` directory of each tiny
model -> megatron-core torch_dist checkpoint -> HF directory (several shards) is bit-exact; the checkpoint loads through
``sharded_state_dict`` (expert axes, SwiGLU factories, GDN/KDA/MLA parameters) into the architecture's GPTModel with
exactly the rules' tensors and gives transformers' logits."""
from __future__ import annotations

import glob
import os

import pytest
import torch

from tests.support.models_case import read_safetensors, tiny_hf_model, to_mcore, token_batch
from tests.support.reference import rel_err


@pytest.mark.parametrize("arch", ["qwen3_next", "deepseek_v3", "kimi_linear", "qwen3_5_moe_text", "qwen3_5",
                                  "olmo_hybrid", "bailing_hybrid"])
def test_engine_round_trip_and_load(single_rank, arch, tmp_path):
    from megatron.core import dist_checkpointing

    from hp_megatron.checkpoint import checkpoint_directory
    from hp_megatron.convert.engine import hf_to_mcore, mcore_to_hf
    from hp_megatron.models import get_architecture

    architecture = get_architecture(arch)
    hf_dir, ckpt, back = str(tmp_path / "hf"), str(tmp_path / "mcore"), str(tmp_path / "back")
    hf_model, hf_config = tiny_hf_model(arch, hf_dir)
    vl = "text_config" in hf_config   # Qwen3.5 VL: every modeled tensor (the vision tower is dropped)
    hf_to_mcore(hf_dir, ckpt, architecture, drop_unmodeled=vl)
    mcore_to_hf(ckpt, back, architecture, max_shard_size="50KB")
    original = {k: v for k, v in read_safetensors(hf_dir).items() if not k.startswith("model.visual.")}
    exported = read_safetensors(back)
    assert len(glob.glob(os.path.join(back, "*.safetensors"))) > 1
    assert sorted(exported) == sorted(original)
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key

    model = architecture.build_model(hf_config)
    sharded = model.sharded_state_dict()
    state = dist_checkpointing.load(sharded, checkpoint_directory(ckpt))
    model.load_state_dict({k: v for k, v in state.items() if k in sharded}, strict=True)  # not common.pt's extras
    ours = model.state_dict()
    expected = to_mcore(architecture.conversion_rules(hf_config), original)
    assert all(torch.equal(ours[k], v) for k, v in expected.items())
    ids, _ = token_batch()
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
        assert rel_err(logits, hf_model(input_ids=ids).logits) <= 1e-4


def _mtp_tensors(model_type, hf_config):
    """(extra config fields, MTP tensors as in the released checkpoints, the part's name in the error)."""
    layers, hidden = hf_config["num_hidden_layers"], hf_config["hidden_size"]
    if model_type == "deepseek_v3":   # model.layers.<L>.*, num_nextn_predict_layers=1
        names = (("eh_proj.weight", (hidden, 2 * hidden)), ("enorm.weight", (hidden,)), ("hnorm.weight", (hidden,)),
                 ("shared_head.norm.weight", (hidden,)))
        return ({"num_nextn_predict_layers": 1}, {f"model.layers.{layers}.{n}": torch.randn(s) for n, s in names},
                "DeepSeek-V3 multi-token-prediction layer 0 (num_nextn_predict_layers=1)")
    names = (("fc.weight", (hidden, 2 * hidden)), ("norm.weight", (hidden,)),   # qwen3_next: mtp.*
             ("pre_fc_norm_embedding.weight", (hidden,)), ("pre_fc_norm_hidden.weight", (hidden,)),
             ("layers.0.input_layernorm.weight", (hidden,)))
    return {}, {f"mtp.{n}": torch.randn(s) for n, s in names}, "Qwen3-Next multi-token-prediction module (mtp.*)"


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_next"])
def test_mtp_tensors_stop_the_conversion_unless_dropped(single_rank, tmp_path, capsys, model_type):
    """A checkpoint with the multi-token-prediction tensors of the released DeepSeek-V3 / Qwen3-Next checkpoints,
    which neither transformers' forward nor the megatron model has: the conversion names them and stops;
    ``--drop-unmodeled`` converts the rest, bit-exact to the checkpoint without them; any other stray tensor
    stops it even then."""
    import json
    import re

    from safetensors.torch import save_file

    from hp_megatron.convert.__main__ import main
    from hp_megatron.convert.engine import hf_to_mcore
    from hp_megatron.checkpoint import CheckpointError
    from hp_megatron.models import get_architecture

    architecture = get_architecture(model_type)
    hf_dir = tmp_path / "hf"
    _, hf_config = tiny_hf_model(model_type, str(hf_dir))
    extra, mtp, part = _mtp_tensors(model_type, hf_config)
    (hf_dir / "config.json").write_text(json.dumps({**hf_config, **extra}))
    state = read_safetensors(str(hf_dir))
    save_file({**state, **mtp}, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})

    with pytest.raises(CheckpointError, match=rf"{len(mtp)} tensors of parts the megatron model does not build: "
                       rf"\['{re.escape(part)}'\].*--drop-unmodeled"):
        hf_to_mcore(str(hf_dir), str(tmp_path / "refused"), architecture)
    assert not (tmp_path / "refused").exists()

    ckpt, back = str(tmp_path / "mcore"), str(tmp_path / "back")
    assert main(["hf-to-mcore", "--load", str(hf_dir), "--save", ckpt, "--drop-unmodeled"]) == 0
    assert f"left out {len(mtp)} tensors of parts the model does not build (--drop-unmodeled), e.g. " \
        f"{sorted(mtp)[0]}" in capsys.readouterr().out
    assert main(["mcore-to-hf", "--load", ckpt, "--save", back]) == 0
    converted = read_safetensors(back)
    assert set(converted) == set(state) and all(torch.equal(converted[k], state[k]) for k in state)

    save_file({**state, **mtp, "model.stray.weight": torch.ones(1)}, str(hf_dir / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="unexpected tensor model.stray.weight"):
        hf_to_mcore(str(hf_dir), str(tmp_path / "stray"), architecture, drop_unmodeled=True)
