"""Tiny random transformers models of the supported architectures (``qwen3_next``, ``deepseek_v3``,
``kimi_linear``, Qwen3.5's ``qwen3_5_text`` / ``qwen3_5_moe_text`` and their VL ``qwen3_5`` / ``qwen3_5_moe``,
``olmo_hybrid``, ``bailing_hybrid``):
small configs with routed and shared experts, dense and MoE layers and mixed layer types, for tests and for trying the
HF -> megatron-core -> training path (``examples/pretrain/tiny_hf_checkpoint.py``)."""
from __future__ import annotations

import os

import torch

TINY_VOCAB, TINY_HIDDEN = 64, 32
HF_EXTRA = "pip install -e .[hf] (in a checkout) or pip install 'hp-megatron[hf]'"


def import_transformers():
    """The ``transformers`` module; RuntimeError naming the install command when it is missing (the ``[hf]``
    extra: the converter does not need it, the tiny models do)."""
    try:
        import transformers
    except ImportError as err:
        raise RuntimeError(f"the tiny Hugging Face models need transformers, which is not installed: "
                           f"{HF_EXTRA}") from err
    return transformers


def _qwen3_next(vocab_size: int):
    transformers = import_transformers()
    cfg = transformers.Qwen3NextConfig(
        vocab_size=vocab_size, hidden_size=TINY_HIDDEN, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24, mlp_only_layers=[1], rms_norm_eps=1e-6,
        layer_types=["linear_attention", "linear_attention", "full_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    return transformers.Qwen3NextForCausalLM, cfg


def _deepseek_v3(vocab_size: int):
    transformers = import_transformers()
    cfg = transformers.DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=TINY_HIDDEN, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
        q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        max_position_embeddings=64, rope_interleave=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0})
    return transformers.DeepseekV3ForCausalLM, cfg


def _dsa(config_class: str, **extra):
    """A tiny DeepSeek-V3-shaped DSA model (DeepSeek-V3.2, GLM-5): index_topk 4 below the test sequences, 8 indexer
    heads (an all-negative ReLU row, an exact tie at 0, is then rare)."""
    def build(vocab_size: int):
        transformers = import_transformers()
        cfg = getattr(transformers, config_class)(
            vocab_size=vocab_size, hidden_size=TINY_HIDDEN, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
            q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
            max_position_embeddings=64, rms_norm_eps=1e-6, index_topk=4, index_n_heads=8, index_head_dim=8, **extra)
        return getattr(transformers, config_class.replace("Config", "ForCausalLM")), cfg
    return build


_deepseek_v32 = _dsa("DeepseekV32Config", rope_parameters={
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
_glm_moe_dsa = _dsa("GlmMoeDsaConfig", rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                    indexer_types=["full", "full", "shared", "full"])


def _kimi_linear(vocab_size: int):
    transformers = import_transformers()
    cfg = transformers.KimiLinearConfig(
        vocab_size=vocab_size, hidden_size=TINY_HIDDEN, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_token=2,
        num_shared_experts=1, routed_scaling_factor=2.0, q_lora_rank=None, kv_lora_rank=12, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=6, rms_norm_eps=1e-5, pad_token_id=None, bos_token_id=None,
        eos_token_id=None, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        linear_attn_config={"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 4})
    return transformers.KimiLinearForCausalLM, cfg


def _qwen3_5_text_fields(vocab_size: int) -> dict:
    """Qwen3.5's text fields: GGAA, HV = 2 H (H = 4: Ulysses CP up to 4 ranks), mRoPE over half of each head
    (sections sum to its 4 frequencies)."""
    return dict(vocab_size=vocab_size, hidden_size=TINY_HIDDEN, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8,
                linear_key_head_dim=8, linear_value_head_dim=8, rms_norm_eps=1e-6, pad_token_id=None,
                layer_types=["linear_attention", "linear_attention", "full_attention", "full_attention"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})


def _qwen3_5_text(vocab_size: int):
    transformers = import_transformers()
    cfg = transformers.Qwen3_5TextConfig(intermediate_size=48, **_qwen3_5_text_fields(vocab_size))
    return transformers.Qwen3_5ForCausalLM, cfg


def _qwen3_5_moe_text(vocab_size: int):
    transformers = import_transformers()
    cfg = transformers.Qwen3_5MoeTextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                            shared_expert_intermediate_size=24, **_qwen3_5_text_fields(vocab_size))
    return transformers.Qwen3_5MoeForCausalLM, cfg


TINY_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TINY_HIDDEN,
                   patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)


def _qwen3_5(vocab_size: int):
    transformers = import_transformers()
    text = _qwen3_5_text(vocab_size)[1].to_dict()
    return transformers.Qwen3_5ForConditionalGeneration, transformers.Qwen3_5Config(text_config=text,
                                                                                      vision_config=TINY_VISION)


def _qwen3_5_moe(vocab_size: int):
    transformers = import_transformers()
    text = _qwen3_5_moe_text(vocab_size)[1].to_dict()
    return transformers.Qwen3_5MoeForConditionalGeneration, transformers.Qwen3_5MoeConfig(text_config=text,
                                                                                           vision_config=TINY_VISION)


def _olmo_hybrid(vocab_size: int):
    """GDN with K != V and negative eigenvalues, post-norm attention (GQA) with whole-projection q/k norms, NoPE (the
    released checkpoints' ``rope_theta: null``)."""
    transformers = import_transformers()
    cfg = transformers.OlmoHybridConfig(
        vocab_size=vocab_size, hidden_size=TINY_HIDDEN, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=16, linear_allow_neg_eigval=True, rms_norm_eps=1e-6,
        pad_token_id=None, eos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": None},
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
    return transformers.OlmoHybridForCausalLM, cfg


def _bailing_hybrid(vocab_size: int):
    """KDA (safe gate, full-rank gates) and MLA with the output gate (layer i MLA when (i + 1) % 2 == 0), a dense
    first layer, grouped sigmoid routing with expert bias, shared experts, per-layer SwiGLU limits (the KDA head
    dim equals the rope head dim: transformers 5.25 re-reads a saved ``head_dim`` as the KDA head dim)."""
    transformers = import_transformers()
    cfg = transformers.BailingHybridConfig(
        vocab_size=vocab_size, hidden_size=TINY_HIDDEN, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, head_dim=8, num_local_experts=8,
        num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=6, layer_group_size=2, kda_safe_gate=True, kda_lower_bound=-5.0, rope_theta=10000.0,
        rms_norm_eps=1e-6, pad_token_id=None, eos_token_id=None, num_mtp_layers=0,
        expert_swiglu_limit_list=[0, 0.5, 0, 0.3], share_expert_swiglu_limit_list=[0, 0.4, 0, 0.2])
    return transformers.BailingHybridForCausalLM, cfg


TINY_ARCHITECTURES = {"qwen3_next": _qwen3_next, "deepseek_v3": _deepseek_v3, "kimi_linear": _kimi_linear,
                      "qwen3_5_text": _qwen3_5_text, "qwen3_5_moe_text": _qwen3_5_moe_text, "qwen3_5": _qwen3_5,
                      "qwen3_5_moe": _qwen3_5_moe, "deepseek_v32": _deepseek_v32,
                      "glm_moe_dsa": _glm_moe_dsa, "olmo_hybrid": _olmo_hybrid,
                      "bailing_hybrid": _bailing_hybrid}
VL_TEXT_ARCHITECTURE = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}  # VL -> its language model


def tiny_hf_config(arch: str, vocab_size: int = TINY_VOCAB):
    """(transformers CausalLM class, its tiny config) of ``arch``; ValueError naming the supported ones."""
    if arch not in TINY_ARCHITECTURES:
        raise ValueError(f"no tiny config for {arch!r}; supported: {sorted(TINY_ARCHITECTURES)}")
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
    return TINY_ARCHITECTURES[arch](vocab_size)


@torch.no_grad()
def perturb_parameters(model, seed: int) -> None:
    """Move every parameter and buffer off transformers' constant initialisations (zero-centred norms, zero
    routers, A_log / dt_bias), with router weights large enough that top-k choices are far from ties."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if not p.is_floating_point() or "inv_freq" in name or "original_inv_freq" in name:
            continue
        noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        if name.endswith("gate.weight") and p.shape[0] > 1:  # routers
            p.copy_(noise)
        elif "e_score_correction_bias" in name or name.endswith("expert_bias"):
            p.copy_(0.3 * noise)
        elif "norm" in name:
            p.copy_(p + 0.1 * noise)
        elif name.endswith("A_log"):
            p.copy_(torch.rand(p.shape, generator=gen).mul(2.0).add(0.5).log())
        else:
            p.copy_(0.2 * noise if p.dim() < 2 else noise / p.shape[-1] ** 0.5)


def build_tiny_hf_model(arch: str, seed: int = 0, vocab_size: int = TINY_VOCAB):
    """A tiny random fp32 transformers model of ``arch`` (eager attention, eval mode, every parameter perturbed)."""
    cls, cfg = tiny_hf_config(arch, vocab_size)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    perturb_parameters(model, seed)
    return model


def save_tiny_hf_model(model, directory: str) -> None:
    """``model.save_pretrained(directory)`` with the released checkpoints' tensor layout. transformers 5.25 saves
    OLMo-Hybrid's short conv (one ``conv1d`` in memory) as ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` of equal
    thirds, which is wrong when the key and value dims differ (it loads back, by concatenation, but the parts are
    not the model's q, k, v channels); the released checkpoints hold q, k, v convs of their own sizes, written here."""
    model.save_pretrained(directory)
    cfg = model.config
    if cfg.model_type != "olmo_hybrid":
        return
    from safetensors.torch import load_file, save_file

    path = os.path.join(directory, "model.safetensors")
    state = load_file(path)
    key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    for name in [n for n in state if n.endswith("linear_attn.q_conv1d.weight")]:
        prefix = name[:-len("q_conv1d.weight")]
        names = [f"{prefix}{p}_conv1d.weight" for p in "qkv"]
        fused = torch.cat([state[n] for n in names], 0)
        state.update(zip(names, fused.split([key, key, fused.shape[0] - 2 * key], 0)))
    save_file({k: v.contiguous() for k, v in state.items()}, path, metadata={"format": "pt"})


MTP_LAYER_TYPE = {"qwen3_next": dict(layer_types=["full_attention"], mlp_only_layers=[]),
                  "deepseek_v3": dict(first_k_dense_replace=0), "qwen3_5_text": dict(layer_types=["full_attention"]),
                  "qwen3_5_moe_text": dict(layer_types=["full_attention"]),
                  "qwen3_5": dict(layer_types=["full_attention"]), "qwen3_5_moe": dict(layer_types=["full_attention"]),
                  "deepseek_v32": dict(first_k_dense_replace=0, mlp_layer_types=["sparse"],
                                       layer_types=["indexed_attention"]),
                  "bailing_hybrid": dict(first_k_dense_replace=0, mlp_layer_types=["sparse"],
                                         layer_types=["full_attention"], swiglu_limits=[0],
                                         swiglu_limits_shared=[0])}
LAYER_INDEXED_MTP = ("deepseek_v3", "deepseek_v32", "bailing_hybrid")   # MTP as model.layers.<num_hidden_layers>.*


def tiny_mtp_tensors(arch: str, seed: int = 0, vocab_size: int = TINY_VOCAB, main_state: dict | None = None) -> tuple:
    """(config.json fields, tensors) of one random multi-token-prediction layer of the tiny ``arch`` model under the
    released checkpoints' names and shapes, which ``save_pretrained`` never writes: DeepSeek-V3
    ``model.layers.<num_hidden_layers>.*`` (``enorm``, ``hnorm``, ``eh_proj``, an MLA + MoE decoder layer,
    ``shared_head.norm``, and ``embed_tokens`` / ``shared_head.head``: copies of ``main_state``'s embedding and
    head), ``num_nextn_predict_layers: 1``; Qwen3-Next ``mtp.*`` (``pre_fc_norm_embedding``,
    ``pre_fc_norm_hidden``, ``fc``, a gated-attention + MoE ``layers.0``, ``norm``), ``mtp_num_hidden_layers: 1``;
    Qwen3.5 (text and VL) the same names (the dense model's MTP layer has a dense MLP); for VL the depth goes into
    ``text_config`` (:func:`add_tiny_mtp_layer`); Ling 3.0 ``model.layers.<num_hidden_layers>.*`` (``enorm``,
    ``hnorm``, ``eh_proj``, an MLA + MoE decoder layer, ``final_layernorm``; no embedding / head copies),
    ``num_nextn_predict_layers: 1``.

    The decoder layer is a one-layer model of the same config (that layer kind) saved by transformers, so its
    tensors have the checkpoint's names (per-expert keys)."""
    import tempfile

    from safetensors.torch import load_file

    if arch not in MTP_LAYER_TYPE:
        raise ValueError(f"no multi-token-prediction layer for {arch!r}; supported: {sorted(MTP_LAYER_TYPE)}")
    cls, cfg = tiny_hf_config(VL_TEXT_ARCHITECTURE.get(arch, arch), vocab_size)
    layers = cfg.num_hidden_layers
    cfg.num_hidden_layers = 1
    for name, value in MTP_LAYER_TYPE[arch].items():
        setattr(cfg, name, value)
    torch.manual_seed(seed + 1)
    one_layer = cls(cfg).float()
    perturb_parameters(one_layer, seed + 1)
    with tempfile.TemporaryDirectory() as tmp:
        one_layer.save_pretrained(tmp)
        saved = {}
        for name in sorted(os.listdir(tmp)):
            if name.endswith(".safetensors"):
                saved.update(load_file(os.path.join(tmp, name)))
    gen = torch.Generator().manual_seed(seed + 2)
    hidden = cfg.hidden_size
    deepseek = arch in ("deepseek_v3", "deepseek_v32")
    centred = arch not in LAYER_INDEXED_MTP   # Qwen3-Next's and Qwen3.5's norms store weight - 1

    def norm():
        return (0.0 if centred else 1.0) + 0.1 * torch.randn(hidden, generator=gen)

    proj = torch.randn(hidden, 2 * hidden, generator=gen) / (2 * hidden) ** 0.5
    decoder = {k[len("model.layers.0."):]: v for k, v in saved.items() if k.startswith("model.layers.0.")}
    if arch == "bailing_hybrid":
        prefix = f"model.layers.{layers}."
        tensors = {prefix + k: v for k, v in decoder.items()}
        tensors.update({prefix + "enorm.weight": norm(), prefix + "hnorm.weight": norm(),
                        prefix + "eh_proj.weight": proj, prefix + "final_layernorm.weight": norm()})
        return {"num_nextn_predict_layers": 1}, tensors
    if not deepseek:
        tensors = {f"mtp.layers.0.{k}": v for k, v in decoder.items()}
        tensors.update({"mtp.pre_fc_norm_embedding.weight": norm(), "mtp.pre_fc_norm_hidden.weight": norm(),
                        "mtp.fc.weight": proj, "mtp.norm.weight": norm()})
        return {"mtp_num_hidden_layers": 1}, tensors
    if main_state is None:
        raise ValueError("DeepSeek-V3's MTP layer holds copies of the model's embedding and head: pass main_state")
    prefix = f"model.layers.{layers}."
    tensors = {prefix + k: v for k, v in decoder.items()}
    head = main_state.get("lm_head.weight", main_state["model.embed_tokens.weight"])
    tensors.update({prefix + "enorm.weight": norm(), prefix + "hnorm.weight": norm(), prefix + "eh_proj.weight": proj,
                    prefix + "shared_head.norm.weight": norm(),
                    prefix + "embed_tokens.weight": main_state["model.embed_tokens.weight"].clone(),
                    prefix + "shared_head.head.weight": head.clone()})
    return {"num_nextn_predict_layers": 1}, tensors


def add_tiny_mtp_layer(directory: str, arch: str, seed: int = 0) -> dict:
    """Write :func:`tiny_mtp_tensors` into the ``save_pretrained`` directory of a tiny ``arch`` model (one
    ``model.safetensors`` with every tensor, config.json with the MTP depth); returns the new config.json dict."""
    import json

    from safetensors.torch import load_file, save_file

    files = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    state = {}
    for name in files:
        state.update(load_file(os.path.join(directory, name)))
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    text = config.get("text_config", config)   # a VL config's language model
    fields, tensors = tiny_mtp_tensors(arch, seed, text["vocab_size"], state)
    text.update(fields)
    tmp = os.path.join(directory, "model.safetensors.tmp")
    try:
        save_file({**state, **tensors}, tmp, metadata={"format": "pt"})
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    for name in files + ["model.safetensors.index.json"]:
        if os.path.exists(os.path.join(directory, name)):
            os.remove(os.path.join(directory, name))
    os.replace(tmp, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return config
