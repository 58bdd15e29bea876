"""The dense Llama architecture (``LlamaForCausalLM``) as a megatron-core ``GPTModel`` of this project's
standard-attention layers (``hp_megatron.specs.get_layer_spec("attn")``): conversion rules and the model.

It is the converter's generic dense reference: RMSNorm, GQA attention with RoPE, SwiGLU MLP, no biases.
HF config fields that would change the forward pass and that this model does not build are refused by name.
"""
from __future__ import annotations

import torch

from hp_megatron.convert.rules import TensorRule, concat_rule, grouped_qkv_rule, identity_rule

MODEL_TYPE = "llama"


def _dims(hf_config: dict) -> dict:
    heads = hf_config["num_attention_heads"]
    return dict(layers=hf_config["num_hidden_layers"], hidden=hf_config["hidden_size"], heads=heads,
                groups=hf_config.get("num_key_value_heads") or heads,
                head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // heads,
                tied=bool(hf_config.get("tie_word_embeddings", False)))


def check_supported(hf_config: dict) -> None:
    """Refuse (ValueError naming the field) what the model below does not build."""
    if hf_config.get("model_type") != MODEL_TYPE:
        raise ValueError(f"config.json model_type must be {MODEL_TYPE!r} for this architecture, got "
                         f"{hf_config.get('model_type')!r}")
    refused = {"attention_bias": False, "mlp_bias": False, "rope_scaling": None, "hidden_act": "silu"}
    for field, supported in refused.items():
        if hf_config.get(field, supported) != supported:
            raise ValueError(f"config.json {field}={hf_config[field]!r} is not supported (only {supported!r})")
    rope = hf_config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"config.json rope_parameters.rope_type={rope['rope_type']!r} is not supported "
                         "(only 'default')")


def conversion_rules(hf_config: dict) -> list[TensorRule]:
    """One rule per ``GPTModel.state_dict()`` tensor, full tensors at TP=1."""
    check_supported(hf_config)
    d = _dims(hf_config)
    rules = [identity_rule("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
             identity_rule("decoder.final_layernorm.weight", "model.norm.weight")]
    if not d["tied"]:
        rules.append(identity_rule("output_layer.weight", "lm_head.weight"))
    for i in range(d["layers"]):
        ours, theirs = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = theirs + "self_attn."
        rules += [
            identity_rule(ours + "input_layernorm.weight", theirs + "input_layernorm.weight"),
            grouped_qkv_rule(ours + "self_attention.linear_qkv.weight", attn + "q_proj.weight",
                             attn + "k_proj.weight", attn + "v_proj.weight", num_heads=d["heads"],
                             num_groups=d["groups"], head_dim=d["head_dim"]),
            identity_rule(ours + "self_attention.linear_proj.weight", attn + "o_proj.weight"),
            identity_rule(ours + "pre_mlp_layernorm.weight", theirs + "post_attention_layernorm.weight"),
            concat_rule(ours + "mlp.linear_fc1.weight", (theirs + "mlp.gate_proj.weight",
                                                         theirs + "mlp.up_proj.weight")),
            identity_rule(ours + "mlp.linear_fc2.weight", theirs + "mlp.down_proj.weight"),
        ]
    return rules


def _rope_theta(hf_config: dict) -> float:
    rope = hf_config.get("rope_parameters") or {}
    return float(rope.get("rope_theta", hf_config.get("rope_theta", 10000.0)))


def build_model(hf_config: dict, **config_overrides):
    """The ``GPTModel`` of ``hf_config`` on the current megatron parallel state; ``config_overrides`` are
    ``TransformerConfig`` fields (parallel sizes, ``params_dtype``, ``perform_initialization``...)."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from hp_megatron.specs import get_layer_spec
    from layers.norm import RMSNorm

    check_supported(hf_config)
    d = _dims(hf_config)
    fields = dict(num_layers=d["layers"], hidden_size=d["hidden"], num_attention_heads=d["heads"],
                  num_query_groups=d["groups"], kv_channels=d["head_dim"],
                  ffn_hidden_size=hf_config["intermediate_size"], gated_linear_unit=True, activation_func=F.silu,
                  add_bias_linear=False, normalization="RMSNorm", layernorm_epsilon=hf_config["rms_norm_eps"],
                  hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                  params_dtype=torch.float32, gradient_accumulation_fusion=False, bias_dropout_fusion=False)
    fields.update(config_overrides)
    config = TransformerConfig(**fields)
    local_layers = get_num_layers_to_build(config)  # this pipeline stage's layers
    spec = TransformerBlockSubmodules(layer_specs=[get_layer_spec("attn")] * local_layers, layer_norm=RMSNorm)

    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=hf_config["vocab_size"],
                    max_sequence_length=hf_config.get("max_position_embeddings", 4096),
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=d["tied"], position_embedding_type="rope",
                    rotary_base=_rope_theta(hf_config))
