"""The MultiLatentAttention test layer: a small MLA config and the layer on explicit TP / CP groups (tests/layers,
tests/cp); the bytes of Transformer Engine's ring attention, the baseline our MLA CP strategies are measured
against (tests/cp, benchmarks/mla_comm.py)."""
from __future__ import annotations

import torch


def make_config(*, hidden=32, heads=4, q_lora_rank=16, kv_lora_rank=12, qk=8, pe=4, v=6, rope_type="yarn",
                tp=1, sequence_parallel=False, **extra):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=heads, q_lora_rank=q_lora_rank,
        kv_lora_rank=kv_lora_rank, qk_head_dim=qk, qk_pos_emb_head_dim=pe, v_head_dim=v,
        rope_type=rope_type, rotary_scaling_factor=extra.pop("rotary_scaling_factor", 4.0),
        original_max_position_embeddings=16, mscale=1.0, rotary_base=10000,
        # megatron folds YaRN's mscale into the softmax scale even for plain RoPE; transformers does not.
        mscale_all_dim=extra.pop("mscale_all_dim", 1.0 if rope_type == "yarn" else 0.0),
        layernorm_epsilon=1e-6, use_cpu_initialization=True, params_dtype=torch.float32,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, add_bias_linear=False,
        tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel, **extra)


def build_layer(config, tp_group, cp_group, **kwargs):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from layers.mixers.mla.layer import MultiLatentAttention

    pgs = ProcessGroupCollection(tp=tp_group, cp=cp_group)
    return MultiLatentAttention(config, mla_submodules(), layer_number=1, pg_collection=pgs, **kwargs)


def mla_submodules():
    """The MLA submodules of the eager spec (``hp_megatron.specs``): column/row-parallel linears, RMSNorm latents,
    torch SDPA core attention."""
    from hp_megatron.specs import get_mixer_spec

    return get_mixer_spec("mla").submodules


def ring_comm_bytes(*, world_size: int, tokens_per_rank: int, heads: int, qk_head_dim: int, qk_pos_emb_head_dim: int,
                    v_head_dim: int, kv_lora_rank: int = 0, element_size: int = 4) -> dict:
    """Bytes one rank sends per layer under Transformer Engine's P2P ring attention (``{"forward", "backward"}``),
    keywords as ``layers.cp.mla.mla_comm_bytes``: every rank's expanded K and V go around the ring (P-1 hops)
    forward, and in backward K/V again plus dK/dV (P-1 hops each); ``kv_lora_rank`` plays no part."""
    kv = (world_size - 1) * tokens_per_rank * heads * (qk_head_dim + qk_pos_emb_head_dim + v_head_dim) * element_size
    return {"forward": kv, "backward": 2 * kv}
