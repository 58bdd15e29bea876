"""layers.base.megatron_compat on the installed megatron-core: each mapping gives what that megatron-core consumes
(tests/run_mcore_versions.sh runs this file on 0.16.1 too)."""
from __future__ import annotations

import os

import pytest
import torch

from layers.base import megatron_compat as compat


def _config(**overrides):
    from hp_megatron.config import HybridTransformerConfig
    from hp_megatron.platform import CPU_SAFE_CONFIG

    fields = dict(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, normalization="RMSNorm",
                  add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
                  **CPU_SAFE_CONFIG)
    return HybridTransformerConfig(**{**fields, **overrides})


def test_dense_and_moe_mlps_build_and_run(single_rank):
    """``dense_mlp_spec``, ``experts_builder`` (through the providers' ``grouped_mlp_modules``) and
    ``bind_moe_router_gemm``: layer 1 of moe_layer_freq [1, 0] is megatron-core's MoE layer with our providers'
    SequentialMLP experts, layer 2 its dense MLP, and both run forward and backward."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from hp_megatron.specs import get_layer_spec

    config = _config(num_moe_experts=2, moe_router_topk=2, moe_layer_freq=[1, 0], moe_ffn_hidden_size=8,
                     moe_token_dispatcher_type="allgather", moe_grouped_gemm=False)
    spec = get_layer_spec("attn")
    layers = [spec.module(config, spec.submodules, layer_number=n, **spec.params) for n in (1, 2)]
    moe, dense = layers[0].mlp, layers[1].mlp
    assert isinstance(moe, MoELayer) and isinstance(moe.experts, SequentialMLP)
    assert len(moe.experts.local_experts) == 2
    assert type(moe.experts.local_experts[0].linear_fc1) is ColumnParallelLinear
    assert type(dense) is MLP and dense.linear_fc1.weight.shape == (32, 16)
    x = torch.randn(6, 2, 16, requires_grad=True)
    for mlp in (moe, dense):
        out, _ = mlp(x)
        assert out.shape == x.shape and torch.isfinite(out).all()
        out.sum().backward()
    assert moe.router.weight.grad is not None and x.grad is not None


def test_gpt_inference_wrapper_serves_the_static_context(single_rank):
    """``gpt_inference_wrapper`` and ``inference_mode``: megatron-core's wrapper on our context; one forward gives
    the last position's logits (the static context asks for those only) and advances the context by the window."""
    from megatron.core.inference.contexts import StaticInferenceContext

    from hp_megatron.specs import get_layer_spec
    from hp_megatron.model_builders import hybrid_gpt_model

    model = hybrid_gpt_model(_config(num_layers=1), get_layer_spec("attn"), vocab_size=24, max_sequence_length=16)
    context = StaticInferenceContext(2, 16)
    wrapper = compat.gpt_inference_wrapper(model, context, max_batch_size=2, max_sequence_length=16)
    assert wrapper.inference_context is context
    with torch.inference_mode(), compat.inference_mode():
        wrapper.prep_model_for_inference()
        inputs = wrapper.prep_inference_input(torch.randint(0, 24, (2, 5)))
        logits = wrapper.run_one_forward_step(wrapper.get_batch_for_context_window(inputs, 0, 3))
    assert logits.shape == (2, 1, 24) and context.sequence_len_offset == 3


def test_common_state_is_read_where_megatron_core_saves_it(single_rank, tmp_path):
    """``common_state_in_dcp`` says where ``dist_checkpointing.save`` puts the common state, and the converter's
    reader and the checkpoint check find it there."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from hp_megatron.checkpoint import read_common_state, verify_checkpoint_files

    state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0).reshape(2, 3)), "iteration": 3}
    dist_checkpointing.save(state, str(tmp_path))
    assert os.path.isfile(tmp_path / "common.pt") is not compat.common_state_in_dcp()
    verify_checkpoint_files(str(tmp_path))
    assert read_common_state(str(tmp_path))["iteration"] == 3


def test_mtp_names_and_metrics_are_megatron_cores(single_rank):
    """``mtp_layer_submodules`` fills the field ``mtp_inner_layer_name`` names; ``record_mtp_metrics`` and
    ``mtp_loss_values`` write and read megatron-core's tracker, which logs the same loss (and, where megatron-core
    counts them, the accepted predictions: argmax = label at unmasked positions)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    submodules = compat.mtp_layer_submodules(enorm=1, hnorm=2, eh_proj=3, layer="the layer", layer_norm=4)
    assert getattr(submodules, compat.mtp_inner_layer_name()) == "the layer"
    MTPLossLoggingHelper.tracker.clear()
    logits = torch.zeros(3, 1, 5)
    logits[0, 0, 1] = logits[1, 0, 2] = logits[2, 0, 4] = 1.0      # predicts 1, 2, 4
    labels, mask = torch.tensor([[1, 3, 4]]), torch.tensor([[1.0, 1.0, 0.0]])
    compat.record_mtp_metrics(torch.tensor(0.75), 0, 1, None, (logits, labels, mask, None, True, None))
    assert compat.mtp_loss_values(reduce=True).tolist() == [0.75]
    if "correct_values" in MTPLossLoggingHelper.tracker:
        assert MTPLossLoggingHelper.tracker["correct_values"].tolist() == [1.0]
        assert MTPLossLoggingHelper.tracker["total_values"].tolist() == [2.0]
    totals = {}
    MTPLossLoggingHelper.track_mtp_metrics(1.0, 0, None, total_loss_dict=totals)
    assert float(totals["mtp_1 loss"]) == pytest.approx(0.75)
