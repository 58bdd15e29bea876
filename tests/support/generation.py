"""Generation through megatron-core's StaticInferenceContext, window by window (shared by the decode tests)."""
from __future__ import annotations

import torch


def generate(layer, x, windows, micro_batches, max_batch=4):
    """Run ``x [s, b, h]`` window by window through a fresh StaticInferenceContext as megatron's inference
    wrapper does (micro-batches at ``batch_size_offset``, then ``sequence_len_offset`` advanced) -> [s, b, h]."""
    from megatron.core.inference.contexts.static_context import StaticInferenceContext
    from megatron.core.inference.utils import get_attention_mask

    context = StaticInferenceContext(max_batch, x.shape[0])
    mask = get_attention_mask(x.shape[0])
    outs, start = [], 0
    with torch.no_grad():
        for width in windows:
            end, pieces, row = start + width, [], 0
            for size in micro_batches:
                out, bias = layer(x[start:end, row:row + size], attention_mask=mask[..., start:end, :end],
                                  inference_context=context)
                assert bias is None or not bias.abs().any()
                pieces.append(out)
                context.batch_size_offset += size
                row += size
            context.reset_batch_size_offset()
            context.increment_sequence_len_offset(width)
            outs.append(torch.cat(pieces, dim=1))
            start = end
    return torch.cat(outs), context
