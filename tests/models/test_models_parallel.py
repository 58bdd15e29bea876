"""Real architectures under model parallelism (4 gloo ranks, fp32, one spawn for every case): the tiny transformers
models of ``models_case`` converted with our rules, sharded onto TP2 x CP2 and PP2 x EP2 (x DP2) megatron-core
GPTModels; each rank's logits (its vocab slice and CP tokens), per-token losses and gradients of named parameters
(after megatron's data/expert-data-parallel reduction) equal transformers' within 1e-4."""
from __future__ import annotations

import json
import os
import re
import tempfile

import pytest
import torch

from tests.support.dist import run_distributed_once
from tests.support.reference import rel_err

TOL = 1e-4
CASES = [(arch, layout) for layout in ("tp2cp2", "pp2ep2") for arch in ("qwen3_next", "deepseek_v3", "kimi_linear")]
# DSA (its selections on this model and batch are > 1e-4 from a tie: tests/models/test_models_dsa.py); GLM-5's shared
# indexer layer 3 may not start a pipeline stage (its source, layer 2, would be on the other one), so GLM-5 is TP x CP
CASES += [("glm_moe_dsa", "tp2cp2"), ("deepseek_v32", "pp2ep2")]
# OLMo-Hybrid (dense) for its new block features; Ling 3.0 runs TP2 x CP2 + SP and EP2 in the example (= one rank)
CASES += [("olmo_hybrid", "tp2cp2")]
SIZES = {"tp2cp2": dict(tp=2, cp=2, pp=1, ep=1), "pp2ep2": dict(tp=1, cp=1, pp=2, ep=2)}
# mcore parameters whose gradients are compared (their HF counterparts: test_models_tp1.GRADS)
GRAD_KEYS = {
    "qwen3_next": ["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
                   "decoder.layers.2.mlp.router.weight", "decoder.layers.3.self_attention.linear_qkv.weight",
                   "decoder.layers.1.input_layernorm.weight",
                   "decoder.layers.0.self_attention.in_proj.weight"],
    "deepseek_v3": ["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight",
                    "decoder.layers.3.mlp.router.weight", "decoder.layers.2.self_attention.linear_kv_up_proj.weight",
                    "decoder.layers.0.mlp.linear_fc1.weight", "decoder.final_layernorm.weight"],
    "deepseek_v32": ["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight",
                     "decoder.layers.3.mlp.router.weight", "decoder.layers.2.self_attention.linear_kv_up_proj.weight",
                     "decoder.layers.0.self_attention.linear_q_up_proj.weight", "decoder.final_layernorm.weight"],
    "glm_moe_dsa": ["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight",
                    "decoder.layers.2.self_attention.linear_kv_up_proj.weight",
                    "decoder.layers.3.self_attention.linear_proj.weight", "decoder.final_layernorm.weight"],
    "kimi_linear": ["decoder.layers.2.mlp.experts.local_experts.0.linear_fc2.weight",
                    "decoder.layers.1.mlp.router.weight", "decoder.layers.0.self_attention.in_proj.weight",
                    "decoder.layers.3.self_attention.out_norm.weight",
                    "decoder.layers.2.self_attention.linear_kv_up_proj.weight"],
    "olmo_hybrid": ["decoder.layers.1.self_attention.q_layernorm.weight",
                    "decoder.layers.3.self_attention.k_layernorm.weight",
                    "decoder.layers.1.self_attention.post_norm.weight", "decoder.layers.3.mlp.post_norm.weight",
                    "decoder.layers.0.self_attention.in_proj.weight",
                    "decoder.layers.3.self_attention.linear_qkv.weight"],
}
# checkpoint names -> transformers' in-memory names (Kimi's MoE, OLMo-Hybrid's norms)
IN_MEMORY = (("block_sparse_moe.", "mlp."), ("feedforward_layer_norm", "post_attention_layernorm"),
             ("attention_layer_norm", "input_layernorm"))
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.")


def _named_tensors(model, ep_rank):
    """(TP=1 global key, parameter or buffer, owning delta mixer or None, path inside it) for this rank's model."""
    from layers.mixers.delta.mixer import DeltaMixer

    def walk(module, prefix, layer_mixer=None):
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            mixer_path = None
            if layer_mixer is not None and name.startswith("self_attention."):
                mixer_path = name[len("self_attention."):]
            yield prefix + name, t, layer_mixer, mixer_path

    out = []
    for name, t in list(model.named_parameters(recurse=False)):
        out.append((name, t, None, None))
    for child_name, child in model.named_children():
        if child_name != "decoder":
            out += list(walk(child, child_name + "."))
    decoder = model.decoder
    if getattr(decoder, "final_layernorm", None) is not None:
        out += list(walk(decoder.final_layernorm, "decoder.final_layernorm."))
    for layer in decoder.layers:
        mixer = layer.self_attention if isinstance(layer.self_attention, DeltaMixer) else None
        for key, t, mx, path in walk(layer, f"decoder.layers.{layer.layer_number - 1}.", mixer):
            match = _EXPERT.search(key)
            if match:
                local = layer.mlp.experts.num_local_experts
                key = _EXPERT.sub(f"mlp.experts.local_experts.{int(match.group(1)) + ep_rank * local}.", key)
            out.append((key, t, mx, path))
    return [(k, t, mx, p) for k, t, mx, p in out if t is not None and "inv_freq" not in k]


def _shard(full, t, key, mixer, path, tp_rank, tp):
    """This rank's part of a TP=1 tensor: our mixers' fused layouts, megatron's SwiGLU fc1 ``[gate; up]`` (each
    half split; every MLP here is SwiGLU), else the parameter's own ``partition_dim``."""
    if mixer is not None and path in mixer.param_layouts:
        lay = mixer.param_layouts[path]
        pieces = full.split([p.shape[lay.cat_dim] for p in lay.parts], lay.cat_dim)
        return lay.shard({p.name: x for p, x in zip(lay.parts, pieces)}, tp_rank, tp)
    if not getattr(t, "tensor_model_parallel", False) or tp == 1:
        return full
    if key.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, 0)
        return torch.cat([gate.chunk(tp, 0)[tp_rank], up.chunk(tp, 0)[tp_rank]], 0)
    return full.chunk(tp, t.partition_dim)[tp_rank]


def _reference_grads(hf_model, rules, keys):
    """TP=1 gradients of mcore ``keys`` from transformers' gradients: through the rules where the checkpoint names
    are transformers' in-memory names, else the fused in-memory expert tensors."""
    params = dict(hf_model.named_parameters())
    by_key = {r.mcore_key: r for r in rules}
    out = {}
    for key in keys:
        rule = by_key[key]
        names = list(rule.hf_keys)
        for old, new in IN_MEMORY:
            names = [k.replace(old, new) for k in names]
        if all(k in params for k in names):
            out[key] = rule.to_mcore([params[k].grad for k in names])
            continue
        match = re.match(r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.linear_fc2\.weight", key)
        assert match, key
        out[key] = params[f"model.layers.{match.group(1)}.mlp.experts.down_proj"].grad[int(match.group(2))]
    return out


def _run_case(arch, layout, rank):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hp_megatron.data import cp_token_index
    from hp_megatron.models import conversion_rules_from_hf, preset_from_hf, preset_gpt_model, preset_transformer_config
    from tests.support.models_case import SEQ, VOCAB, read_safetensors, tiny_hf_model, to_mcore, token_batch

    s = SIZES[layout]
    ps.initialize_model_parallel(s["tp"], s["pp"], context_parallel_size=s["cp"], expert_model_parallel_size=s["ep"])
    try:
        # transformers writes files on global rank 0 only: rank 0 saves, every rank reads (same seed, same model)
        box = [tempfile.mkdtemp() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        hf_model, _ = tiny_hf_model(arch, box[0], save=rank == 0)
        dist.barrier()
        with open(os.path.join(box[0], "config.json")) as f:
            hf_config = json.load(f)
        full = to_mcore(conversion_rules_from_hf(hf_config), read_safetensors(box[0]))
        rules = conversion_rules_from_hf(hf_config)
        preset = preset_from_hf(hf_config)
        config = preset_transformer_config(
            preset,
            tensor_model_parallel_size=s["tp"], pipeline_model_parallel_size=s["pp"],
            context_parallel_size=s["cp"], expert_model_parallel_size=s["ep"], pipeline_dtype=torch.float32,
            sequence_parallel=s["tp"] > 1,  # megatron's MoE layers refuse TP without sequence parallelism
            use_cpu_initialization=True, params_dtype=torch.float32, gradient_accumulation_fusion=False,
            bias_dropout_fusion=False)
        first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        model = preset_gpt_model(preset, config, max_sequence_length=64, pre_process=first, post_process=last)
        tp_rank, tp = ps.get_tensor_model_parallel_rank(), s["tp"]
        named = _named_tensors(model, ps.get_expert_model_parallel_rank())
        with torch.no_grad():
            for key, t, mixer, path in named:
                if key not in full:  # megatron's routing statistics buffers; every parameter has a rule
                    assert not isinstance(t, torch.nn.Parameter), key
                    continue
                t.copy_(_shard(full[key], t, key, mixer, path, tp_rank, tp))

        ids, targets = token_batch()
        ref = hf_model(input_ids=ids)
        ref_token_loss = torch.nn.functional.cross_entropy(ref.logits[:, :-1].reshape(-1, VOCAB),
                                                           ids[:, 1:].reshape(-1), reduction="none")
        (ref_token_loss.mean()).backward()
        # this rank's rows (data parallel) and tokens (context parallel)
        dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        rows = torch.arange(ids.shape[0]).chunk(dp)[dp_rank]
        cols = cp_token_index(SEQ, s["cp"], ps.get_context_parallel_rank(), None, "zigzag")
        local_ids, local_targets = ids[rows][:, cols], targets[rows][:, cols]
        positions = cols.expand_as(local_ids).contiguous()
        result = {}
        if first:
            hidden = model(local_ids, positions, None)
        else:
            recv = torch.empty(len(cols), len(rows), config.hidden_size)
            dist.recv(recv, ps.get_pipeline_model_parallel_prev_rank())
            recv.requires_grad_(True)
            model.set_input_tensor(recv)
        if last:
            logits = model(local_ids, positions, None)
            vocab = torch.arange(VOCAB).chunk(tp)[tp_rank]
            expected = ref.logits.detach()[rows][:, cols][..., vocab]
            result["logits"] = rel_err(logits, expected)
            per_token = model(local_ids, positions, None, labels=local_targets)
            keep = (cols < SEQ - 1).expand_as(per_token)
            expected_loss = ref_token_loss.detach().reshape(ids.shape[0], SEQ - 1)[rows][:, cols[cols < SEQ - 1]]
            result["token_loss"] = rel_err(per_token[keep], expected_loss.reshape(-1))
            (per_token[keep].sum() / (ids.shape[0] * (SEQ - 1))).backward()
            if not first:
                dist.send(recv.grad.contiguous(), ps.get_pipeline_model_parallel_prev_rank())
        else:
            dist.send(hidden.detach().contiguous(), ps.get_pipeline_model_parallel_next_rank())
            grad = torch.empty_like(hidden)
            dist.recv(grad, ps.get_pipeline_model_parallel_next_rank())
            hidden.backward(grad)
        # megatron's gradient reduction (finalize_model_grads): experts over the expert-data-parallel
        # group, the rest over data x context, sequence-parallel weights and q/k norms also over TP
        references = _reference_grads(hf_model, rules, GRAD_KEYS[arch])
        for key, t, mixer, path in named:
            if t.grad is None:
                continue
            expert = "local_experts" in key
            group = ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group(
                with_context_parallel=True)
            dist.all_reduce(t.grad, group=group)
            # replicated weights that saw only this rank's tokens, or (q/k norms) heads
            if getattr(t, "sequence_parallel", False) or config.qk_layernorm and ("q_layernorm" in key
                                                                                  or "k_layernorm" in key):
                dist.all_reduce(t.grad, group=ps.get_tensor_model_parallel_group())
            if key in references:
                result[key] = rel_err(t.grad, _shard(references[key], t, key, mixer, path, tp_rank, tp))
        return result
    finally:
        ps.destroy_model_parallel()


def _worker(rank, world_size):
    from hp_megatron.platform import apply_cpu_training_shims

    apply_cpu_training_shims(0)
    return {f"{arch}-{layout}": _run_case(arch, layout, rank) for arch, layout in CASES}


@pytest.fixture(scope="module")
def results():
    return run_distributed_once(_worker, 4)


@pytest.mark.parametrize("arch,layout", CASES)
def test_matches_transformers(results, arch, layout):
    case = f"{arch}-{layout}"
    checked = set()
    for rank, per_rank in enumerate(results):
        for name, err in per_rank[case].items():
            assert err <= TOL, (rank, name, err)
            checked.add(name)
    assert {"logits", "token_loss", *GRAD_KEYS[arch]} <= checked, sorted(set(GRAD_KEYS[arch]) - checked)
