"""Generation through megatron-core's StaticInferenceContext: every token a GDN / KDA / MLA layer produces from its
cache (prefill, then decode steps) equals the training forward over the whole sequence at that position.

The schedules are those of megatron's static text generation controller: prefill up to the shortest prompt of the
batch, then one token per step for every row (the rows with longer prompts get their prompt tokens), with the
window's slice of megatron's causal mask; plus a chunked continuation (several tokens after the prefill) on two
micro-batches that share the cache through ``batch_size_offset``. fp32, 1e-4 relative per position. Eager here on
one rank; FLA's kernels (Triton interpreter) in one 2-rank spawn (GDN on rank 0, KDA on rank 1); TP2 in the shared
2-rank spawn.
"""
from __future__ import annotations

import traceback

import pytest
import torch

from tests.support import triton_interpreter
from tests.support.dist import run_distributed_once, share_spawn
from tests.support.generation import generate
from tests.support.reference import rel_err

HIDDEN = 32
TOL = 1e-4
DIMS = {"gdn": dict(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8),   # GVA: HV = 2 H
        "kda": dict(num_key_heads=2, num_value_heads=2, key_head_dim=8, value_head_dim=8)}
KINDS = ("gdn", "kda", "mla", "mla_no_q_lora")
PROMPTS = (3, 5, 7)      # one batch, three prompt lengths: prefill 3 tokens, then 1-token steps
TOTAL = 9
# (windows, micro-batch sizes): megatron's controller; a continuation of 3 tokens on two micro-batches
SCHEDULES = {"controller": ((min(PROMPTS),) + (1,) * (TOTAL - min(PROMPTS)), (len(PROMPTS),)),
             "continuation_microbatches": ((4, 3, 1, 1), (2, 1))}


def build(kind, tp_group=None, cp_group=None, backend="eager"):
    """The layer in eval mode, on explicit groups (None: megatron's default ones)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    from layers import GatedDeltaNet, KimiDeltaAttention
    from tests.support.mla_layer import build_layer, make_config

    tp = 1 if tp_group is None else tp_group.size()
    if kind.startswith("mla"):
        config = make_config(hidden=HIDDEN, q_lora_rank=None if kind == "mla_no_q_lora" else 16, tp=tp)
        return build_layer(config, tp_group, cp_group).eval()
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
                               params_dtype=torch.float32, gradient_accumulation_fusion=False,
                               bias_dropout_fusion=False, tensor_model_parallel_size=tp)
    groups = {} if tp_group is None else {"pg_collection": ProcessGroupCollection(tp=tp_group, cp=cp_group)}
    cls = GatedDeltaNet if kind == "gdn" else KimiDeltaAttention
    return cls(config, None, layer_number=1, backend=backend, **groups, **DIMS[kind]).eval()


def position_errors(layer, x, windows, micro_batches):
    """Per position, the relative error of the generated output against the full training forward."""
    with torch.no_grad():
        full, _ = layer(x)
    got, context = generate(layer, x, windows, micro_batches)
    return [rel_err(got[t], full[t]) for t in range(x.shape[0])], context


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("kind", KINDS)
def test_decode_equals_full_forward(single_rank, kind, schedule):
    layer = build(kind)
    x = torch.randn(TOTAL, len(PROMPTS), HIDDEN, generator=torch.Generator().manual_seed(5))
    errors, context = position_errors(layer, x, *SCHEDULES[schedule])
    assert max(errors) < TOL, errors
    cache = context.key_value_memory_dict[layer.layer_number]
    if kind.startswith("mla"):   # the latent cache: kv_lora_rank + rotary dims per token
        d = layer.dims
        assert [tuple(t.shape) for t in cache] == [(4, TOTAL, d.kv_lora_rank + d.pe)]
    else:
        H, HV, K, V = layer.num_key_heads, layer.num_value_heads, layer.key_head_dim, layer.value_head_dim
        assert [tuple(t.shape) for t in cache] == [(4, layer.conv_kernel_dim - 1, 2 * H * K + HV * V),
                                                   (4, HV, K, V)]
        assert cache[1].dtype == torch.float32


@pytest.mark.parametrize("kind", ("gdn", "mla"))
def test_bad_input(single_rank, kind):
    from megatron.core.inference.contexts.static_context import StaticInferenceContext

    layer = build(kind)
    x = torch.randn(4, 3, HIDDEN)
    with torch.no_grad():
        with pytest.raises(ValueError, match="max_batch_size=2"):
            layer(x, inference_context=StaticInferenceContext(2, 8))
        context = StaticInferenceContext(3, 5)
        layer(x, inference_context=context)
        context.increment_sequence_len_offset(4)
        layer(x[:1], inference_context=context)
        context.increment_sequence_len_offset(1)
        with pytest.raises(ValueError, match="max_sequence_length=5"):   # decode beyond the cache
            layer(x[:1], inference_context=context)

        class Dynamic:
            key_value_memory_dict = {}

            @staticmethod
            def is_dynamic_batching():
                return True

        with pytest.raises(ValueError, match="StaticInferenceContext"):
            layer(x, inference_context=Dynamic())
        padding = torch.ones(4, 4, dtype=torch.bool).triu(1)[None, None].clone()
        padding[..., 1] = True
        with pytest.raises(ValueError, match="non-causal"):
            layer(x, attention_mask=padding, inference_context=StaticInferenceContext(3, 8))
    layer.train()
    with pytest.raises(ValueError, match="training mode"):
        layer(x, inference_context=StaticInferenceContext(3, 8))


def test_step_op_errors():
    from layers.ops import causal_conv1d_step, delta_rule_step

    q = torch.randn(2, 1, 2, 8)
    v = torch.randn(2, 1, 4, 8)
    g, beta = torch.randn(2, 1, 4), torch.randn(2, 1, 4)
    with pytest.raises(TypeError, match="float32"):
        delta_rule_step("gdn", q, q, v, g, beta, torch.zeros(2, 4, 8, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="one token"):
        delta_rule_step("gdn", q.repeat(1, 2, 1, 1), q.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1),
                        g.repeat(1, 2, 1), beta.repeat(1, 2, 1), torch.zeros(2, 4, 8, 8))
    with pytest.raises(ValueError, match="history"):
        causal_conv1d_step(torch.randn(2, 1, 6), torch.randn(2, 2, 6), torch.randn(6, 4))


# -- FLA's kernels in Triton's interpreter (own spawn: the interpreter must be on before FLA is imported) ---------
TRITON_REASON = triton_interpreter.available()
TRITON_KINDS = ("gdn", "kda")


def _triton_worker(rank, world_size):
    from hp_megatron.platform import apply_cpu_shims

    triton_interpreter.enable()
    apply_cpu_shims(0)
    import torch.distributed as dist

    singles = [dist.new_group([r]) for r in range(world_size)]
    kind = TRITON_KINDS[rank]
    try:
        layer = build(kind, singles[rank], singles[rank], backend="triton")
        eager = build(kind, singles[rank], singles[rank])
        x = torch.randn(6, 2, HIDDEN, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            eager_full, _ = eager(x)
            full, _ = layer(x)
        got, _ = generate(layer, x, (3, 1, 1, 1), (2,))
        return {"errors": [rel_err(got[t], full[t]) for t in range(6)],
                "vs_eager": [rel_err(got[t], eager_full[t]) for t in range(6)]}
    except Exception:  # noqa: BLE001 - reported to the test
        return {"error": traceback.format_exc()}


@pytest.mark.skipif(TRITON_REASON is not None, reason=f"triton interpreter: {TRITON_REASON or ''}")
@pytest.mark.parametrize("kind", TRITON_KINDS)
def test_triton_decode_equals_full_forward(kind):
    result = run_distributed_once(_triton_worker, 2)[TRITON_KINDS.index(kind)]
    assert "error" not in result, result.get("error")
    assert max(result["errors"]) < TOL, result["errors"]
    assert max(result["vs_eager"]) < TOL, result["vs_eager"]


# -- TP2: heads and caches split over two ranks (the shared 2-rank spawn) -------------------------------------------
TP_KINDS = ("gdn", "kda", "mla")


def _tp2_worker(rank, world_size):
    import torch.distributed as dist

    from hp_megatron.platform import apply_cpu_shims

    from megatron.core import parallel_state

    apply_cpu_shims(0)
    tp_group = dist.new_group(list(range(world_size)))
    singles = [dist.new_group([r]) for r in range(world_size)]
    created = not parallel_state.model_parallel_is_initialized()
    if created:   # megatron's global buffers; the layers use the groups above
        parallel_state.initialize_model_parallel(1, 1)
    results = {}
    for kind in TP_KINDS:
        try:
            torch.manual_seed(0)
            layer = build(kind, tp_group, singles[rank])
            x = torch.randn(TOTAL, len(PROMPTS), HIDDEN, generator=torch.Generator().manual_seed(5))
            errors, context = position_errors(layer, x, *SCHEDULES["controller"])
            cache = context.key_value_memory_dict[layer.layer_number]
            results[kind] = {"errors": errors, "cache": [tuple(t.shape) for t in cache]}
        except Exception:  # noqa: BLE001 - reported to the test; the ranks fail the same case together
            results[kind] = {"error": traceback.format_exc()}
    if created:
        parallel_state.destroy_model_parallel()
    return results


_tp2_results = share_spawn(_tp2_worker, (2,))


@pytest.mark.parametrize("kind", TP_KINDS)
def test_tp2_decode_equals_full_forward(kind):
    per_rank = [r[kind] for r in _tp2_results(2)]
    for result in per_rank:
        assert "error" not in result, result.get("error")
        assert max(result["errors"]) < TOL, result["errors"]
    caches = per_rank[0]["cache"]
    if kind == "mla":   # the latent is shared by all heads: every rank holds all of it
        assert caches == [(4, TOTAL, 12 + 4)]
    else:               # local heads: half the value heads, half the conv channels per rank
        HV, K, V = 4 if kind == "gdn" else 2, 8, 8
        H = 2
        assert caches == [(4, 3, (2 * H * K + HV * V) // 2), (4, HV // 2, K, V)]


def test_softmax_core_attention_with_cached_keys(single_rank):
    """The core attention of megatron's SelfAttention in our specs (the "A" layers of hybrid models): under the
    static inference context megatron hands it the queries of this window and the keys/values of the whole cache
    (with the window of its causal mask, or None); the queries attend causally from their positions."""
    from megatron.core.inference.utils import get_attention_mask
    from megatron.core.transformer import TransformerConfig

    from layers.mixers.attention.context_parallel import ContextParallelDotProductAttention

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2,
                               attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32)
    attention = ContextParallelDotProductAttention(config, layer_number=1)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(7, 2, 4, 8, generator=gen)
    k, v = torch.randn(7, 2, 2, 8, generator=gen), torch.randn(7, 2, 2, 8, generator=gen)
    mask = get_attention_mask(7)
    full = attention(q, k, v, mask)
    for start, end in ((4, 5), (5, 7)):   # a decode step, a continuation of two tokens
        window = attention(q[start:end], k[:end], v[:end], mask[..., start:end, :end])
        assert rel_err(window, full[start:end]) < 1e-6
        assert torch.equal(window, attention(q[start:end], k[:end], v[:end], None))
    with pytest.raises(ValueError, match="non-causal"):
        attention(q[4:5], k[:5], v[:5], torch.zeros(1, 1, 1, 5, dtype=torch.bool).index_fill_(-1, torch.tensor([4]),
                                                                                              True))
