"""Multi-token prediction (DeepSeek-V3 report, section 2.2) on megatron-core's MTP block, over any CP layout.

megatron-core 0.16 builds the MTP block (``MultiTokenPredictionBlock``) and computes its losses in
``GPTModel._postprocess``; both shift tokens with its ``roll_tensor``, which with context parallelism allocates CUDA
buffers (no CPU run), assumes the zigzag split (not ``--hp-cp-layout contiguous``) and, for packed documents under
CP, splits each document into two halves per rank; the per-depth loss is normalised by each CP rank's own token
count (a mean of means, not the single rank's mean). This module keeps megatron's modules and replaces the shift:

* :func:`roll_to_next_token`: each token gets the value of the next token of its row / packed document in
  *global* order (0 past a document's end). With CP the ``[b, s/P]`` integer tensor (token ids, labels, loss
  mask, positions) is all-gathered over the CP group into global order with the micro-batch's sequence plan
  (``layers.cp.sequence``), shifted, and this rank's positions taken back: ``b * s`` integers per depth, no
  activations.
* :class:`GlobalShiftMTPLayer`: megatron's MTP layer with that shift for the input ids.
* :func:`attach_mtp_losses` (``MTPGPTModel``'s ``_postprocess``): megatron's per-depth losses (output head on
  each depth's hidden states, labels and loss mask shifted once more per depth, ``MTPLossAutoScaler`` to add
  ``mtp_loss_scaling_factor / mtp_num_layers`` times each depth's mean to the backward), normalised by the token
  count of the whole CP group, logged with megatron's ``MTPLossLoggingHelper`` ("mtp_1 loss", ...).

Order of the combined input (as megatron, transformers' ``MtpLayer`` and DeepSeek's report):
``eh_proj([enorm(Emb(t_{i+k})); hnorm(h_i^{k-1})])``: the normalised embedding of the shifted tokens first.
"""
from __future__ import annotations

import torch
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MultiTokenPredictionLayer
from megatron.core.utils import make_viewless_tensor

from layers.cp.collectives import all_gather_raw
from layers.cp.sequence import packed_cu_seqlens, plan_for_batch
from layers.base.megatron_compat import record_mtp_metrics


def without_cuda_moves(setup):
    """``setup()`` (a model's ``setup_embeddings_and_output_layer``) also on a CPU-only torch: with pipeline
    parallelism megatron-core gives the MTP stage its copy of the embedding with ``weight.data.cuda()`` before the
    all-reduce; without CUDA that move is the identity here."""
    if torch.cuda.is_available():
        return setup()
    to_cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
    try:
        return setup()
    finally:
        torch.Tensor.cuda = to_cuda


def roll_to_next_token(x: torch.Tensor, cp_group=None, layout: str = "zigzag", packed_seq_params=None) -> torch.Tensor:
    """``x [b, s_local]`` (BSHD rows, or ``[1, t_local]`` of a THD stream) shifted one token left in global order:
    position ``g`` holds ``x[g + 1]``, or 0 where ``g`` is the last token of its row / packed document. With a CP
    group of ``P`` ranks, ``x`` holds this rank's tokens of ``layout`` (``zigzag | contiguous``)."""
    size = cp_group.size() if cp_group is not None else 1
    seq_len = x.shape[-1] * size
    cu = packed_cu_seqlens(packed_seq_params)
    if size > 1:
        plan = plan_for_batch(packed_seq_params, size, cp_group.rank(), layout, seq_len)
        local = x.movedim(-1, 0).contiguous()
        gathered = all_gather_raw(local, cp_group).reshape((seq_len,) + tuple(local.shape[1:]))
        x = gathered.index_select(0, plan.on("to_global", x.device)).movedim(0, -1)
    rolled = torch.roll(x, shifts=-1, dims=-1)
    ends = torch.tensor([seq_len - 1], device=x.device) if cu is None else (cu[1:] - 1).to(x.device)
    rolled.index_fill_(-1, ends, 0)
    if size > 1:
        rolled = rolled.index_select(-1, plan.on("local_index", x.device))
    return rolled


class GlobalShiftMTPLayer(MultiTokenPredictionLayer):
    """megatron-core's ``MultiTokenPredictionLayer`` whose token shift is :func:`roll_to_next_token` (any CP layout,
    packed documents, CPU)."""

    def _get_embeddings(self, input_ids, position_ids, embedding, hidden_states, packed_seq_params=None,
                        **padding):
        """megatron-core's: the shifted ids' embeddings and the viewless hidden states. megatron-core 0.19 also
        passes ``padding_mask`` (shifted as the ids) and takes it back third; 0.16 passes none."""
        layout = getattr(self.config, "hp_cp_layout", "zigzag")
        input_ids = roll_to_next_token(input_ids, self.cp_group, layout, packed_seq_params)
        if position_ids is not None:  # read only by learned absolute position embeddings
            position_ids = roll_to_next_token(position_ids, self.cp_group, layout, packed_seq_params)
        decoder_input = embedding(input_ids=input_ids, position_ids=position_ids)
        if getattr(self.config, "mtp_detach_heads", False):  # megatron-core 0.19's option
            decoder_input = decoder_input.detach()
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        if not hidden_states.requires_grad:  # a detached input: the layer's parameters still get gradients
            hidden_states.requires_grad_(True)
        if "padding_mask" not in padding:
            return input_ids, position_ids, decoder_input, hidden_states
        padding_mask = padding["padding_mask"]
        if padding_mask is not None:
            padding_mask = roll_to_next_token(padding_mask, self.cp_group, layout, packed_seq_params)
        return input_ids, position_ids, padding_mask, decoder_input, hidden_states


def _save_mtp_loss(loss: torch.Tensor, depth: int, depths: int, acceptance: tuple) -> None:
    """Megatron's MTP loss tracker (``track_mtp_metrics`` logs "mtp_<d> loss"): ``loss`` (this rank's term of its
    CP group's mean) over the data-parallel size, summed over data x context parallel ranks when logged: the mean
    of the data-parallel replicas (a SUM, not megatron's AVG reduction, which gloo lacks); ``acceptance``: as
    ``layers.base.megatron_compat.record_mtp_metrics`` takes it."""
    from megatron.core import parallel_state

    group = None
    if parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        loss = loss / parallel_state.get_data_parallel_world_size()
    record_mtp_metrics(loss, depth, depths, group, acceptance)


def attach_mtp_losses(model, hidden_states: torch.Tensor, depth_states, labels: torch.Tensor, loss_mask,
                      packed_seq_params, output_weight, runtime_gather_output) -> torch.Tensor:
    """``hidden_states`` (the decoder's, ``[s, b, h]``) carrying each MTP depth's loss into the backward
    (``MTPLossAutoScaler``); ``depth_states``: the MTP block's hidden states per depth. Depth ``k`` predicts
    ``labels`` shifted ``k`` tokens (:func:`roll_to_next_token`); its loss is the mean over the loss mask of the
    whole CP group (the sum with ``calculate_per_token_loss``); each CP rank's term is scaled by the CP size
    because megatron-core's DDP averages gradients over the data x context group."""
    config = model.config
    cp_group = model.cp_group if model.cp_group is not None and model.cp_group.size() > 1 else None
    cp_size = cp_group.size() if cp_group is not None else 1
    layout = getattr(config, "hp_cp_layout", "zigzag")
    mask = torch.ones_like(labels, dtype=torch.float) if loss_mask is None else loss_mask
    scale = config.mtp_loss_scaling_factor / config.mtp_num_layers
    for depth, states in enumerate(depth_states):
        logits, _ = model.output_layer(states, weight=output_weight, runtime_gather_output=runtime_gather_output)
        labels = roll_to_next_token(labels, cp_group, layout, packed_seq_params)
        mask = roll_to_next_token(mask, cp_group, layout, packed_seq_params)
        losses = model.compute_language_model_loss(labels, logits) * mask
        count = mask.sum()
        if cp_group is not None:
            torch.distributed.all_reduce(count, group=cp_group)
        if model.training:
            acceptance = (logits, labels, mask, model.output_layer, runtime_gather_output, model.tp_group)
            _save_mtp_loss(losses.sum() / count, depth, config.mtp_num_layers, acceptance)
        # megatron-core's DDP averages gradients over data x context ranks (sums them with per-token loss), as the
        # schedule's main loss expects; so each CP rank carries CP times its share of the group's mean
        term = losses if config.calculate_per_token_loss else losses * cp_size / count
        hidden_states = MTPLossAutoScaler.apply(hidden_states, scale * term)
    return hidden_states
