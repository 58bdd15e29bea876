"""Multi-token prediction of the converted tiny DeepSeek-V3, Qwen3-Next and Qwen3.5-MoE checkpoints *with* MTP
tensors: the
MTP tensors convert both ways bit for bit (``--mtp-num-layers 1``; ``--drop-unmodeled`` still leaves them out),
and our model's MTP logits, its depth-1 loss and the gradients of every MTP parameter equal the independent
references of ``tests/support/mtp_case.py`` (transformers' ``MtpModel`` for DeepSeek-V3, the published
description in Qwen3-Next's module order) within 1e-4 relative."""
from __future__ import annotations

import pytest
import torch

from tests.support.models_case import read_safetensors, token_batch
from tests.support.mtp_case import reference_mtp_logits, tiny_mtp_checkpoint
from tests.support.reference import rel_err


def _converted_model(architecture, config, ckpt):
    from megatron.core import dist_checkpointing

    from hp_megatron.checkpoint import checkpoint_directory

    model = architecture.build_model(config)
    sharded = model.sharded_state_dict()
    state = dist_checkpointing.load(sharded, checkpoint_directory(ckpt))
    model.load_state_dict({k: v for k, v in state.items() if k in sharded}, strict=True)
    return model


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_next", "qwen3_5_moe_text", "bailing_hybrid"])
def test_mtp_converts_and_matches_the_reference(single_rank, arch, tmp_path, capsys):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from hp_megatron.convert.__main__ import main
    from hp_megatron.models import get_architecture
    from layers.base.megatron_compat import mtp_loss_values

    hf_dir, ckpt, back = str(tmp_path / "hf"), str(tmp_path / "mcore"), str(tmp_path / "back")
    hf_model, config = tiny_mtp_checkpoint(arch, hf_dir)
    assert main(["hf-to-mcore", "--load", hf_dir, "--save", ckpt, "--mtp-num-layers", "1"]) == 0
    assert main(["mcore-to-hf", "--load", ckpt, "--save", back]) == 0   # the checkpoint's MTP depth
    original, exported = read_safetensors(hf_dir), read_safetensors(back)
    mtp_keys = [k for k in original if k.startswith(("mtp.", f"model.layers.{config['num_hidden_layers']}."))]
    assert len(mtp_keys) > 10 and sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], t) and exported[k].dtype == t.dtype for k, t in original.items())
    assert main(["hf-to-mcore", "--load", hf_dir, "--save", str(tmp_path / "dropped"), "--drop-unmodeled"]) == 0
    assert f"left out {len(mtp_keys)} tensors of parts the model does not build" in capsys.readouterr().out

    architecture = get_architecture(arch).with_mtp(1)
    model = _converted_model(architecture, config, ckpt)
    model.train()
    depths = []
    model.mtp.register_forward_hook(lambda module, args, out: depths.append(out))
    ids, labels = token_batch(1)
    MTPLossLoggingHelper.tracker.clear()
    loss = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None, labels=labels)
    loss.mean().backward()
    depth1 = depths[0].chunk(2, dim=0)[1]
    with torch.no_grad():
        ours_logits = model.output_layer(depth1)[0].transpose(0, 1)[:, :-1]
    ours_loss = mtp_loss_values()[0]

    reference, params, ref_logits = reference_mtp_logits(arch, hf_dir, hf_model, ids, config)
    ref_loss = torch.nn.functional.cross_entropy(ref_logits.flatten(0, 1), labels[:, 1:].flatten())
    assert rel_err(ours_logits, ref_logits) <= 1e-4
    assert rel_err(ours_loss, ref_loss) <= 1e-4
    (model.config.mtp_loss_scaling_factor * ref_loss).backward()

    from tests.support.mtp_case import checkpoint_named

    ref_grads = checkpoint_named({k: p.grad for k, p in params.items()})
    rules = [r for r in architecture.conversion_rules(config) if r.mcore_key.startswith("mtp.")]
    ours = dict(model.named_parameters())
    trained = [r for r in rules if r.mcore_key in ours]   # not the router's expert-bias buffer
    assert {r.mcore_key for r in trained} == {k for k in ours if k.startswith("mtp.")}
    for rule in trained:
        expected = rule.to_mcore([ref_grads[k] for k in rule.hf_keys])
        assert rel_err(ours[rule.mcore_key].grad, expected) <= 1e-4, rule.mcore_key


def test_mtp_layer_kind_is_declared_or_refused(single_rank):
    """A hybrid pattern with MTP builds MTP layers of its declared kind only; none declared, or a non-attention kind,
    is a one-line ValueError."""
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlockSubmodules

    from hp_megatron.gpt.mtp_layer import MTPPatternLayer
    from hp_megatron.models import preset_from_hf, preset_layer_spec, preset_transformer_config
    from hp_megatron.models.tiny import tiny_hf_config
    from hp_megatron.platform import CPU_SAFE_CONFIG
    from hp_megatron.specs import get_hybrid_layer_spec
    from hp_megatron.specs.mtp_specs import get_mtp_block_spec
    from layers.base.megatron_compat import mtp_inner_layer_name

    preset = preset_from_hf(tiny_hf_config("qwen3_next")[1].to_dict())   # pattern GGAA
    undeclared = preset_transformer_config(preset, **CPU_SAFE_CONFIG, mtp_num_layers=1, hp_mtp_layer_symbol=None)
    with pytest.raises(ValueError, match=r"^multi-token prediction \(mtp_num_layers=1\) with the hybrid pattern "
                                         r"'GGAA' needs the kind of its MTP layers[^\n]*$"):
        get_mtp_block_spec(undeclared, get_hybrid_layer_spec(preset.pattern))
    with pytest.raises(ValueError, match=r"^GDN \(G, the multi-token-prediction layers' mixer of the pattern GGAA\) "
                                         r"cannot be megatron-core's MTP layer \(MixerSupport.mtp is False\)"):
        get_mtp_block_spec(undeclared, get_hybrid_layer_spec(preset.pattern, mtp_symbol="G"))
    block = get_mtp_block_spec(undeclared, get_hybrid_layer_spec(preset.pattern, mtp_symbol="A"))
    assert isinstance(block, MultiTokenPredictionBlockSubmodules) and len(block.layer_specs) == 1
    layer = getattr(block.layer_specs[0].submodules, mtp_inner_layer_name())
    assert layer.module is MTPPatternLayer and layer.params["symbol"] == "A"  # an MTP layer of the one kind A
    assert get_mtp_block_spec(preset_transformer_config(preset, **CPU_SAFE_CONFIG), preset_layer_spec(preset)) is None


def test_roll_to_next_token_stops_at_document_ends():
    """One rank: each position gets the next token of its row / packed document, 0 at the end."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from hp_megatron.decoder.mtp import roll_to_next_token

    x = torch.arange(1, 9).reshape(1, 8)
    assert roll_to_next_token(x).tolist() == [[2, 3, 4, 5, 6, 7, 8, 0]]
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    assert roll_to_next_token(x, packed_seq_params=packed).tolist() == [[2, 3, 0, 5, 6, 7, 8, 0]]
