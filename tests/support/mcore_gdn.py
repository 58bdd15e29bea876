"""megatron-core's own GatedDeltaNet (``megatron.core.ssm.gated_delta_net``) beside ours, for
tests/models/test_megatron_core_gdn.py: their layer and their models built on CPU, weights and gradients moved
through *their* ``sharded_state_dict`` (the global offset of every local piece, as their checkpoints store it) and
through ours (``global_parts``), so no side's layout is assumed to be the other's.

Their layer: megatron-core's ``ColumnParallelLinear`` / ``RowParallelLinear`` and ``WrappedTorchNorm`` (an RMSNorm)
in place of the TE modules of their spec. Their models: megatron-core's own spec functions and
``hybrid_stack_spec`` with tests/support/te_standin.py's stand-ins. Their kernels are FLA's (Triton; on CPU through
Triton's interpreter in the spawned ranks). Their ``@jit_fuser`` functions (``torch.compile``) run uncompiled there
(megatron-core's ``disable_jit_fuser()`` before their module is imported: the same ops, no CPU compile of half a
minute per process).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

HIDDEN = 32
LAYER_DIMS = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_conv_kernel_dim=4)
# GDN's default A_log range (1, 16) decays so fast that the fp32 A_log / dt_bias gradients lose digits to
# cancellation (tests/support/delta_layer_cases.py); both sides get A_log from this milder range
A_INIT_RANGE = (0.5, 2.0)
MODEL_FIELDS = dict(hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=64, normalization="RMSNorm",
                    layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                    add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0, params_dtype=torch.float32,
                    **LAYER_DIMS)
MOE_FIELDS = dict(num_moe_experts=2, moe_router_topk=1, moe_router_pre_softmax=True, moe_ffn_hidden_size=32,
                  moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
                  moe_aux_loss_coeff=0.0)
VOCAB, MAX_SEQ = 64, 64
# their models: a GPTModel (all GDN, MoE in layer 1) and a HybridModel (GDN, MLP, attention, MLP)
GPT_PATTERN, GPT_MOE = "GG", (False, True)
HYBRID_PATTERN = "G-*-"


def _platform_fields():
    from hp_megatron.platform import CPU_SAFE_CONFIG

    return CPU_SAFE_CONFIG


def layer_config(tp=1, cp=1, sp=False, **dims):
    from megatron.core.transformer import TransformerConfig

    fields = dict(MODEL_FIELDS, **dims)
    return TransformerConfig(num_layers=1, tensor_model_parallel_size=tp, context_parallel_size=cp,
                             sequence_parallel=sp, **fields, **_platform_fields())


def _groups(tp_group, cp_group):
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection(tp=tp_group, cp=cp_group)


def build_theirs(config, tp_group, cp_group):
    """megatron-core's GatedDeltaNet with megatron's local linears and its torch RMSNorm."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    submodules = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm,
                                         out_proj=RowParallelLinear)
    return GatedDeltaNet(config, submodules, layer_number=1, pg_collection=_groups(tp_group, cp_group))


def build_ours(config, tp_group, cp_group, **options):
    from layers import GatedDeltaNet

    return GatedDeltaNet(config, None, layer_number=1, pg_collection=_groups(tp_group, cp_group),
                         A_init_range=A_INIT_RANGE, **options)


# ---------------------------------------------------------------------------------------------- their layout
def sharded_pieces(layer, data_of=None):
    """``[(checkpoint key, global shape, global offset, local tensor)]`` of ``layer.sharded_state_dict()``:
    factories built into their pieces; ``data_of(param)`` replaces each parameter by another tensor of its shape
    (its gradient), the pieces then being views of that."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    data_of = data_of or (lambda p: p)
    pieces = []
    for value in layer.sharded_state_dict().values():
        if isinstance(value, ShardedTensorFactory):
            built = value.build_fn(value.key, data_of(value.data), value.replica_id, None)
        elif isinstance(value, ShardedTensor):
            built = [dataclasses.replace(value, data=data_of(value.data))]
        else:   # _extra_state objects
            continue
        for piece in built:
            if piece.prepend_axis_num:
                raise ValueError(f"{piece.key}: unexpected prepended axes")
            pieces.append((piece.key, tuple(piece.global_shape), tuple(piece.global_offset), piece.data))
    return pieces


def _region(offset, local):
    return tuple(slice(o, o + s) for o, s in zip(offset, local.shape))


@torch.no_grad()
def load_global(layer, parts: dict) -> None:
    """Write global tensors (``parts`` by checkpoint key: ours' ``global_parts()`` names) into ``layer``'s local
    parameters at the places its sharded_state_dict gives them."""
    pieces = sharded_pieces(layer)
    missing = sorted({k for k, *_ in pieces} ^ set(parts))
    if missing:
        raise KeyError(f"checkpoint keys differ between the two layers: {missing}")
    for key, shape, offset, local in pieces:
        if tuple(parts[key].shape) != shape:
            raise ValueError(f"{key}: global shape {shape} vs {tuple(parts[key].shape)}")
        local.copy_(parts[key][_region(offset, local)])


def gather_global(layer, data_of, group) -> dict:
    """Global tensors (by checkpoint key) of ``data_of(param)`` over ``group``'s ranks, placed by the layer's
    sharded_state_dict (replicated pieces: the same on every rank)."""
    mine = [(k, shape, offset, local.detach().clone()) for k, shape, offset, local in sharded_pieces(layer, data_of)]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    out = {}
    for pieces in everyone:
        for key, shape, offset, local in pieces:
            target = out.setdefault(key, torch.full(shape, float("nan")))
            target[_region(offset, local)] = local
    return out


def layout_of(layer) -> dict:
    """``{checkpoint key: (global shape, global offset, local shape)}`` of this rank's pieces."""
    return {(k, offset): (shape, tuple(local.shape)) for k, shape, offset, local in sharded_pieces(layer)}


# ---------------------------------------------------------------------------------------------- their models
def gpt_model(pattern=GPT_PATTERN, moe=GPT_MOE):
    """megatron-core's GPTModel with its GatedDeltaNet layers (``experimental_attention_variant``), its own layer
    spec function on the TE stand-ins; GDN wherever ``pattern`` has G."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_layer_with_experimental_attention_variant_spec)
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from tests.support.te_standin import StandInTEProvider

    config = TransformerConfig(num_layers=len(pattern), experimental_attention_variant="gated_delta_net",
                               linear_attention_freq=[int(s == "G") for s in pattern],
                               moe_layer_freq=[int(m) for m in moe], **MODEL_FIELDS, **MOE_FIELDS,
                               **_platform_fields())
    provider = StandInTEProvider()
    specs = get_transformer_layer_with_experimental_attention_variant_spec(config, provider)
    block = TransformerBlockSubmodules(layer_specs=specs, layer_norm=provider.layer_norm(rms_norm=True))
    return GPTModel(config, block, vocab_size=VOCAB, max_sequence_length=MAX_SEQ, position_embedding_type="rope")


def hybrid_model(pattern=HYBRID_PATTERN):
    """megatron-core's HybridModel of ``hybrid_stack_spec`` with the TE stand-ins."""
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer import TransformerConfig

    from tests.support.te_standin import hybrid_final_norm, substitute

    config = TransformerConfig(num_layers=len(pattern), **MODEL_FIELDS, **_platform_fields())
    with hybrid_final_norm():
        return HybridModel(config, substitute(hybrid_stack_spec), vocab_size=VOCAB, max_sequence_length=MAX_SEQ,
                           hybrid_layer_pattern=pattern, position_embedding_type="rope")


def our_model(key_map, model_class: str = "gpt"):
    """Our GPTModel (``model_class="hybrid"``: our HybridModel) for a megatron_gdn ``KeyMap`` (its pattern and MoE
    layers)."""
    from hp_megatron.config import HybridTransformerConfig
    from hp_megatron.specs import get_hybrid_layer_spec
    from hp_megatron.model_builders import hybrid_gpt_model, hybrid_model

    moe = dict(MOE_FIELDS, moe_layer_freq=[int(m) for m in key_map.moe_layers]) if any(key_map.moe_layers) else {}
    config = HybridTransformerConfig(num_layers=len(key_map.pattern), hp_layer_pattern=key_map.pattern,
                                     **MODEL_FIELDS, **moe, **_platform_fields())
    if model_class == "hybrid":
        return hybrid_model(config, vocab_size=VOCAB, max_sequence_length=MAX_SEQ, position_embedding_type="rope")
    return hybrid_gpt_model(config, get_hybrid_layer_spec(key_map.pattern), vocab_size=VOCAB,
                            max_sequence_length=MAX_SEQ, position_embedding_type="rope")


@torch.no_grad()
def randomize(model, seed):
    """Every parameter drawn from N(0, 0.3^2) (norm weights around 1), A_log from :data:`A_INIT_RANGE`."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(*A_INIT_RANGE, generator=gen).log())
        elif "norm" in name:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
