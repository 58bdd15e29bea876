"""Tiny random transformers models (the supported architectures, and Llama for the conversion engine) and the
conversion round trip, shared by tests/models and tests/convert: build with transformers, perturb every parameter off
its initial constant, ``save_pretrained``, read the safetensors, convert with ``hp_megatron.models`` rules, run both
sides in fp32."""
from __future__ import annotations

import json
import os

import torch

from tests.support.helpers import use_transformers_torch_path

VOCAB, HIDDEN, SEQ, BATCH = 64, 32, 12, 2
LLAMA_VOCAB = 96  # tiny_llama's


def _use_torch_path():
    """transformers' pure-PyTorch GDN/KDA functions (not FLA's Triton kernels) for the reference forward."""
    from transformers.models.bailing_hybrid import modeling_bailing_hybrid
    from transformers.models.kimi_linear import modeling_kimi_linear
    from transformers.models.olmo_hybrid import modeling_olmo_hybrid
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
    from transformers.models.qwen3_next import modeling_qwen3_next

    for module in (modeling_qwen3_next, modeling_kimi_linear, modeling_qwen3_5, modeling_qwen3_5_moe,
                   modeling_olmo_hybrid, modeling_bailing_hybrid):
        use_transformers_torch_path(module)


def tiny_hf_model(arch: str, directory: str, seed: int = 0, save: bool = True, vocab_size: int = VOCAB):
    """(model, config.json as a dict): ``hp_megatron.models.tiny``'s tiny random transformers model of ``arch``
    saved to ``directory`` (``save=False``: (model, None), another process saves the same model there)."""
    from hp_megatron.models.tiny import build_tiny_hf_model, save_tiny_hf_model

    _use_torch_path()
    model = build_tiny_hf_model(arch, seed, vocab_size=vocab_size)
    if save:
        save_tiny_hf_model(model, directory)
        with open(os.path.join(directory, "config.json")) as f:
            return model, json.load(f)
    return model, None


def tiny_llama(tmp_path, tied=False, shard="40KB"):
    """A random tiny LlamaForCausalLM (vocabulary ``LLAMA_VOCAB``) saved in shards under ``tmp_path / "hf"``
    (``"hf_tied"`` when ``tied``); returns (model, directory)."""
    directory = tmp_path / ("hf_tied" if tied else "hf")
    return _save_tiny_llama(str(directory), tied, shard), str(directory)


def _save_tiny_llama(directory: str, tied: bool, shard: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=LLAMA_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rope_theta=5000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, max_shard_size=shard)
    return model


def converted_tiny_model(arch: str, hf_dir, ckpt, *, seed: int = 0, vocab_size: int = VOCAB, tied: bool = False,
                         mtp_num_layers: int = 0, mtp_seed: int | None = None, drop_unmodeled: bool = False):
    """A converted tiny checkpoint: the tiny random transformers model of ``arch`` saved to ``hf_dir``
    (:func:`tiny_hf_model` with ``seed`` / ``vocab_size``; ``"llama"``: :func:`tiny_llama`'s model, ``tied`` or
    not), with ``mtp_num_layers`` released-style MTP layers added (seed ``mtp_seed``, default ``seed``), converted
    by ``hp_megatron.convert.hf_to_mcore`` into ``ckpt`` (MTP layers kept; a VL checkpoint's vision tower dropped,
    as ``--drop-unmodeled`` does). Returns the transformers model."""
    from hp_megatron.convert import hf_to_mcore
    from hp_megatron.models import get_architecture
    from hp_megatron.models.tiny import VL_TEXT_ARCHITECTURE, add_tiny_mtp_layer

    hf_dir, ckpt = str(hf_dir), str(ckpt)
    if arch == "llama":
        model = _save_tiny_llama(hf_dir, tied, "40KB")
    else:
        model, _ = tiny_hf_model(arch, hf_dir, seed, vocab_size=vocab_size)
    if mtp_num_layers:
        add_tiny_mtp_layer(hf_dir, arch, seed if mtp_seed is None else mtp_seed)
    hf_to_mcore(hf_dir, ckpt, get_architecture(arch).with_mtp(mtp_num_layers),
                drop_unmodeled=drop_unmodeled or arch in VL_TEXT_ARCHITECTURE)
    return model


def read_safetensors(directory: str) -> dict:
    """Every tensor of an HF directory's safetensors files (one file or shards)."""
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def to_mcore(rules, hf_state: dict) -> dict:
    used = {k for r in rules for k in r.hf_keys}
    unused = sorted(set(hf_state) - used)
    assert not unused, f"HF tensors no rule reads: {unused[:8]}"
    return {r.mcore_key: r.to_mcore([hf_state[k] for k in r.hf_keys]) for r in rules}


def to_hf(rules, mcore_state: dict) -> dict:
    out = {}
    for r in rules:
        out.update(zip(r.hf_keys, r.to_hf(mcore_state[r.mcore_key])))
    return out


def token_batch(seed: int = 0):
    """(input ids [B, S], labels [B, S]: the next token, -100 at the last position)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def hf_logits_and_loss(model, ids):
    """transformers' logits [B, S, V] and mean next-token loss over positions 0..S-2 (it shifts the labels)."""
    out = model(input_ids=ids, labels=ids)
    return out.logits, out.loss


def mcore_logits_and_loss(model, ids, targets):
    """Our GPTModel's logits [B, S, V] and the mean loss over positions 0..S-2 (transformers' loss positions)."""
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    logits = model(ids, positions, None)
    per_token = model(ids, positions, None, labels=targets)
    return logits, per_token[:, :-1].mean()
