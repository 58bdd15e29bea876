"""Multi-token prediction under model parallelism (4 gloo ranks, fp32, one shared spawn): the converted tiny
Qwen3-Next / DeepSeek-V3 checkpoints *with* MTP layers, loaded through ``sharded_state_dict`` at TP2 x CP2 (+SP),
PP2 (MTP on the last stage, its embedding copy), EP2, PP2 x EP2 and CP2 with packed documents, give the single
rank's per-token losses, MTP loss per depth and the gradients of the MTP parameters and the shared embedding.
Packed documents: the single rank's packed MTP loss is that of the documents run one by one (no prediction across
a document boundary), and CP2 gives it again (the shift crosses CP ranks)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import torch

from hp_megatron.models.common import mtp_layer_prefix
from tests.support.dist import share_spawn
from tests.support.reference import rel_err

TOL = 1e-4
LAYOUTS = {"tp2cp2": dict(tp=2, cp=2, pp=1, ep=1), "pp2": dict(tp=1, cp=1, pp=2, ep=1),
           "ep2": dict(tp=1, cp=1, pp=1, ep=2), "pp2ep2": dict(tp=1, cp=1, pp=2, ep=2),
           "cp2_packed": dict(tp=1, cp=2, pp=1, ep=1)}
CASES = {"qwen3_next": ("tp2cp2", "pp2", "ep2", "cp2_packed"), "deepseek_v3": ("tp2cp2", "pp2ep2")}
COMPARED = ("mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
            "mtp.layers.0.final_layernorm.weight", f"{mtp_layer_prefix(0)}input_layernorm.weight",
            f"{mtp_layer_prefix(0)}mlp.router.weight", "embedding.word_embeddings.weight")
SEQ, BATCH, DOCS = 12, 4, (0, 8, 16)   # BSHD rows; packed: one row of two documents


def _checkpoint(arch):
    """(config.json dict, converted checkpoint): rank 0 writes the tiny MTP checkpoint and converts it in a separate
    process (``python -m hp_megatron.convert hf-to-mcore --mtp-num-layers 1``); every rank gets both."""
    import json

    import torch.distributed as dist

    from hp_megatron.checkpoint import checkpoint_directory
    from tests.support.mtp_case import tiny_mtp_checkpoint

    box = [None]
    if dist.get_rank() == 0:
        root = tempfile.mkdtemp()
        hf, ckpt = os.path.join(root, "hf"), os.path.join(root, "mcore")
        tiny_mtp_checkpoint(arch, hf)
        done = subprocess.run([sys.executable, "-m", "hp_megatron.convert", "hf-to-mcore", "--load", hf, "--save",
                               ckpt, "--mtp-num-layers", "1"], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"conversion failed: {done.stderr[-2000:]}")
        with open(os.path.join(hf, "config.json")) as f:
            box = [(json.load(f), checkpoint_directory(ckpt))]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _model(arch, config_json, ckpt, sizes):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from hp_megatron.models import get_architecture, preset_gpt_model, preset_transformer_config

    preset = get_architecture(arch).preset(config_json)
    config = preset_transformer_config(
        preset,
        tensor_model_parallel_size=sizes["tp"], pipeline_model_parallel_size=sizes["pp"],
        context_parallel_size=sizes["cp"], expert_model_parallel_size=sizes["ep"], pipeline_dtype=torch.float32,
        sequence_parallel=sizes["tp"] > 1, use_cpu_initialization=True, params_dtype=torch.float32,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, mtp_num_layers=1)
    model = preset_gpt_model(preset, config, max_sequence_length=64, pre_process=ps.is_pipeline_first_stage(),
                             post_process=ps.is_pipeline_last_stage())
    # no metadata: under PP the MTP stage's embedding copy is tied over the data x context group by default
    sharded = model.sharded_state_dict()
    state = dist_checkpointing.load(sharded, ckpt)
    model.load_state_dict({k: v for k, v in state.items() if k in sharded}, strict=True)
    return model.train()


def _batch(packed):
    """(ids, labels, loss mask) of the global batch: BSHD ``[BATCH, SEQ]`` or one packed row ``[1, DOCS[-1]]``
    whose documents' last tokens have no label."""
    gen = torch.Generator().manual_seed(3)
    if not packed:
        ids = torch.randint(0, 64, (BATCH, SEQ + 1), generator=gen)
        return ids[:, :-1], ids[:, 1:], torch.ones(BATCH, SEQ)
    ids = torch.randint(0, 64, (1, DOCS[-1]), generator=gen)
    labels, mask = torch.roll(ids, -1, 1), torch.ones(1, DOCS[-1])
    ends = torch.tensor(DOCS[1:]) - 1
    labels[:, ends], mask[:, ends] = 0, 0.0
    return ids, labels, mask


def _step(model, ids, labels, mask, sizes, packed_seq_params=None, cols=None):
    """One forward/backward of this rank's tokens on its pipeline stage; returns (per-token loss or None, MTP loss
    of depth 1 reduced as megatron logs it). Each rank's loss: its tokens' sum over its data-parallel shard's count."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from layers.base.megatron_compat import mtp_loss_values

    MTPLossLoggingHelper.tracker.clear()
    cols = torch.arange(ids.shape[1]) if cols is None else cols
    local = [t[:, cols] for t in (ids, labels, mask)]
    positions = cols.expand_as(local[0]).contiguous()
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    kwargs = dict(labels=local[1], loss_mask=local[2], packed_seq_params=packed_seq_params)
    if not first:
        recv = torch.empty(local[0].shape[1], local[0].shape[0], model.config.hidden_size)
        dist.recv(recv, ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(recv.requires_grad_(True))
    out = model(local[0], positions, None, **kwargs)
    if not last:
        dist.send(out.detach().contiguous(), ps.get_pipeline_model_parallel_next_rank())
        grad = torch.empty_like(out)
        dist.recv(grad, ps.get_pipeline_model_parallel_next_rank())
        out.backward(grad)
        mtp = None
    else:
        # as megatron's schedule: the main loss times the CP size (the DDP averages over data x context)
        (out * local[2]).sum().div(mask.sum()).mul(ps.get_context_parallel_world_size()).backward()
        if not first:
            dist.send(recv.grad.contiguous(), ps.get_pipeline_model_parallel_prev_rank())
        mtp = mtp_loss_values(reduce=True)[0].clone()
    return (out.detach() if last else None), mtp


def _reduced_grads(model, sizes):
    """Gradients of ``COMPARED`` after megatron's DDP reductions: sum over data x context (experts: expert data)
    divided by the data x context size, and sequence-parallel weights over TP; the embedding copy of the MTP stage
    summed with the first stage's (the embedding group)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out = {}
    dp_cp = ps.get_data_parallel_world_size(with_context_parallel=True)
    for key, t in model.named_parameters():
        if t.grad is None:
            continue
        expert = "local_experts" in key
        group = (ps.get_expert_data_parallel_group() if expert
                 else ps.get_data_parallel_group(with_context_parallel=True))
        dist.all_reduce(t.grad, group=group)
        t.grad /= dp_cp
        if getattr(t, "sequence_parallel", False):
            dist.all_reduce(t.grad, group=ps.get_tensor_model_parallel_group())
        if key == "embedding.word_embeddings.weight" and sizes["pp"] > 1:
            dist.all_reduce(t.grad, group=ps.get_embedding_group())
        if key in COMPARED:
            out[key] = t.grad.clone()
    return out


def _local_of(full, t, tp_rank, tp):
    if not getattr(t, "tensor_model_parallel", False) or tp == 1:
        return full
    return full.chunk(tp, t.partition_dim)[tp_rank]


def _packed_params(cu):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu32 = torch.tensor(cu, dtype=torch.int32)
    longest = int((cu32[1:] - cu32[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu32, cu_seqlens_kv=cu32, cu_seqlens_q_padded=cu32,
                           cu_seqlens_kv_padded=cu32, max_seqlen_q=longest, max_seqlen_kv=longest)


def _reference(arch, config_json, ckpt, packed):
    """The single rank's (per-token losses, MTP loss, grads of COMPARED); for packed rows also the MTP loss of the
    documents run one by one."""
    from megatron.core import parallel_state as ps

    one = dict(tp=1, cp=1, pp=1, ep=1)
    ps.initialize_model_parallel(1, 1)
    try:
        ids, labels, mask = _batch(packed)
        model = _model(arch, config_json, ckpt, one)
        token_loss, mtp = _step(model, ids, labels, mask, one, _packed_params(DOCS) if packed else None)
        grads = {k: t.grad.clone() for k, t in model.named_parameters() if k in COMPARED}
        separate = None
        if packed:
            sums = []
            for start, end in zip(DOCS[:-1], DOCS[1:]):
                doc = [t[:, start:end] for t in (ids, labels, mask)]
                model.zero_grad()
                _, doc_mtp = _step(model, *doc, one)
                count = doc[2][:, 1:].sum()   # the depth-1 targets: the mask shifted one token
                sums.append((doc_mtp * count, count))
            separate = sum(s for s, _ in sums) / sum(c for _, c in sums)
        return token_loss, mtp, grads, separate
    finally:
        ps.destroy_model_parallel()


def _run_layout(arch, layout, config_json, ckpt, reference):
    from megatron.core import parallel_state as ps

    from hp_megatron.data import cp_token_index

    sizes = LAYOUTS[layout]
    packed = layout.endswith("packed")
    ps.initialize_model_parallel(sizes["tp"], sizes["pp"], context_parallel_size=sizes["cp"],
                                 expert_model_parallel_size=sizes["ep"])
    try:
        ids, labels, mask = _batch(packed)
        dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        rows = torch.arange(ids.shape[0]).chunk(dp)[dp_rank] if not packed else torch.arange(1)
        cu = torch.tensor(DOCS) if packed else None
        cols = cp_token_index(ids.shape[1], sizes["cp"], ps.get_context_parallel_rank(), cu, "zigzag")
        model = _model(arch, config_json, ckpt, sizes)
        token_loss, mtp = _step(model, ids[rows], labels[rows], mask[rows], sizes,
                                _packed_params(DOCS) if packed else None, cols)
        ref_tokens, ref_mtp, ref_grads, _ = reference
        result = {}
        if token_loss is not None:
            result["token_loss"] = rel_err(token_loss, ref_tokens[rows][:, cols])
            result["mtp_loss"] = rel_err(mtp, ref_mtp)
        named = dict(model.named_parameters())
        tp_rank = ps.get_tensor_model_parallel_rank()
        for key, grad in _reduced_grads(model, sizes).items():
            result[key] = rel_err(grad, _local_of(ref_grads[key], named[key], tp_rank, sizes["tp"]))
        return result
    finally:
        ps.destroy_model_parallel()


def _worker(rank, world_size):
    from hp_megatron.platform import apply_cpu_training_shims

    apply_cpu_training_shims(0)
    results = {}
    for arch, layouts in CASES.items():
        config_json, ckpt = _checkpoint(arch)
        references = {packed: _reference(arch, config_json, ckpt, packed)
                      for packed in {layout.endswith("packed") for layout in layouts}}
        if True in references:
            _, packed_mtp, _, separate = references[True]
            results[f"{arch}-packed-documents"] = {"mtp_loss": rel_err(packed_mtp, separate)}
        for layout in layouts:
            results[f"{arch}-{layout}"] = _run_layout(arch, layout, config_json, ckpt,
                                                      references[layout.endswith("packed")])
    return results


_results = share_spawn(_worker, (4,))


@pytest.fixture(scope="module")
def results():
    return _results(4)


@pytest.mark.parametrize("case", [f"{a}-{layout}" for a, ls in CASES.items() for layout in ls]
                         + ["qwen3_next-packed-documents"])
def test_mtp_layout_matches_single_rank(results, case):
    checked = set()
    for rank, per_rank in enumerate(results):
        for name, err in per_rank[case].items():
            assert err <= TOL, (rank, name, err)
            checked.add(name)
    expected = {"mtp_loss"} if case.endswith("documents") else {"token_loss", "mtp_loss", *COMPARED}
    assert expected <= checked, sorted(expected - checked)
