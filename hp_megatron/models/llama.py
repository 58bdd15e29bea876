"""Dense Llama (``model_type: llama``, ``LlamaForCausalLM``): standard attention ("A") in every layer (GQA, RoPE),
SwiGLU MLPs, RMSNorm, no biases. The converter's dense reference architecture.

HF config fields that would change the forward pass and that this model does not build are refused by name
(``attention_bias``, ``mlp_bias``, ``hidden_act`` other than SiLU, RoPE scaling, ``pretraining_tp``).
"""
from __future__ import annotations

from hp_megatron.convert.rules import TensorRule, grouped_qkv_rule, identity_rule
from hp_megatron.models.common import (ModelPreset, decoder_config, field_of, layer_norm_rules, layer_prefix,
                                       mlp_rules, model_rules, refuse, require, rope_parameters)

MODEL_TYPE = "llama"


def megatron_config(hf: dict) -> ModelPreset:
    """The megatron-core model of a Llama ``config.json`` (a dict)."""
    require(hf, MODEL_TYPE, "model_type", (MODEL_TYPE,))
    require(hf, MODEL_TYPE, "attention_bias", (False,), False)
    require(hf, MODEL_TYPE, "mlp_bias", (False,), False)
    require(hf, MODEL_TYPE, "attention_dropout", (0, 0.0), 0.0)
    require(hf, MODEL_TYPE, "pretraining_tp", (1,), 1)
    rope = rope_parameters(hf)
    if rope["rope_type"] != "default":
        refuse(MODEL_TYPE, "rope_parameters.rope_type", rope["rope_type"], ["default"])
    transformer = decoder_config(hf, MODEL_TYPE, 1e-6)
    heads = transformer["num_attention_heads"]
    transformer.update(num_query_groups=hf.get("num_key_value_heads") or heads,
                       kv_channels=hf.get("head_dim") or transformer["hidden_size"] // heads)
    gpt_model = dict(vocab_size=field_of(hf, MODEL_TYPE, "vocab_size"), position_embedding_type="rope",
                     rotary_base=float(rope.get("rope_theta", 10000.0)),
                     share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)))
    return ModelPreset(MODEL_TYPE, "A" * transformer["num_layers"], transformer_fields=transformer,
                       gpt_model_kwargs=gpt_model)


def conversion_rules(hf: dict) -> list[TensorRule]:
    """One rule per megatron-core tensor of the model of :func:`megatron_config`."""
    preset = megatron_config(hf)
    t = preset.transformer_fields
    rules = model_rules(preset.gpt_model_kwargs["share_embeddings_and_output_weights"])
    for i in range(t["num_layers"]):
        mcore, attn = layer_prefix(i) + "self_attention.", f"model.layers.{i}.self_attn."
        rules += [grouped_qkv_rule(mcore + "linear_qkv.weight", attn + "q_proj.weight", attn + "k_proj.weight",
                                   attn + "v_proj.weight", num_heads=t["num_attention_heads"],
                                   num_groups=t["num_query_groups"], head_dim=t["kv_channels"]),
                  identity_rule(mcore + "linear_proj.weight", attn + "o_proj.weight")]
        rules += layer_norm_rules(i)
        rules += mlp_rules(layer_prefix(i) + "mlp.", f"model.layers.{i}.mlp.")
    return rules
