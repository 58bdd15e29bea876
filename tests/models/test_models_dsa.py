"""DeepSeek-V3.2 (``deepseek_v32``) and GLM-5 (``glm_moe_dsa``, with a "shared" indexer layer) on one rank: the tiny
random transformers model (``hp_megatron.models.tiny``: index_topk 4 below the sequence, MoE and dense layers),
converted with ``hp_megatron.models`` rules into megatron-core's GPTModel with our DSA layers, gives transformers'
logits, loss and the gradients of non-indexer parameters; converted back it is bit-exact and transformers loads it
with the same logits; greedy generation through megatron-core's static inference path (our latent + indexer key
caches) gives transformers' tokens. DeepSeek-V3.2 with its MTP layer converts both ways bit-exact.

Top-k is discontinuous: the logits test first asserts that every selection of our forward has its k-th and (k+1)-th
indexer scores more than 1e-4 apart (the tiny models' seed was checked for it)."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

from tests.support.dsa_margin import recording_margins
from tests.support.models_case import (converted_tiny_model, hf_logits_and_loss, mcore_logits_and_loss,
                                       read_safetensors, tiny_hf_model, to_hf, to_mcore, token_batch)
from tests.support.reference import rel_err

TOL = 1e-4
ARCHS = ("deepseek_v32", "glm_moe_dsa")
GRADS = [("model.layers.0.self_attn.kv_b_proj.weight", "decoder.layers.0.self_attention.linear_kv_up_proj.weight"),
         ("model.layers.2.self_attn.q_a_layernorm.weight", "decoder.layers.2.self_attention.q_layernorm.weight"),
         ("model.layers.3.self_attn.o_proj.weight", "decoder.layers.3.self_attention.linear_proj.weight"),
         ("model.layers.3.mlp.gate.weight", "decoder.layers.3.mlp.router.weight"),
         ("model.norm.weight", "decoder.final_layernorm.weight")]


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers_and_round_trips(single_rank, arch):
    from hp_megatron.models import conversion_rules_from_hf, preset_from_hf, preset_gpt_model, preset_transformer_config

    with tempfile.TemporaryDirectory() as directory:
        hf_model, hf_config = tiny_hf_model(arch, directory)
        hf_state = read_safetensors(directory)
    preset = preset_from_hf(hf_config)
    config = preset_transformer_config(preset, use_cpu_initialization=True, params_dtype=torch.float32,
                                       gradient_accumulation_fusion=False, bias_dropout_fusion=False)
    model = preset_gpt_model(preset, config, max_sequence_length=64)
    rules = conversion_rules_from_hf(hf_config)
    model.load_state_dict(to_mcore(rules, hf_state), strict=True)
    layers = model.decoder.layers
    assert [type(layer.self_attention).__name__ for layer in layers] == ["DSAttention"] * 4
    if arch == "glm_moe_dsa":    # indexer_types [full, full, shared, full]
        assert [layer.self_attention.indexer is None for layer in layers] == [False, False, True, False]
    ids, targets = token_batch()
    ref_logits, ref_loss = hf_logits_and_loss(hf_model, ids)
    with recording_margins() as gaps:
        logits, loss = mcore_logits_and_loss(model, ids, targets)
    assert min(gaps) > 1e-4, min(gaps)
    assert rel_err(logits, ref_logits) <= TOL
    assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item())
    ref_loss.backward()
    loss.backward()
    hf_params, ours = dict(hf_model.named_parameters()), dict(model.named_parameters())
    for hf_name, mcore_name in GRADS:
        assert rel_err(ours[mcore_name].grad, hf_params[hf_name].grad) <= TOL, mcore_name

    state = model.state_dict()
    exported = to_hf(rules, {r.mcore_key: state[r.mcore_key].detach() for r in rules})
    assert set(exported) == set(hf_state)
    assert all(torch.equal(exported[k], hf_state[k]) for k in hf_state)
    with tempfile.TemporaryDirectory() as directory:
        from safetensors.torch import save_file

        hf_model.config.save_pretrained(directory)
        save_file({k: v.contiguous() for k, v in exported.items()}, os.path.join(directory, "model.safetensors"))
        reloaded = type(hf_model).from_pretrained(directory, attn_implementation="eager").float().eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, hf_model(input_ids=ids).logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_transformers(arch, tmp_path, single_rank):
    from hp_megatron.convert.safetensors_io import load_hf_config
    from hp_megatron.generate import StaticGenerator, sampling_params
    from hp_megatron.generate.model import build_model

    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    hf_model = converted_tiny_model(arch, hf_dir, ckpt).eval()
    hf_model.generation_config.eos_token_id = None
    hf_config = load_hf_config(hf_dir)
    model = build_model(hf_config, load=ckpt)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, hf_config["vocab_size"], (n,), generator=gen).tolist() for n in (3, 7, 12)]
    generator = StaticGenerator(model, vocab_size=hf_config["vocab_size"], max_positions=model.max_sequence_length,
                                max_batch_size=4, max_sequence_length=64)
    result = generator.generate(prompts, sampling_params(max_new_tokens=16))
    expected = []
    for prompt in prompts:
        prompt_ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf_model.generate(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                                    max_new_tokens=16, do_sample=False, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    assert result.tokens == expected


def test_deepseek_v32_mtp_converts_both_ways(tmp_path, single_rank):
    """The MTP layer (a DSA + MoE decoder layer, ``num_nextn_predict_layers: 1``) through ``hf_to_mcore`` /
    ``mcore_to_hf`` with the architecture's ``with_mtp(1)``: every tensor comes back bit-exact."""
    from hp_megatron.convert import mcore_to_hf
    from hp_megatron.models import get_architecture

    hf_dir, ckpt, back = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "back"
    converted_tiny_model("deepseek_v32", hf_dir, ckpt, mtp_num_layers=1)
    mcore_to_hf(str(ckpt), str(back), get_architecture("deepseek_v32").with_mtp(1))
    original, exported = read_safetensors(str(hf_dir)), read_safetensors(str(back))
    assert any(k.startswith("model.layers.4.self_attn.indexer.") for k in original)
    assert set(exported) == set(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)
