"""The example's model from its flags, and those flags stored in its checkpoints, as Megatron-LM stores ``args``.

``examples/pretrain/pretrain_hybrid.py`` (without ``--hp-hf-config``) builds its model with
:func:`hybrid_config_from_args` and :func:`hybrid_model_from_args`; ``save_checkpoint`` stores
:func:`stored_model_args` (a plain dict: the flags these two read, the vocabulary and the tokenizer path) in the
checkpoint's common state under :data:`MODEL_ARGS_KEY`. ``python -m hp_megatron.generate`` reads it back
(:func:`args_from_stored`) and builds the same ``GPTModel`` at any TP, like Megatron-LM's tools with
``--use-checkpoint-args``. Parallel layout, CP method and training choices are not stored: they do not change the
weights, and ``dist_checkpointing`` reshards the tensors.
"""
from __future__ import annotations

import argparse
import os

MODEL_ARGS_KEY = "hp_model_args"

# the example's flags (``args`` attribute names) that define its model's tensors and forward: Megatron-LM's, then the
# flag table's model rows (hp_megatron.flags; the built-in mixers'; a --hp-mixer-module's are stored beside them)
MEGATRON_MODEL_ARG_NAMES = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "seq_length",
    "rotary_base", "bf16", "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_router_score_function",
    "moe_router_enable_expert_bias", "mtp_num_layers")


def model_arg_names() -> tuple:
    """The ``args`` names a checkpoint stores: Megatron-LM's model flags, then the flag table's model rows (read when
    called: the registry, and with it torch, is imported only then)."""
    from hp_megatron.flags import model_flag_dests

    return MEGATRON_MODEL_ARG_NAMES + model_flag_dests()


def hybrid_config_from_args(args, **run):
    """The ``HybridTransformerConfig`` of the model flags ``args`` (``--num-layers``, ``--hidden-size``, ...,
    ``--num-experts``, the ``--hp-*`` layer flags); ``run`` holds the other ``TransformerConfig`` fields (parallel
    sizes, dtype, init, MTP depth, MoE balancing)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    from hp_megatron.arguments import apply_hp_config

    if args.num_experts is not None:  # the experts themselves: megatron-core's MoELayer, SequentialMLP experts
        run.update(num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                   moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                   moe_router_score_function=args.moe_router_score_function,
                   moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
                   moe_token_dispatcher_type="allgather", moe_grouped_gemm=False)
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, **run)
    return apply_hp_config(config, args)


def hybrid_model_from_args(args, config, *, vocab_size: int, pre_process: bool = True, post_process: bool = True):
    """This pipeline stage's model of the flags ``args``: with ``--model-class gpt`` (the default, also for args
    without the flag) a ``GPTModel`` (``hybrid_gpt_model``) over ``get_hybrid_layer_spec(--hp-layer-pattern)``, with
    ``--model-class hybrid`` the same model as megatron-core's ``HybridModel`` (``hybrid_model``; pattern
    ``--hybrid-layer-pattern`` or derived). RoPE when the pattern (or the MTP layers) has attention, untied output
    layer; the MTP block when ``config.mtp_num_layers``."""
    from hp_megatron.model_builders import hybrid_gpt_model, hybrid_model
    from hp_megatron.registry import symbols_where
    from hp_megatron.specs import get_hybrid_layer_spec

    mtp_kind = args.hp_mtp_layer_symbol if getattr(config, "mtp_num_layers", None) else None
    rope_symbols = symbols_where(lambda e: e.model_rope)   # zigzag with CP: checked by validate_hp_args
    uses_rope = any(s in args.hp_layer_pattern + (mtp_kind or "") for s in rope_symbols)
    model = dict(vocab_size=vocab_size, max_sequence_length=args.seq_length, pre_process=pre_process,
                 post_process=post_process, backend=args.hp_backend, share_embeddings_and_output_weights=False,
                 position_embedding_type="rope" if uses_rope else "none", rotary_base=args.rotary_base)
    if getattr(args, "model_class", "gpt") == "hybrid":
        return hybrid_model(config, hybrid_layer_pattern=getattr(args, "hybrid_layer_pattern", None),
                            linear=args.hp_linear, cp_layout=args.hp_cp_layout, mtp_symbol=mtp_kind, **model)
    spec = get_hybrid_layer_spec(args.hp_layer_pattern, backend=args.hp_backend, linear=args.hp_linear,
                                 cp_layout=args.hp_cp_layout, mtp_symbol=mtp_kind)
    return hybrid_gpt_model(config, spec, **model)


def stored_model_args(args, *, padded_vocab_size: int, vocab_size: int) -> dict:
    """The plain dict a checkpoint stores: :func:`model_arg_names` of ``args``, ``padded_vocab_size`` (the
    embedding rows), ``vocab_size`` (the tokenizer's ids) and ``tokenizer`` (its absolute path, or None); with
    ``--hp-mixer-module``, also those modules and their mixers' model-defining flags (``MixerEntry.options``)."""
    from hp_megatron.registry import option_rows

    stored = {name: getattr(args, name) for name in model_arg_names()}
    modules = list(getattr(args, "hp_mixer_module", None) or [])
    if modules:
        stored["hp_mixer_module"] = modules
        stored.update({row.dest: getattr(args, row.dest, row.default) for row in option_rows()
                       if row.model and row.flag is not None})
    tokenizer = getattr(args, "tokenizer", None)
    stored.update(padded_vocab_size=int(padded_vocab_size), vocab_size=int(vocab_size),
                  tokenizer=os.path.abspath(tokenizer) if tokenizer else None)
    return stored


def args_from_stored(stored: dict) -> argparse.Namespace:
    """The flags of a stored dict as an ``args`` namespace for :func:`hybrid_config_from_args`: the ``--hp-*``
    defaults (single-rank CP settings) overridden by the stored values; ValueError naming missing entries. The
    stored ``hp_mixer_module`` modules are imported first (their mixers registered)."""
    from hp_megatron.arguments import add_hp_arguments

    missing = [name for name in model_arg_names() + ("padded_vocab_size",) if name not in stored]
    if missing:
        raise ValueError(f"the checkpoint's {MODEL_ARGS_KEY} lacks {missing}")
    modules = [arg for module in stored.get("hp_mixer_module") or () for arg in ("--hp-mixer-module", module)]
    args = add_hp_arguments(argparse.ArgumentParser(add_help=False), modules).parse_args(modules)
    for name, value in stored.items():
        setattr(args, name, value)
    return args
