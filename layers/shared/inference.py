"""megatron-core's static inference context as our mixers use it (the contract of megatron's ``Attention`` and
``MambaMixer`` static paths).

A layer keeps its cache in ``context.key_value_memory_dict[layer_number]``: a tuple of tensors allocated once for
``context.max_batch_size`` sequences (batch first), of which a forward uses rows ``[batch_size_offset,
batch_size_offset + b)``. ``sequence_len_offset`` is the number of tokens of each sequence already in the cache:
0 means prefill (the cache rows are overwritten), > 0 continues them (one token: a decode step). megatron's
inference wrapper advances ``sequence_len_offset`` after each forward. Static batching only: megatron-core's
``DynamicInferenceContext`` is refused with a ValueError (0.16.1's attention path for it needs flash-attn's GPU
kernels, so it does not run on CPU; docs/layers.md, "Generation").
"""
from __future__ import annotations

import torch

from megatron.core.utils import deprecate_inference_params

from layers.shared.masks import check_inference_mask


def static_context(owner: str, module, inference_context, inference_params, *, cp_size: int,
                   sequence_parallel: bool, packed_seq_params):
    """The static context of a forward, or None when none was given; ValueError for what we cannot serve."""
    context = deprecate_inference_params(inference_context, inference_params)
    if context is None:
        return None
    if module.training:
        raise ValueError(f"{owner}: an inference context was given while the module is in training mode; call "
                         "model.eval() before generating (training forwards take no state caches)")
    if getattr(context, "is_dynamic_batching", lambda: False)() or not hasattr(context, "key_value_memory_dict"):
        raise ValueError(f"{owner} supports megatron-core's StaticInferenceContext (static batching) only; got "
                         f"{type(context).__name__}")
    if cp_size > 1:
        raise ValueError(f"{owner}: inference runs at context-parallel size 1 only (decode has one token per "
                         f"sequence); got CP size {cp_size}")
    if sequence_parallel:
        raise ValueError(f"{owner}: inference needs sequence_parallel=False (a decode step has one token, which "
                         "cannot be split over TP ranks); set config.sequence_parallel=False for generation")
    if packed_seq_params is not None:
        raise ValueError(f"{owner}: inference takes batched sequences [s, b, h], not packed ones "
                         "(packed_seq_params must be None)")
    return context


def inference_window(owner: str, context, hidden_states, attention_mask):
    """``(rows, offset, seq, batch)`` of a forward of ``hidden_states [s, b, h]``: the cache rows it uses, the tokens
    already cached; ValueError beyond the context's batch or sequence capacity or for a non-causal mask."""
    seq, batch = hidden_states.shape[:2]
    start, offset = context.batch_size_offset, context.sequence_len_offset
    if start + batch > context.max_batch_size:
        raise ValueError(f"{owner}: batch rows [{start}, {start + batch}) exceed the inference context's "
                         f"max_batch_size={context.max_batch_size}")
    if offset + seq > context.max_sequence_length:
        raise ValueError(f"{owner}: tokens [{offset}, {offset + seq}) exceed the inference context's "
                         f"max_sequence_length={context.max_sequence_length}")
    check_inference_mask(owner, attention_mask, offset, seq)
    return slice(start, start + batch), offset, seq, batch


def layer_cache(owner: str, context, layer_number, specs) -> tuple:
    """This layer's cache tensors (allocated zero on first use); ``specs`` is ``[(shape, dtype, device)]`` with
    the batch dimension first and sized ``context.max_batch_size``."""
    if layer_number is None:
        raise ValueError(f"{owner}: inference needs the layer's layer_number (the cache key); got None")
    cache = context.key_value_memory_dict.get(layer_number)
    if cache is None:
        cache = tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in specs)
        context.key_value_memory_dict[layer_number] = cache
    got = [(tuple(t.shape), t.dtype) for t in cache]
    want = [(tuple(shape), dtype) for shape, dtype, _ in specs]
    if got != want:
        raise ValueError(f"{owner}: the inference context's cache of layer {layer_number} holds {got}, this layer "
                         f"needs {want} (one context per model; reset it with a new StaticInferenceContext)")
    return cache
