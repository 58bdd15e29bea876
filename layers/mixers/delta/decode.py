"""Inference forward of the GDN / KDA mixers through megatron-core's static inference context.

Cache of one layer (``layers.shared.inference``), per sequence and TP rank (local heads):

    conv  [max_batch, W-1, 2*H_l*K + HV_l*V]   the last W-1 inputs of the short conv (params dtype)
    state [max_batch, HV_l, K, V]               the recurrent state (fp32)

Prefill (``sequence_len_offset == 0``): the chunked training op with ``output_final_state`` (and the conv over
the prompt); the cache gets the final state and the conv tail. A continuation of several tokens
(``sequence_len_offset > 0``, s > 1) runs the same op from the cached state and conv history. A decode step
(s == 1, ``sequence_len_offset > 0``): one recurrent update (``layers.ops.step``), vectorized over batch and heads.
megatron's static controller prefills up to the shortest prompt and then feeds every sequence its own next token
(the prompt's while it lasts), so each row is one unpadded sequence and no lengths are needed here.
"""
from __future__ import annotations

import torch

from layers.shared.inference import inference_window, layer_cache
from layers.ops.delta_rule import chunk_op
from layers.ops.step import check_decode_backend, delta_rule_step

IN_KERNEL = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)


def cache_specs(mixer, max_batch: int) -> list:
    """``[(shape, dtype, device)]`` of the conv history and the recurrent state for ``max_batch`` sequences."""
    weight = mixer.conv1d.weight
    conv_local = mixer.conv_dim // mixer.tp_size
    return [((max_batch, mixer.conv_kernel_dim - 1, conv_local), weight.dtype, weight.device),
            ((max_batch, mixer.value_heads_local, mixer.key_head_dim, mixer.value_head_dim), torch.float32,
             weight.device)]


def conv_tail(history, x, width: int):
    """The last ``width`` inputs of ``cat(history, x)`` along dim 1 (history None: zeros before x)."""
    if history is None:
        history = x.new_zeros(x.shape[0], width, x.shape[2])
    full = torch.cat([history.to(x.dtype), x], dim=1)
    return full[:, full.shape[1] - width:]


def delta_inference_forward(mixer, hidden_states, context, attention_mask):
    """``hidden_states [s, b, h]`` -> ``(out [s, b, h], bias)``, reading and updating the layer's cache rows."""
    owner = type(mixer).__name__
    rows, offset, seq, batch = inference_window(owner, context, hidden_states, attention_mask)
    check_decode_backend(mixer.backend)   # refuse before the prefill, not at the first decode step
    conv_cache, state_cache = layer_cache(owner, context, mixer.layer_number,
                                          cache_specs(mixer, context.max_batch_size))
    history, state = conv_cache[rows], state_cache[rows]   # views: in-place updates land in the cache
    decode = offset > 0 and seq == 1

    qkv, parts = mixer.split_projection(hidden_states)   # the forward's split and conv (DeltaMixer methods)
    weight, bias = mixer.conv1d.weight, mixer.conv1d.bias
    if decode:
        q, k, v = mixer.conv_heads(qkv, weight, bias, step_cache=history)
    else:
        prior = history if offset > 0 else None
        q, k, v = mixer.conv_heads(qkv, weight, bias, history=prior)
        if mixer.conv_kernel_dim > 1:
            history.copy_(conv_tail(prior, qkv, mixer.conv_kernel_dim - 1))

    g, beta, gate, gate_keywords = mixer.gates(parts, hidden_states)
    flags = dict(IN_KERNEL, use_beta_sigmoid_in_kernel=mixer.beta_sigmoid_in_kernel, backend=mixer.backend,
                 **gate_keywords)
    if decode:
        core = delta_rule_step(mixer.kind, q, k, v, g, beta, state, **flags)
    else:
        core, final = chunk_op(mixer.kind)(q, k, v, g, beta, initial_state=state if offset > 0 else None,
                                           output_final_state=True, **flags)
        state.copy_(final)
    return mixer.out_proj(mixer.normed_output(core, gate))
