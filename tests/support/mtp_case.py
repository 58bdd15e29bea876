"""Multi-token prediction cases: tiny DeepSeek-V3 / Qwen3-Next checkpoints *with* their MTP tensors (written by
``hp_megatron.models.tiny.add_tiny_mtp_layer``: ``save_pretrained`` skips them) and independent references.

* DeepSeek-V3: transformers' own ``transformers.modeling_layers.MtpModel`` (enorm / hnorm / eh_proj, the decoder
  layer, the post norm, the shared head) loaded by ``MtpModel.from_pretrained`` from the checkpoint.
* Ling 3.0 (transformers skips ``model.layers.<num_hidden_layers>.*`` and has no MTP forward for it):
  :func:`ling_mtp_reference`, transformers' generic ``MtpLayer`` around its ``BailingHybridDecoderLayer`` (MLA + MoE)
  loaded from the checkpoint.
* Qwen3-Next and Qwen3.5 (transformers skips ``mtp.*``): :class:`Qwen3NextMTPReference`, the DeepSeek-V3 report's
  section 2.2 ``h' = fc([RMSNorm(Emb(t_{i+1})); RMSNorm(h_i)])``, one decoder layer, a final norm, the shared head, in
  Qwen3-Next's module names, from transformers' Qwen3-Next modules (the decoder layer loaded by transformers
  from the checkpoint's ``mtp.layers.0.*``).

Both take the main model's final (normed) hidden states ``h_i`` and the embedding of the next token, as
DeepSeek-V3's and vLLM's MTP drafts do; the depth-1 prediction at position ``i`` targets token ``i + 2``.
"""
from __future__ import annotations

import json
import os
import tempfile

import torch
from torch import nn

from tests.support.models_case import read_safetensors, tiny_hf_model

MTP_PREFIX = {"deepseek_v3": "model.layers.{layers}.", "bailing_hybrid": "model.layers.{layers}.", "qwen3_next": "mtp.",
              "qwen3_5_text": "mtp.", "qwen3_5_moe_text": "mtp.", "qwen3_5": "mtp.", "qwen3_5_moe": "mtp."}


def tiny_mtp_checkpoint(arch: str, directory: str, seed: int = 0):
    """(transformers main model, config.json dict): the tiny ``arch`` model saved to ``directory`` with one MTP
    layer's tensors added."""
    from hp_megatron.models.tiny import add_tiny_mtp_layer

    model, _ = tiny_hf_model(arch, directory, seed)
    return model, add_tiny_mtp_layer(directory, arch, seed)


def checkpoint_named(named: dict) -> dict:
    """transformers' in-memory tensors (fused experts ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj
    [E, H, I]``) under checkpoint names (``experts.<e>.gate_proj.weight`` ...)."""
    out = {}
    for name, t in named.items():
        if name.endswith("experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate[e], up[e]
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def deepseek_mtp_reference(hf_dir: str, main):
    """transformers' ``MtpModel`` of the DeepSeek-V3 main model ``main`` (loaded from ``hf_dir``), with the
    checkpoint's MTP weights. transformers' DeepSeek-V3 class names the released 61-layer checkpoint's MTP keys
    (``model.layers.61``); the tiny model's layer count is put in their place."""
    from transformers.modeling_layers import MtpModel

    main.config.name_or_path = hf_dir
    main.config.dtype = torch.float32   # a model built from its config holds the name "float32"
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{main.config.num_hidden_layers}\..*"]
    return MtpModel.from_pretrained(main).float()


def deepseek_reference_names(mtp, layers: int) -> dict:
    """``{checkpoint key: parameter}`` of the ``MtpModel``'s MTP layer (not the shared embedding / head)."""
    prefix = f"model.layers.{layers}."
    out = {}
    for name, p in mtp.layers[0].named_parameters():
        name = name.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        out[prefix + name] = p
    return out


class Qwen3NextMTPReference(nn.Module):
    """Qwen3-Next's MTP module from its published description, in its checkpoint's module names
    (``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``fc``, ``layers.0``, ``norm``).

    forward(embeds [B, S, H] of the next tokens, hidden [B, S, H] of the main model, position_embeddings,
    attention_mask) -> the normed MTP hidden states [B, S, H] (the main model's head makes the logits)."""

    def __init__(self, main, layer):
        super().__init__()
        norm_cls, cfg = type(main.model.norm), main.config
        self.pre_fc_norm_embedding = norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([layer])
        self.norm = norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, embeds, hidden, position_embeddings, attention_mask):
        h = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        h = self.layers[0](h, position_embeddings=position_embeddings, attention_mask=attention_mask)
        return self.norm(h)


def qwen3_next_mtp_reference(hf_dir: str, main) -> Qwen3NextMTPReference:
    """:class:`Qwen3NextMTPReference` with the checkpoint's ``mtp.*`` weights; its decoder layer is a one-layer
    transformers model of the checkpoint's class (Qwen3-Next, Qwen3.5 text) and the MTP layer's kind (full
    attention, MoE or dense) loaded by transformers from
    ``mtp.layers.0.*`` (so transformers fuses its experts)."""
    state = read_safetensors(hf_dir)
    overrides = dict(layer_types=["full_attention"])
    if main.config.model_type == "qwen3_next":
        overrides["mlp_only_layers"] = []
    layer, _ = one_layer_from_checkpoint(hf_dir, state, "mtp.layers.0.", overrides)
    reference = Qwen3NextMTPReference(main, layer)
    heads = {k[len("mtp."):]: v for k, v in state.items() if k.startswith("mtp.") and not k.startswith("mtp.layers.")}
    missing, unexpected = reference.load_state_dict(heads, strict=False)
    assert not unexpected and all(k.startswith("layers.0.") for k in missing), (missing, unexpected)
    return reference.float()


def one_layer_from_checkpoint(hf_dir: str, state: dict, prefix: str, overrides: dict, skip: tuple = ()):
    """The decoder layer stored under ``prefix`` in ``state`` (the checkpoint of ``hf_dir``), loaded by transformers
    as the one layer of a model of the checkpoint's class and config (``overrides``: its layer-kind fields), so
    transformers renames and fuses its tensors as it does the main model's (``skip``: keys under ``prefix`` that are
    not the layer's). Returns (the layer, the one-layer model's config)."""
    import transformers
    from safetensors.torch import save_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    config.update(num_hidden_layers=1, **overrides)
    one = {"model.layers.0." + k[len(prefix):]: v for k, v in state.items()
           if k.startswith(prefix) and k[len(prefix):] not in skip}
    one.update({k: state[k] for k in ("model.embed_tokens.weight", "model.word_embeddings.weight", "model.norm.weight",
                                      "lm_head.weight") if k in state})
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f)
        save_file(one, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        layer_model = transformers.AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager").float()
    return layer_model.model.layers[0], layer_model.config


def ling_mtp_reference(hf_dir: str, main, layers: int):
    """Ling 3.0's MTP layer (transformers 5.25 has no forward for it: it skips ``model.layers.<num_hidden_layers>.``
    on load): transformers' own generic ``MtpLayer`` (``eh_proj([enorm(emb); hnorm(h)])``, the decoder layer, the
    post norm) around transformers' ``BailingHybridDecoderLayer`` of the full-attention (MLA) kind with a MoE MLP,
    loaded by transformers from the checkpoint's ``model.layers.<layers>.*``; the norms and projection loaded by hand
    from ``enorm`` / ``hnorm`` / ``eh_proj`` / ``final_layernorm`` (the post norm)."""
    from transformers.modeling_layers import MtpLayer

    state = read_safetensors(hf_dir)
    prefix = f"model.layers.{layers}."
    heads = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
             "post_norm.weight": "final_layernorm.weight"}
    layer, config = one_layer_from_checkpoint(hf_dir, state, prefix, dict(
        layer_types=["full_attention"], mlp_layer_types=["sparse"], first_k_dense_replace=0,
        expert_swiglu_limit_list=[0], share_expert_swiglu_limit_list=[0]), skip=tuple(heads.values()))
    mtp = MtpLayer(config, type(layer), type(main.model.norm), 0, use_post_norm=True)
    mtp.mtp_block = layer
    missing, unexpected = mtp.load_state_dict({ours: state[prefix + theirs] for ours, theirs in heads.items()},
                                              strict=False)
    assert not unexpected and all(k.startswith("mtp_block.") for k in missing), (missing, unexpected)
    return mtp.float()


def ling_reference_names(mtp, layers: int) -> dict:
    """``{checkpoint key: parameter}`` of :func:`ling_mtp_reference` (transformers' in-memory names of the decoder
    layer, ``self_attn.o_proj`` etc., put back under the checkpoint's)."""
    prefix, out = f"model.layers.{layers}.", {}
    renames = (("mtp_block.", ""), ("post_norm.", "final_layernorm."), ("self_attn.o_proj.", "attention.dense."),
               ("self_attn.", "attention."), ("mlp.gate.e_score_correction_bias", "mlp.gate.expert_bias"))
    for name, p in mtp.named_parameters():
        for a, b in renames:
            name = name.replace(a, b)
        out[prefix + name] = p
    return out


def qwen3_next_reference_names(reference) -> dict:
    return {"mtp." + name: p for name, p in reference.named_parameters()}


def reference_mtp_logits(arch: str, hf_dir: str, main, ids: torch.Tensor, config: dict):
    """(MTP module, {checkpoint key: MTP parameter}, depth-1 logits [B, S-1, V] at positions 0..S-2): the reference
    of ``arch`` on the main model's final hidden states of ``ids`` and the embeddings of ``ids[:, 1:]``."""
    from transformers.masking_utils import create_causal_mask

    seq = ids.shape[1]
    with torch.no_grad():
        hidden = main.model(input_ids=ids).last_hidden_state[:, :-1]
    next_ids = ids[:, 1:]
    positions = torch.arange(1, seq).expand_as(next_ids)   # the embedded tokens' positions (transformers' MTP)
    if arch == "deepseek_v3":
        mtp = deepseek_mtp_reference(hf_dir, main)
        states = mtp.forward_layer(0, hidden, positions, None, input_ids=next_ids)
        return mtp, deepseek_reference_names(mtp, config["num_hidden_layers"]), main.lm_head(states)
    embeds = main.model.embed_tokens(next_ids)
    mask = create_causal_mask(config=main.config, inputs_embeds=embeds, attention_mask=None, past_key_values=None,
                              position_ids=positions)
    if arch == "bailing_hybrid":
        mtp = ling_mtp_reference(hf_dir, main, config["num_hidden_layers"])
        states = mtp(embeds, hidden, main.model.rotary_emb(embeds, positions), mask, positions, None)
        return mtp, ling_reference_names(mtp, config["num_hidden_layers"]), main.lm_head(states)
    reference = qwen3_next_mtp_reference(hf_dir, main)
    states = reference(embeds, hidden, main.model.rotary_emb(embeds, positions), mask)
    return reference, qwen3_next_reference_names(reference), main.lm_head(states)
