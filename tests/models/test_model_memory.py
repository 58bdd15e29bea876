"""benchmarks/model_memory.py's arithmetic against a direct measurement: the per-layer figures it derives (three
lengths, reduced expert counts extrapolated to the real one) must add up to what a whole tiny model keeps for
backward at a fourth length (all multiples of the delta rules' chunk of 64), so the capacity table cannot
drift from what the layers save."""
from __future__ import annotations

import pytest
import torch

from hp_megatron.models.architectures import preset_from_hf
from hp_megatron.models.tiny import tiny_hf_config

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_memory():
    from benchmarks import model_memory

    return model_memory


@pytest.mark.parametrize("arch", ["qwen3_next", "kimi_linear"])
def test_per_layer_figures_add_up_to_the_measured_model(single_rank, model_memory, arch):
    hf = tiny_hf_config(arch)[1].to_dict()
    preset = preset_from_hf(hf)
    kinds = model_memory.layer_kinds(preset)
    assert len(set(kinds)) >= 3 and any(moe for _, moe in kinds) and not all(moe for _, moe in kinds)
    measured = {kind: model_memory.measure_kind(preset, *kind, Ts=(64, 128, 192), log=lambda *_: None)
                for kind in set(kinds)}
    T, hidden = 256, preset.transformer_fields["hidden_size"]
    predicted = sum(model_memory.predicted_bytes(measured[k], T) for k in kinds)
    torch.manual_seed(0)
    block = model_memory.build_block(preset, kinds)   # the real expert count, every layer in order
    direct = model_memory.measure_block(block, T, hidden)
    assert abs(predicted - direct) <= 0.02 * direct, (predicted, direct)


def test_model_figures_and_capacity(model_memory):
    class Preset:   # two layers of hidden 4: inputs 2 * 4 * 2 bytes per token under full recompute
        pattern = "GA"
        transformer_fields = dict(hidden_size=4)

    measured = {("G", False): dict(bytes_per_token=100.0), ("A", False): dict(bytes_per_token=300.0)}
    figures = model_memory.model_figures(Preset, measured, vocab=10)
    assert figures[1] == dict(layers=400.0, head=40.0, total=440.0, total_recompute=2 * 2 * 4 + 300.0 + 40.0)
    assert figures[4]["total"] == 110.0
    cap = model_memory.capacity(bytes_per_token=1e9 / 1000, budget_gb=1.0, tp=2)   # 1000 tokens per GPU
    assert cap["tokens_per_gpu"] == 1000
    assert cap["plan"][128 * 1024] == dict(cp=256, gpus=512)   # 131072 / 1000 -> 132 -> CP 256
    with pytest.raises(ValueError, match="--T needs three different"):
        model_memory.main(["--T", "64", "64", "128"])
