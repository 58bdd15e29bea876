"""megatron-core's ``HybridModel`` with our multi-token-prediction losses (``hp_megatron.decoder.mtp``).

megatron-core 0.19's ``HybridModel.forward`` computes the MTP losses with ``process_mtp_loss``, whose
``roll_tensor`` allocates CUDA buffers under CP (no CPU run), assumes the zigzag split and normalises each depth by
each CP rank's own token count. :class:`MTPHybridModel` keeps every module of megatron-core's class and, when the
model has an MTP block and runs outside inference, replaces only that part of the forward: embedding, rotary
tables, decoder and MTP block as megatron-core runs them, then :func:`hp_megatron.decoder.mtp.attach_mtp_losses`
(global token shift and normalisation over the CP group, the losses GPT's ``MTPGPTModel`` computes) and the output
layer. Without MTP, or in inference, it is ``HybridModel`` unchanged.
"""
from __future__ import annotations

import torch
from megatron.core.models.hybrid.hybrid_model import HybridModel

from hp_megatron.decoder.mtp import attach_mtp_losses, without_cuda_moves


class MTPHybridModel(HybridModel):
    """``HybridModel`` whose MTP losses are :func:`attach_mtp_losses`' (module docstring); arguments are
    megatron-core's."""

    def setup_embeddings_and_output_layer(self):
        """megatron-core's, also on a CPU-only torch (:func:`without_cuda_moves`)."""
        return without_cuda_moves(super().setup_embeddings_and_output_layer)

    def _ours(self, inference_context) -> bool:
        from megatron.core.inference.utils import InferenceMode

        return bool(self.mtp_process) and inference_context is None and not InferenceMode.is_active()

    def _rotary(self, decoder_input, packed_seq_params):
        """The rotary tables megatron-core's forward hands the layers (RoPE or YaRN; None otherwise)."""
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if self.position_embedding_type == "rope" and not self.config.multi_latent_attention:
            length = self.rotary_pos_emb.get_rotary_seq_len(None, self.decoder, decoder_input, self.config,
                                                            packed_seq_params)
            return self.rotary_pos_emb(length, packed_seq=packed)
        if self.position_embedding_type == "yarn":
            length = self.rotary_pos_emb.get_rotary_seq_len(None, self.decoder, decoder_input, self.config,
                                                            packed_seq_params)
            return self.rotary_pos_emb(length, packed_seq=packed)[0]
        return None

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_context=None, runtime_gather_output=None, *, inference_params=None, loss_mask=None,
                packed_seq_params=None, padding_mask=None):
        if not self._ours(inference_context if inference_context is not None else inference_params):
            return super().forward(input_ids, position_ids, attention_mask, decoder_input, labels, inference_context,
                                   runtime_gather_output, inference_params=inference_params, loss_mask=loss_mask,
                                   packed_seq_params=packed_seq_params, padding_mask=padding_mask)
        from megatron.core import tensor_parallel

        if decoder_input is None and self.pre_process:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
            if self.config.sequence_parallel and not self.embedding.scatter_to_sequence_parallel:
                decoder_input = tensor_parallel.scatter_to_sequence_parallel_region(decoder_input,
                                                                                    group=self.pg_collection.tp)
        rotary_pos_emb = self._rotary(decoder_input, packed_seq_params)
        hidden_states = self.decoder(hidden_states=decoder_input, attention_mask=attention_mask,
                                     inference_context=None, rotary_pos_emb=rotary_pos_emb,
                                     packed_seq_params=packed_seq_params, padding_mask=padding_mask)
        hidden_states = self.mtp(input_ids=input_ids, position_ids=position_ids, hidden_states=hidden_states,
                                 attention_mask=attention_mask, inference_params=None, rotary_pos_emb=rotary_pos_emb,
                                 packed_seq_params=packed_seq_params, embedding=self.embedding)
        if not self.post_process:
            return hidden_states
        hidden_states, *depth_states = torch.chunk(hidden_states, 1 + self.config.mtp_num_layers, dim=0)
        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        if labels is not None:
            hidden_states = attach_mtp_losses(self, hidden_states, depth_states, labels, loss_mask,
                                              packed_seq_params, output_weight, runtime_gather_output)
        logits, _ = self.output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
        logits = self._scale_logits(logits)
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [s, b, v] -> [b, s, v], as HybridModel
        return self.compute_language_model_loss(labels, logits)
