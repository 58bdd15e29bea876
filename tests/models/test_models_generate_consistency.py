"""Train / generation consistency (what RL needs): the log-probabilities ``hp_megatron.generate`` records for
sampled tokens equal the training forward's log-probabilities of the same tokens (fp32).

Generation: megatron-core's static inference path at TP1 (GDN / KDA recurrent decode steps, MLA latent cache,
attention KV cache), three prompts of different lengths in one batch, 16 tokens sampled at temperature 1 from the
full distribution. Training forward: the prompts + generations as packed documents (one THD row, PackedSeqParams),
split over CP=2 by the data slicer (zigzag), the chunked kernels; each rank's log-probs gathered back to global
positions. The tiny random models of ``models_case`` (Qwen3-Next, Kimi Linear, DeepSeek-V3), one 2-rank spawn
shared with other modules. Also generation at TP2 (the same greedy tokens as TP1).

Tolerance: |generation - training| <= 1e-5 max(1, |log p|) + the training forward's own fp32 error (its distance
from an fp64 forward of the same documents, measured here). 1e-5 alone is below fp32's noise on these models: the
fp32 training forward is 1.5e-5 (Qwen3-Next) and 5e-5 (Kimi Linear) away from the fp64 forward, so no second fp32
evaluation order could meet it reliably; a wrong cache or decode step differs by orders of magnitude more.
"""
from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch

from tests.support.dist import share_spawn

ARCHS = ("qwen3_next", "kimi_linear", "deepseek_v3")
PROMPT_LENGTHS = (3, 7, 12)
NEW_TOKENS = 16
TOL = 1e-5


def _model(preset_cp: int, hf_config: dict, state: dict):
    from hp_megatron.models import architecture_of

    model = architecture_of(hf_config).build_model(hf_config, context_parallel_size=preset_cp)
    model.load_state_dict(state, strict=True)
    return model.eval()


def _prompts(vocab: int):
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _generate(model, hf_config, **sampling):
    from hp_megatron.generate import StaticGenerator, sampling_params

    generator = StaticGenerator(model, vocab_size=hf_config["vocab_size"], max_positions=model.max_sequence_length,
                                max_batch_size=3, max_sequence_length=64)
    return generator.generate(_prompts(hf_config["vocab_size"]), sampling_params(max_new_tokens=NEW_TOKENS, **sampling),
                              seed=11)


def _training_log_probs(hf_config, state, documents):
    """Log-probability of every next token of ``documents`` (lists of ids) from the training forward at CP2 on
    packed documents: ``{(document, position): log p(token at position + 1)}``."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hp_megatron.data import get_batch_on_this_cp_rank
    from hp_megatron.training.packing import document_multiple, pack_documents

    model = _model(2, hf_config, state)
    tokens = torch.tensor([t for doc in documents for t in doc])[None]
    positions = torch.cat([torch.arange(len(doc)) for doc in documents])[None]
    labels = torch.cat([torch.tensor(doc[1:] + [0]) for doc in documents])[None]
    batch = {"tokens": tokens, "labels": labels, "loss_mask": torch.ones_like(tokens, dtype=torch.float),
             "position_ids": positions}
    packed, params = pack_documents(batch, pad_id=0, multiple=document_multiple(2, "zigzag"))
    packed["global_index"] = torch.arange(packed["tokens"].shape[1])[None]
    local = get_batch_on_this_cp_rank(packed, params)
    with torch.no_grad():
        logits = model(local["tokens"], local["position_ids"], None, packed_seq_params=params)
    log_probs = torch.log_softmax(logits.float(), -1).gather(-1, local["labels"][..., None])[0, :, 0]
    index = local["global_index"][0]
    gathered = [torch.empty_like(log_probs) for _ in range(2)], [torch.empty_like(index) for _ in range(2)]
    dist.all_gather(gathered[0], log_probs, group=ps.get_context_parallel_group())
    dist.all_gather(gathered[1], index, group=ps.get_context_parallel_group())
    full = torch.empty(packed["tokens"].shape[1])
    full[torch.cat(gathered[1])] = torch.cat(gathered[0])
    starts = params.cu_seqlens_q_padded.tolist()
    return {(d, p): float(full[starts[d] + p]) for d, doc in enumerate(documents) for p in range(len(doc) - 1)}


def _fp64_log_probs(hf_config, state, documents):
    """The same log-probabilities from an fp64 model (one document per forward, TP1, no CP)."""
    from hp_megatron.models import architecture_of

    model = architecture_of(hf_config).build_model(hf_config, params_dtype=torch.float64)
    model.load_state_dict({k: v.double() for k, v in state.items()}, strict=True)
    out = {}
    for d, doc in enumerate(documents):
        with torch.no_grad():
            logits = model.eval()(torch.tensor([doc]), torch.arange(len(doc))[None], None)
        log_probs = torch.log_softmax(logits[0].double(), -1)
        out.update({(d, p): float(log_probs[p, doc[p + 1]]) for p in range(len(doc) - 1)})
    return out


def _case(arch, rank):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from hp_megatron.generate.model import build_model
    from hp_megatron.models import conversion_rules_from_hf
    from tests.support.models_case import read_safetensors, tiny_hf_model, to_mcore

    box = [tempfile.mkdtemp() if rank == 0 else None]  # rank 0 saves the model, every rank reads it
    dist.broadcast_object_list(box, src=0)
    tiny_hf_model(arch, box[0], save=rank == 0)
    dist.barrier()
    with open(os.path.join(box[0], "config.json")) as f:
        hf_config = json.load(f)
    state = to_mcore(conversion_rules_from_hf(hf_config), read_safetensors(box[0]))
    ps.initialize_model_parallel(1, 1)
    try:
        model = _model(1, hf_config, state)
        result = _generate(model, hf_config, top_k=0)    # sampled from the full distribution
        greedy_tp1 = _generate(model, hf_config)
        ckpt = [os.path.join(box[0], "ckpt") if rank == 0 else None]
        dist.broadcast_object_list(ckpt, src=0)
        if rank == 0:
            os.makedirs(ckpt[0])
        dist.barrier()
        dist_checkpointing.save({"model": model.sharded_state_dict()}, ckpt[0])
    finally:
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(2, 1)
    try:  # TP2: the checkpoint resharded by megatron-core, greedy tokens as at TP1
        greedy_tp2 = _generate(build_model(hf_config, tensor_model_parallel_size=2, load=ckpt[0]), hf_config)
    finally:
        ps.destroy_model_parallel()
    prompts = _prompts(hf_config["vocab_size"])
    documents = [p + t for p, t in zip(prompts, result.tokens)]
    ps.initialize_model_parallel(1, 1, context_parallel_size=2)
    try:
        train = _training_log_probs(hf_config, state, documents)
    finally:
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1)
    try:
        exact = _fp64_log_probs(hf_config, state, documents)
    finally:
        ps.destroy_model_parallel()
    positions = [(d, len(p) + j - 1, lp) for d, p in enumerate(prompts) for j, lp in enumerate(result.log_probs[d])]
    diffs = [abs(train[(d, t)] - lp) for d, t, lp in positions]
    excess = [abs(train[(d, t)] - lp) - abs(train[(d, t)] - exact[(d, t)]) - TOL * max(1.0, abs(lp))
              for d, t, lp in positions]
    tp2_diff = max(abs(a - b) for x, y in zip(greedy_tp1.log_probs, greedy_tp2.log_probs) for a, b in zip(x, y))
    return {"max_abs": max(diffs), "max_excess": max(excess),
            "train_fp32_error": max(abs(train[k] - exact[k]) for k in exact), "count": len(diffs),
            "min_log_prob": min(min(lp) for lp in result.log_probs),
            "tp2_same_tokens": greedy_tp1.tokens == greedy_tp2.tokens, "tp2_log_prob_diff": tp2_diff}


def _worker(rank, world_size):
    from hp_megatron.platform import apply_cpu_training_shims

    apply_cpu_training_shims(0)
    return {arch: _case(arch, rank) for arch in ARCHS}


results = share_spawn(_worker, [2])


@pytest.mark.parametrize("arch", ARCHS)
def test_generation_log_probs_equal_training_forward(arch):
    for rank_result in results(2):
        case = rank_result[arch]
        assert case["count"] == len(PROMPT_LENGTHS) * NEW_TOKENS
        assert case["min_log_prob"] < -1.0  # sampled, not only the most likely tokens
        assert case["max_excess"] <= 0.0, case


@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_parallel_generation_equals_single_rank(arch):
    """TP2 (the checkpoint saved at TP1, resharded on load): the same greedy tokens, log-probs within 1e-5."""
    for rank_result in results(2):
        case = rank_result[arch]
        assert case["tp2_same_tokens"] and case["tp2_log_prob_diff"] < TOL, case
