"""The megatron-core APIs that differ between the supported releases (0.16.1 .. 0.19.x), each behind one function.

The code follows megatron-core 0.19's API; where 0.16 differs, the function here maps it (tests/layers/
test_megatron_compat.py checks each on the installed version). Each switch is detected from megatron-core itself
(a signature, an attribute), not from its version number. "0.19" below is the release checked; which of 0.17 to
0.19 first made a change was not checked (0.17 and 0.18 are not tested).
"""
from __future__ import annotations

import contextlib
import functools
import inspect

import torch


@functools.cache
def _takes(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def experts_builder(module: type, submodules):
    """What ``BackendSpecProvider.grouped_mlp_modules`` returns for ``module(submodules=submodules)`` experts: a
    builder (``functools.partial``) on megatron-core 0.19, a ``(module, submodules)`` pair on 0.16."""
    from megatron.core.models.backends import BackendSpecProvider

    if _takes(BackendSpecProvider.grouped_mlp_modules, "moe_use_legacy_grouped_gemm"):
        return module, submodules
    return functools.partial(module, submodules=submodules)


def bind_moe_router_gemm() -> None:
    """megatron-core 0.16 without Transformer Engine never binds ``moe_utils.te_general_gemm``, yet its router
    reads it (0.19 binds None); bind None there."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def dense_mlp_spec(submodules):
    """A ``TransformerLayer``'s dense ``mlp`` spec: ``MLP.as_mlp_submodule`` bound to ``submodules`` on
    megatron-core 0.19 (which rewrites a ``ModuleSpec(MLP)`` into that, in place, with a warning), a
    ``ModuleSpec(MLP)`` on 0.16."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    if hasattr(MLP, "as_mlp_submodule"):
        return functools.partial(MLP.as_mlp_submodule, submodules=submodules)
    return ModuleSpec(module=MLP, submodules=submodules)


def gpt_inference_wrapper(model, context, *, max_batch_size: int, max_sequence_length: int):
    """megatron-core's ``GPTInferenceWrapper`` of ``model`` on the inference ``context``. On 0.19 it reads what
    it needs from the model's config and the context; 0.16 also takes an ``InferenceWrapperConfig`` (built here
    from the model's config and the cache sizes)."""
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper

    if not _takes(GPTInferenceWrapper.__init__, "inference_wrapper_config"):
        return GPTInferenceWrapper(model, context)
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig

    config = model.config
    wrapper_config = InferenceWrapperConfig(
        hidden_size=config.hidden_size, params_dtype=config.params_dtype,
        inference_batch_times_seqlen_threshold=-1, padded_vocab_size=model.vocab_size,
        inference_max_requests=max_batch_size, inference_max_seq_length=max_sequence_length)
    return GPTInferenceWrapper(model, wrapper_config, context)


def inference_mode():
    """The context megatron-core's static inference engine runs a model in: ``InferenceMode.active()`` on 0.19
    (its GPTModel then computes the last token's logits only, as the static context asks, and skips MTP), nothing
    on 0.16 (which reads the inference context alone)."""
    try:
        from megatron.core.inference.utils import InferenceMode
    except ImportError:
        return contextlib.nullcontext()
    return InferenceMode.active()


def common_state_in_dcp() -> bool:
    """Whether megatron-core's ``torch_dist`` checkpoints keep their common (non-tensor) state inside the DCP
    files, as the object ``common_state`` (0.19, which still reads ``common.pt``), rather than in ``common.pt``
    (0.16, whose ``serialization`` still has a common-state save strategy)."""
    from megatron.core.dist_checkpointing import serialization

    return not hasattr(serialization, "get_default_save_common_strategy")


def mtp_inner_layer_name() -> str:
    """The name of the transformer layer inside megatron-core's ``MultiTokenPredictionLayer`` (its submodule
    attribute, its ``MultiTokenPredictionLayerSubmodules`` field, its state-dict keys): ``mtp_model_layer`` on
    0.19 (whose checkpoint keys still say ``transformer_layer``), ``transformer_layer`` on 0.16."""
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayerSubmodules

    fields = MultiTokenPredictionLayerSubmodules.__dataclass_fields__
    return "mtp_model_layer" if "mtp_model_layer" in fields else "transformer_layer"


def mtp_layer_submodules(*, enorm, hnorm, eh_proj, layer, layer_norm):
    """megatron-core's ``MultiTokenPredictionLayerSubmodules`` with ``layer`` as its transformer layer
    (:func:`mtp_inner_layer_name`)."""
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayerSubmodules

    return MultiTokenPredictionLayerSubmodules(enorm=enorm, hnorm=hnorm, eh_proj=eh_proj, layer_norm=layer_norm,
                                               **{mtp_inner_layer_name(): layer})


def record_mtp_metrics(loss, depth: int, depths: int, reduce_group, acceptance: tuple) -> None:
    """Add MTP depth ``depth``'s ``loss`` to megatron-core's ``MTPLossLoggingHelper`` (logged as "mtp_<d> loss",
    summed over ``reduce_group``), its buffers made on the loss's device (megatron-core makes them on CUDA). On
    0.19 it also counts accepted predictions: ``acceptance`` is ``(logits, labels, loss_mask, output_layer,
    runtime_gather_output, tp_group)`` for megatron-core's own count (``_compute_mtp_acceptance_counts``)."""
    from megatron.core.transformer import multi_token_prediction as mtp

    helper = mtp.MTPLossLoggingHelper
    tracker = helper.tracker
    if not hasattr(helper, "save_metrics_to_tracker"):  # 0.16: the loss only
        if "values" not in tracker or tracker["values"].shape[0] != depths:
            tracker["values"] = torch.zeros(depths, device=loss.device)
        helper.save_loss_to_tracker(loss, depth, depths, reduce_group=reduce_group)
        return
    for key in ("loss_values", "correct_values", "total_values"):
        if key not in tracker or tracker[key].shape[0] != depths:
            tracker[key] = torch.zeros(depths, device=loss.device)
    correct, total = mtp._compute_mtp_acceptance_counts(*acceptance)
    helper.save_metrics_to_tracker(loss, correct, total, depth, depths, reduce_group=reduce_group)


def mtp_loss_values(reduce: bool = False):
    """The per-depth MTP losses megatron-core's ``MTPLossLoggingHelper`` holds (``tracker["loss_values"]`` on
    0.19, ``tracker["values"]`` on 0.16), with ``reduce`` first reduced over the tracker's groups (its
    ``reduce_metrics_in_tracker``, 0.16: ``reduce_loss_in_tracker``); KeyError when none was recorded."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper as helper

    new = hasattr(helper, "save_metrics_to_tracker")
    if reduce:
        (helper.reduce_metrics_in_tracker if new else helper.reduce_loss_in_tracker)()
    return helper.tracker["loss_values" if new else "values"]


def megatron_cp_batch(batch: dict, cp_group=None) -> dict:
    """megatron-core's zigzag CP slice of a BSHD ``batch`` (``megatron.core.utils.get_batch_on_this_cp_rank``,
    which on 0.19 also takes ``is_hybrid_cp``, here False)."""
    from megatron.core import utils

    if _takes(utils.get_batch_on_this_cp_rank, "is_hybrid_cp"):
        return utils.get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp_group)
    return utils.get_batch_on_this_cp_rank(batch, cp_group=cp_group)
