"""``python -m hp_megatron.convert --model-class hybrid``: every architecture's conversion rules (written once, for
GPTModel) on megatron-core's HybridModel through the layer numbering (``hp_megatron.hybrid_model.numbering``).

Per architecture (every architecture of ``ARCHITECTURES``' tiny random transformers models: Llama, Qwen3-Next,
DeepSeek-V3, Kimi Linear, Qwen3.5 dense text, the Qwen3.5 VL checkpoint's language model (vision tower dropped),
OLMo-Hybrid (post-norm attention, projection q/k norms), GLM-5 (DSA with shared top-k layers: the schedule counts GPT
layers); with a released-style MTP layer: Qwen3-Next, DeepSeek-V3, Qwen3.5-MoE VL, Ling 3.0 (SwiGLU limits),
DeepSeek-V3.2 (DSA)): HF -> HybridModel checkpoint -> HF is bit-exact; the checkpoint
loads through ``sharded_state_dict`` into the architecture's HybridModel, which holds exactly the renumbered rules'
tensors and gives transformers' logits and greedy next tokens. mcore-to-hf runs through the command line and reads the
model class from the checkpoint. Skipped before megatron-core 0.19 (no HybridModel).
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.support.models_case import read_safetensors, tiny_hf_model, tiny_llama, to_mcore, token_batch
from tests.support.reference import rel_err

try:
    from megatron.core.models.hybrid.hybrid_model import HybridModel
except ImportError:  # megatron-core before 0.19
    HybridModel = None

pytestmark = pytest.mark.skipif(HybridModel is None, reason="megatron-core's HybridModel is 0.19+")

CASES = {"llama": 0, "qwen3_next": 0, "deepseek_v3": 0, "kimi_linear": 0, "qwen3_next_mtp": 1, "deepseek_v3_mtp": 1,
         "qwen3_5_text": 0, "qwen3_5_moe_mtp": 1, "qwen3_5": 0, "olmo_hybrid": 0, "bailing_hybrid_mtp": 1,
         "deepseek_v32_mtp": 1, "glm_moe_dsa": 0}


@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_round_trip_load_and_logits(single_rank, case, tmp_path):
    import json

    from megatron.core import dist_checkpointing

    from hp_megatron.checkpoint import checkpoint_directory
    from hp_megatron.convert.__main__ import main as convert_main
    from hp_megatron.convert.engine import hf_to_mcore, stored_model_class
    from hp_megatron.models import get_architecture
    from hp_megatron.models.tiny import add_tiny_mtp_layer

    arch, mtp = case.removesuffix("_mtp"), CASES[case]
    hf_dir, ckpt, back = str(tmp_path / "hf"), str(tmp_path / "mcore"), str(tmp_path / "back")
    if arch == "llama":
        hf_model, hf_dir = tiny_llama(tmp_path)
    else:
        hf_model, _ = tiny_hf_model(arch, hf_dir)
    if mtp:
        add_tiny_mtp_layer(hf_dir, arch, seed=4)
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf_config = json.load(f)
    architecture = get_architecture(arch).with_mtp(mtp).for_model_class("hybrid")
    vl = "text_config" in hf_config   # Qwen3.5 VL: every modeled tensor (the vision tower is dropped)
    hf_to_mcore(hf_dir, ckpt, architecture, drop_unmodeled=vl)
    assert stored_model_class(ckpt) == "hybrid"
    assert convert_main(["mcore-to-hf", "--load", ckpt, "--save", back, "--max-shard-size", "50KB"]) == 0
    original = {k: v for k, v in read_safetensors(hf_dir).items() if not k.startswith("model.visual.")}
    exported = read_safetensors(back)
    assert sorted(exported) == sorted(original)
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key

    model = architecture.build_model(hf_config)
    assert isinstance(model, HybridModel) and model.hybrid_layer_pattern == architecture.hybrid_pattern(hf_config)
    assert model.hybrid_layer_pattern.count("/") == mtp
    sharded = model.sharded_state_dict()
    state = dist_checkpointing.load(sharded, checkpoint_directory(ckpt))
    model.load_state_dict({k: v for k, v in state.items() if k in sharded}, strict=True)
    ours = model.state_dict()
    expected = to_mcore(architecture.conversion_rules(hf_config), original)
    assert sorted(k for k in ours if not k.endswith("_extra_state")) == sorted(expected)
    assert all(torch.equal(ours[k], v) for k, v in expected.items())
    ids, _ = token_batch()
    if arch == "llama":
        ids = ids % hf_config["vocab_size"]
    model.eval()
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
        reference = hf_model(input_ids=ids).logits
    assert rel_err(logits, reference) <= 1e-4
    assert torch.equal(logits[:, -1].argmax(-1), reference[:, -1].argmax(-1))


def test_model_class_refusals():
    from hp_megatron.models import get_architecture

    with pytest.raises(ValueError, match=r"model_class must be one of \('gpt', 'hybrid'\), got 'mamba'"):
        get_architecture("llama").for_model_class("mamba")
    with pytest.raises(ValueError, match=r"deepseek_v3: with_mtp before for_model_class\('hybrid'\)"):
        get_architecture("deepseek_v3").for_model_class("hybrid").with_mtp(1)


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_next"])
def test_gpt_to_hybrid_migration_equals_hybrid_conversion(single_rank, arch, tmp_path):
    """``gpt-to-hybrid`` of the GPT conversion (MLA or GDN + attention, dense and MoE MLPs, an MTP layer) is the
    HybridModel conversion, key for key and bit for bit; ``hybrid-to-gpt`` gives the GPT conversion back."""
    from hp_megatron.checkpoint.dcp_io import ChunkReader
    from hp_megatron.convert.__main__ import main as convert_main
    from hp_megatron.convert.engine import hf_to_mcore
    from hp_megatron.models import get_architecture
    from hp_megatron.models.tiny import add_tiny_mtp_layer

    hf_dir = str(tmp_path / "hf")
    tiny_hf_model(arch, hf_dir)
    add_tiny_mtp_layer(hf_dir, arch, seed=4)
    architecture = get_architecture(arch).with_mtp(1)
    hf_to_mcore(hf_dir, str(tmp_path / "gpt"), architecture)
    hf_to_mcore(hf_dir, str(tmp_path / "hybrid"), architecture.for_model_class("hybrid"))
    assert convert_main(["gpt-to-hybrid", "--load", str(tmp_path / "gpt"), "--save", str(tmp_path / "migrated")]) == 0
    assert convert_main(["hybrid-to-gpt", "--load", str(tmp_path / "migrated"), "--save", str(tmp_path / "back")]) == 0
    assert convert_main(["gpt-to-hybrid", "--load", str(tmp_path / "hybrid"), "--save", str(tmp_path / "x")]) == 2

    def tensors(name):
        reader = ChunkReader(str(tmp_path / name / "release"))
        out = {}
        for key, (shape, dtype) in reader.tensors.items():
            out[key] = torch.empty(shape, dtype=dtype)
            reader.read_into([(key, (0,) * len(shape), out[key])])
        return out, sorted(reader.objects)

    for made, reference in (("migrated", "hybrid"), ("back", "gpt")):
        (got, got_objects), (want, want_objects) = tensors(made), tensors(reference)
        assert sorted(got) == sorted(want) and got_objects == want_objects, made
        assert all(torch.equal(got[k], want[k]) for k in want), made


def test_generate_and_export_on_a_hybrid_model_checkpoint(single_rank, tmp_path):
    """``hp_megatron.generate`` builds the HybridModel of a HybridModel checkpoint (DeepSeek-V3: MLA, dense and MoE
    MLPs): greedy tokens and log-probs equal those of the GPTModel conversion of the same HF model, and
    ``export_hf_weights`` of the HybridModel gives the HF checkpoint back bit for bit."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from hp_megatron.convert.engine import hf_to_mcore
    from hp_megatron.generate.loop import StaticGenerator, sampling_params
    from hp_megatron.generate.model import model_source
    from hp_megatron.models import export_hf_weights, get_architecture

    hf_dir = str(tmp_path / "hf")
    tiny_hf_model("deepseek_v3", hf_dir)
    results = {}
    for model_class in ("gpt", "hybrid"):
        ckpt = str(tmp_path / model_class)
        hf_to_mcore(hf_dir, ckpt, get_architecture("deepseek_v3").for_model_class(model_class))
        source = model_source(None, ckpt)
        model = source.build(load=ckpt)
        assert isinstance(model, HybridModel) == (model_class == "hybrid")
        generator = StaticGenerator(model, vocab_size=source.vocab_size, max_positions=source.max_positions,
                                    max_batch_size=2, max_sequence_length=24)
        results[model_class] = generator.generate([[1, 5, 7, 9, 3], [4, 4, 2]], sampling_params(max_new_tokens=5))
    exported = dict(export_hf_weights(model, hf_dir))
    assert results["hybrid"].tokens == results["gpt"].tokens
    for got, want in zip(results["hybrid"].log_probs, results["gpt"].log_probs):
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5
    original = read_safetensors(hf_dir)
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k].cpu(), v) for k, v in original.items())
