"""GPTModel with our multi-token-prediction losses (``hp_megatron.decoder.mtp``): global token shift and
normalisation over the CP group."""
from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel

from hp_megatron.decoder.mtp import attach_mtp_losses, without_cuda_moves


class MTPGPTModel(GPTModel):
    """megatron-core ``GPTModel`` whose multi-token-prediction losses use :func:`attach_mtp_losses` (global token
    shift and normalisation over the CP group); without MTP, or in inference, it is ``GPTModel`` unchanged."""

    def setup_embeddings_and_output_layer(self):
        """megatron-core's, also on a CPU-only torch: with pipeline parallelism it gives the MTP stage its copy of the
        embedding with ``weight.data.cuda()`` before the all-reduce; without CUDA that move is the identity here."""
        return without_cuda_moves(super().setup_embeddings_and_output_layer)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """megatron-core's, with ``metadata["dp_cp_group"]`` defaulted to the data x context parallel group (as
        megatron-core 0.19 does): megatron-core 0.16 reads it, without a default, to tie a later pipeline stage's
        MTP embedding copy to the first stage's."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

        return super().sharded_state_dict(prefix, sharded_offsets, ensure_metadata_has_dp_cp_group(metadata))

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb, rotary_pos_cos,
                     rotary_pos_sin, mtp_in_postprocess=None, loss_mask=None, inference_context=None, **kwargs):
        """megatron-core's ``_postprocess`` (its keywords pass through: 0.19 adds ``padding_mask`` and output
        processors) with :func:`attach_mtp_losses` for the MTP losses."""
        if not self.config.mtp_num_layers or not self.post_process or inference_context is not None:
            return super()._postprocess(hidden_states, input_ids, position_ids, labels, rotary_pos_emb, rotary_pos_cos,
                                        rotary_pos_sin, mtp_in_postprocess=mtp_in_postprocess, loss_mask=loss_mask,
                                        inference_context=inference_context, **kwargs)
        if kwargs.get("output_processor") is not None:
            raise ValueError("MTPGPTModel's multi-token prediction takes no output_processor")
        packed_seq_params = kwargs.get("packed_seq_params")
        runtime_gather_output = kwargs.get("runtime_gather_output")
        if mtp_in_postprocess:
            padding = {} if kwargs.get("padding_mask") is None else {"padding_mask": kwargs["padding_mask"]}
            hidden_states = self.mtp(input_ids=input_ids, position_ids=position_ids, hidden_states=hidden_states,
                                     attention_mask=kwargs.get("attention_mask"),
                                     inference_params=kwargs.get("inference_params"),
                                     rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
                                     rotary_pos_sin=rotary_pos_sin, packed_seq_params=packed_seq_params,
                                     sequence_len_offset=kwargs.get("sequence_len_offset"), embedding=self.embedding,
                                     **padding, **(kwargs.get("extra_block_kwargs") or {}))
        hidden_states, *depth_states = torch.chunk(hidden_states, 1 + self.config.mtp_num_layers, dim=0)
        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        if labels is not None:
            hidden_states = attach_mtp_losses(self, hidden_states, depth_states, labels, loss_mask,
                                              packed_seq_params, output_weight, runtime_gather_output)
        logits, _ = self.output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [s, b, v] -> [b, s, v], as GPTModel
        return self.compute_language_model_loss(labels, logits)
