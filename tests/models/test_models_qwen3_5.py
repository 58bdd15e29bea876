"""Qwen3.5 specifics (``hp_megatron.models.qwen3_5``): the presets of the four model types from config.json and
their refusals; the released-style VL checkpoint (language model under ``model.language_model.``, vision tower
``model.visual.*``, MTP ``mtp.*``) converted with ``python -m hp_megatron.convert``: the vision tower stops the
conversion unless dropped (also with ``--mtp-num-layers 1``, which models the MTP layers), and both directions are
bit-exact for every modeled tensor, MTP included; mRoPE position ids: equal axes (text) give the 2-D positions'
logits, differing axes (image / video tokens) a one-line ValueError. Logits, gradients, greedy tokens and MTP
against transformers: tests/models/test_models_{tp1,convert,generate,mtp}.py."""
from __future__ import annotations

import pytest
import torch

from tests.support.models_case import read_safetensors, tiny_hf_model, token_batch

VISION = "model.visual."


def _config(arch):
    from hp_megatron.models.tiny import tiny_hf_config

    return tiny_hf_config(arch)[1].to_dict()


def test_presets_from_config_json():
    from hp_megatron.models import preset_from_hf

    dense, moe, vl, moe_vl = (preset_from_hf(_config(a)) for a in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_5",
                                                                    "qwen3_5_moe"))
    for preset in (dense, moe, vl, moe_vl):
        c, m, g = preset.transformer_fields, preset.mixer_fields, preset.gpt_model_kwargs
        assert preset.pattern == "GGAA" and preset.mtp_symbol == "A" and preset.qk_layernorm
        assert c["attention_output_gate"] and c["layernorm_zero_centered_gamma"] and c["kv_channels"] == 16
        assert (m["linear_num_key_heads"], m["linear_num_value_heads"], m["linear_key_head_dim"]) == (4, 8, 8)
        assert not m["gated_norm_zero_centered_gamma"] and g["rotary_percent"] == 0.5 and g["vocab_size"] == 64
        assert preset.position_ids_map is not None
    assert "num_moe_experts" not in dense.transformer_fields and dense.transformer_fields["ffn_hidden_size"] == 48
    for preset in (moe, moe_vl):
        c = preset.transformer_fields
        assert (c["num_moe_experts"], c["moe_router_topk"], c["moe_layer_freq"]) == (4, 2, [1, 1, 1, 1])
        assert not c["moe_router_pre_softmax"] and c["moe_shared_expert_gate"]   # top-k renormalised softmax
        assert (c["moe_ffn_hidden_size"], c["moe_shared_expert_intermediate_size"]) == (16, 24)
    tied = {**_config("qwen3_5"), "tie_word_embeddings": True}   # the VL class ties by the top-level field
    assert preset_from_hf(tied).gpt_model_kwargs["share_embeddings_and_output_weights"]


@pytest.mark.parametrize("change,message", [
    (lambda c: c["rope_parameters"].update(rope_type="yarn"), r"rope_parameters.rope_type='yarn'"),
    (lambda c: c["rope_parameters"].update(factor=2.0), r"rope_parameters=\{'factor': 2.0\} is not supported"),
    (lambda c: c.update(num_experts=4), r"qwen3_5_text config.json field num_experts=4 is not supported"),
    (lambda c: c.update(model_type="qwen3_5", text_config=None), r"qwen3_5 config.json lacks the field 'text_config'"),
])
def test_presets_refuse_what_they_cannot_build(change, message):
    from hp_megatron.models import preset_from_hf

    config = _config("qwen3_5_text")
    change(config)
    with pytest.raises(ValueError, match=message):
        preset_from_hf(config)


def test_vl_checkpoint_with_mtp_converts_both_ways(single_rank, tmp_path, capsys):
    from hp_megatron.checkpoint import CheckpointError
    from hp_megatron.convert.__main__ import main
    from hp_megatron.convert.engine import hf_to_mcore
    from hp_megatron.models import get_architecture
    from tests.support.mtp_case import tiny_mtp_checkpoint

    hf_dir, ckpt, back = str(tmp_path / "hf"), str(tmp_path / "mcore"), str(tmp_path / "back")
    tiny_mtp_checkpoint("qwen3_5_moe", hf_dir)
    original = read_safetensors(hf_dir)
    vision = [k for k in original if k.startswith(VISION)]
    mtp = [k for k in original if k.startswith("mtp.")]
    assert len(vision) > 10 and len(mtp) > 10
    assert any(k.startswith("model.language_model.layers.") for k in original) and "lm_head.weight" in original
    with pytest.raises(CheckpointError, match=rf"{len(vision)} tensors of parts the megatron model does not build: "
                                              r"\['Qwen3.5 vision tower .*--drop-unmodeled"):
        hf_to_mcore(hf_dir, str(tmp_path / "refused"), get_architecture("qwen3_5_moe").with_mtp(1))
    assert main(["hf-to-mcore", "--load", hf_dir, "--save", ckpt, "--mtp-num-layers", "1", "--drop-unmodeled"]) == 0
    assert f"left out {len(vision)} tensors" in capsys.readouterr().out
    assert main(["mcore-to-hf", "--load", ckpt, "--save", back]) == 0
    exported = read_safetensors(back)
    assert sorted(exported) == sorted(k for k in original if not k.startswith(VISION))
    assert all(torch.equal(exported[k], original[k]) and exported[k].dtype == original[k].dtype for k in exported)
    assert main(["hf-to-mcore", "--load", hf_dir, "--save", str(tmp_path / "no_mtp"), "--drop-unmodeled"]) == 0
    assert f"left out {len(vision) + len(mtp)} tensors" in capsys.readouterr().out


def test_mrope_position_ids_text_only(single_rank, tmp_path):
    from hp_megatron.models import get_architecture
    from hp_megatron.models.qwen3_5 import text_position_ids

    _, config = tiny_hf_model("qwen3_5_moe_text", str(tmp_path))
    model = get_architecture("qwen3_5_moe_text").build_model(config).eval()
    ids, _ = token_batch()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    mrope = positions.expand(3, *positions.shape)
    assert torch.equal(text_position_ids(mrope), positions)
    assert torch.equal(text_position_ids(torch.cat([positions[None], mrope])), positions)   # transformers' [4, b, s]
    with torch.no_grad():
        assert torch.equal(model(ids, mrope, None), model(ids, positions, None))
        assert torch.equal(model(ids, position_ids=mrope, attention_mask=None), model(ids, positions, None))
        image = mrope.clone()
        image[1, :, 4:8] = 2   # an image's height axis
        with pytest.raises(ValueError, match=r"^Qwen3.5 multimodal mRoPE position ids \(axes differ: image / video "
                                             r"tokens\) are not supported; only text positions[^\n]*$"):
            model(ids, image, None)
    with pytest.raises(ValueError, match=r"must be \[b, s\] or mRoPE \[3, b, s\], got shape \(2, 2, 2, 12\)"):
        text_position_ids(mrope[:2, :, None].expand(2, 2, 2, 12))
