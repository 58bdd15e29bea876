"""Pretrain a small hybrid GPT (GDN / KDA / MLA / attention layers) on megatron-core alone.

Launch with torchrun; gloo on CPU, NCCL on GPU. Flags follow Megatron-LM's names, plus ours (``--hp-*``):

    torchrun --nproc-per-node 2 examples/pretrain/pretrain_hybrid.py --context-parallel-size 2

The file reads like Megatron-LM's ``pretrain_gpt.py``: 1. arguments (``cli.py``) and the process groups they
describe, 2. the model provider, 3. the data provider and the forward step, 4. the training loop, which
Megatron-LM keeps in ``megatron/training`` (here: this file's ``train`` with ``training.py`` and
``checkpointing.py``).

Without ``--data-path`` the default dataset (CPython's documentation text, BPE tokenizer trained
offline, Megatron indexed format; see prepare_data.py) is built under ``out/data/pydoc`` on first use.
Parallelism: TP, SP, CP (our mixers' CP methods), PP (megatron-core's schedules, also on gloo), EP (megatron-core's
expert groups, ``--expert-model-parallel-size``). MoE (``--num-experts``...) and multi-token prediction
(``--mtp-num-layers``) with Megatron-LM's flags; their losses are logged as Megatron-LM logs them. Model:
megatron-core ``GPTModel`` with ``hp_megatron.specs.get_hybrid_layer_spec(--hp-layer-pattern)``, or with
``--hp-hf-config HF_DIR`` the preset's model of a Qwen3-Next / Kimi Linear / DeepSeek-V3 config.json (start it from
``python -m hp_megatron.convert hf-to-mcore`` output with ``--load``; docs/models.md); both built by
``hp_megatron.model_builders.hybrid_gpt_model``. Data: megatron-core ``GPTDataset``. Gradients: megatron-core
DDP over the data-parallel x CP group. Optimizer: ``hp_megatron.training.optimizer.get_optimizer`` (megatron-core's
on GPU; on CPU, where its grad scaler allocates CUDA, torch's AdamW over DDP's main grads with megatron's
gradient-norm clipping). Checkpoints: ``dist_checkpointing`` (model, optimizer, scheduler, iteration, consumed
samples), loadable under any other TP/CP/PP layout.
"""
from __future__ import annotations

import os
import sys
import time
from functools import partial

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:  # run from a fresh clone without installing
    sys.path.insert(0, REPO)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from checkpointing import resume, save_checkpoint  # noqa: E402
from cli import parse_args, quiet_known_warnings, run_reporting_errors, same_on_every_rank, split_weights  # noqa: E402
from hp_megatron.arguments import apply_hp_config  # noqa: E402
from hp_megatron.training.cp_subgroup_registration import register_cp_subgroups_from_args  # noqa: E402
from hp_megatron.models import preset_gpt_model, preset_hybrid_model, preset_transformer_config  # noqa: E402
from hp_megatron.models.args import preset_vocab_size  # noqa: E402
from hp_megatron.platform import CPU_SAFE_CONFIG, apply_cpu_training_shims  # noqa: E402
from hp_megatron.training.model_args import (MODEL_ARGS_KEY, hybrid_config_from_args,  # noqa: E402
                                             hybrid_model_from_args, stored_model_args)
from hp_megatron.training.aux_losses import AuxLossLog  # noqa: E402
from hp_megatron.training.optimizer import get_optimizer  # noqa: E402
from training import (BatchLoader, ProgressDisplay, build_scheduler, describe_data, describe_model,  # noqa: E402
                      log_line, reduce_lm_loss, run_summary, validation_log_lines)

DEFAULT_DATA_DIR = os.path.join(REPO, "out", "data", "pydoc")


# ------------------------------------------------------------------------------ 1. arguments, process groups
# parse_args (cli.py): Megatron-LM's flag names and defaults, every check that needs only the flags.
def initialize(args):
    """Process group, megatron parallel state, the CP sub-groups, seeds. Returns the device."""
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if on_gpu else "gloo")
    if not on_gpu:
        apply_cpu_training_shims(args.seed)
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size)
    args.data_parallel_size = parallel_state.get_data_parallel_world_size()
    register_cp_subgroups_from_args(args)   # every rank, here: CP groups smaller than the world need it
    if on_gpu:
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")


# ------------------------------------------------------------------------------------------- 2. model provider
def pad_vocab(vocab_size, tp, multiple=128):
    step = multiple * tp
    return ((vocab_size + step - 1) // step) * step


def model_vocab_size(args, tokenizer_vocab: int) -> int:
    """The embedding rows: the tokenizer's vocabulary padded to 128 x TP, or with ``--hp-hf-config`` the HF
    config's ``vocab_size`` (``hp_megatron.models.args.preset_vocab_size``: the converted checkpoint's rows)."""
    tp = args.tensor_model_parallel_size
    if args.hp_preset is None:
        return pad_vocab(tokenizer_vocab, tp)
    return preset_vocab_size(args.hp_preset, tokenizer_vocab, tp, f"--hp-hf-config {args.hp_hf_config}")


def build_config(args, vocab_size):
    """The declared ``HybridTransformerConfig`` of the flags (or of ``--hp-hf-config``'s architecture with this
    run's parallelism and dtype), with ``hp_megatron.platform.CPU_SAFE_CONFIG`` (no fused Apex/TE kernels)."""
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    run = dict(tensor_model_parallel_size=args.tensor_model_parallel_size,
               pipeline_model_parallel_size=args.pipeline_model_parallel_size,
               context_parallel_size=args.context_parallel_size, sequence_parallel=args.sequence_parallel,
               init_method_std=args.init_method_std, params_dtype=dtype, pipeline_dtype=dtype, bf16=args.bf16,
               calculate_per_token_loss=args.calculate_per_token_loss, **CPU_SAFE_CONFIG)
    if args.cp_comm_type:   # megatron's field, as Megatron-LM sets it (one value, or one per layer)
        run.update(cp_comm_type=args.cp_comm_type[0] if len(args.cp_comm_type) == 1 else list(args.cp_comm_type))
    if args.num_experts is not None:  # how the experts are split and balanced: this run's flags
        run.update(expert_model_parallel_size=args.expert_model_parallel_size,
                   expert_tensor_parallel_size=args.expert_tensor_parallel_size,
                   moe_router_load_balancing_type=args.moe_router_load_balancing_type,
                   moe_aux_loss_coeff=args.moe_aux_loss_coeff,
                   moe_router_bias_update_rate=args.moe_router_bias_update_rate)
    if args.mtp_num_layers:  # megatron-core's multi-token-prediction block on the last stage (hybrid_gpt_model)
        run.update(mtp_num_layers=args.mtp_num_layers, mtp_loss_scaling_factor=args.mtp_loss_scaling_factor)
    if args.hp_preset is not None:
        return apply_hp_config(preset_transformer_config(args.hp_preset, **run), args)
    return hybrid_config_from_args(args, **run)


def build_model(args, config, vocab_size):
    """This pipeline stage's ``GPTModel`` (``hybrid_gpt_model``) or, with ``--model-class hybrid``, ``HybridModel``
    (``hybrid_model``; its config is ``config`` in HybridModel's layer numbering) in megatron-core DDP."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    stage = dict(pre_process=parallel_state.is_pipeline_first_stage(),
                 post_process=parallel_state.is_pipeline_last_stage())
    if args.hp_preset is not None:  # exactly the model the conversion rules of --hp-hf-config target
        build = preset_hybrid_model if args.model_class == "hybrid" else preset_gpt_model
        model = build(args.hp_preset, config, args.hp_backend, max_sequence_length=args.seq_length, **stage,
                      linear=args.hp_linear, cp_layout=args.hp_cp_layout)
    else:
        model = hybrid_model_from_args(args, config, vocab_size=vocab_size, **stage)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def build_optimizer(args, model):
    from megatron.core.optimizer import OptimizerConfig

    config = OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                             adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                             clip_grad=args.clip_grad, bf16=args.bf16,
                             params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
                             use_distributed_optimizer=False)
    return get_optimizer(config, [model])


# ---------------------------------------------------------------------------- 3. data provider, forward step
def prepare_default_data(args, data_dir=DEFAULT_DATA_DIR):
    """Without ``--data-path``: the pydoc dataset in ``data_dir``, built by rank 0 on first use. A folder holding a
    dataset of other settings (e.g. ``prepare_data.py --vocab-size 512`` there) is refused on every rank."""
    if args.data_path is not None:  # checked at parse time
        return
    from prepare_data import DATA_NAME, DEFAULT_VOCAB_SIZE, build, dataset_ready

    ready = dataset_ready(data_dir, DEFAULT_VOCAB_SIZE, other_use="pass --data-path and --tokenizer to train on it")
    dist.barrier()  # every rank has read the folder before rank 0 writes to it
    if dist.get_rank() == 0 and not ready:
        print(f"building the default dataset in {data_dir} ...", flush=True)
        build(data_dir, DEFAULT_VOCAB_SIZE)
    dist.barrier()
    args.data_path = os.path.join(data_dir, DATA_NAME)
    args.tokenizer = os.path.join(data_dir, "tokenizer.json")


def dataset_sizes(args):
    """Samples of the train / validation / test splits: ``train_iters x GBS`` and, when the split has a validation
    part, ``eval_iters x GBS`` (every evaluation reads the same first validation batches)."""
    valid = args.eval_iters * args.global_batch_size if split_weights(args.split)[1] > 0 else 0
    return [args.train_iters * args.global_batch_size, valid, 0]


def build_datasets(args, tokenizer):
    """megatron-core GPTDatasets (train, validation or None) over the indexed dataset."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=([args.data_path], None),
        split=args.split, tokenizer=tokenizer, reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,
        path_to_cache=os.path.join(os.path.dirname(os.path.abspath(args.data_path)), "cache"))
    sizes = dataset_sizes(args)
    keep_needed_splits(config, args, sizes)
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    if train is None:
        raise ValueError(f"no training split in {args.data_path} with --split {args.split}")
    if args.eval_interval and valid is None:
        raise ValueError(f"no validation split in {args.data_path} with --split {args.split}")
    return train, valid


def keep_needed_splits(config, args, sizes):
    """Drop the parts of ``config.split_matrix`` that are not read (the test part: the example has no test phase);
    ValueError when a part that is read holds no document (megatron-core's GPTDataset would loop forever on it)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    documents = len(IndexedDataset(args.data_path))
    for i, name in enumerate(("training", "validation", "test")):
        bounds = config.split_matrix[i]
        if bounds is None:
            continue
        if not sizes[i]:
            config.split_matrix[i] = None
        elif int(round(bounds[1] * documents)) == int(round(bounds[0] * documents)):  # megatron-core's rounding
            raise ValueError(f"--split {args.split} leaves the {name} part none of the {documents} documents of "
                             f"--data-path {args.data_path}; give it a larger weight")


def loss_func(loss_mask, output_tensor):
    """Megatron's 3-tuple loss: (sum of token losses, token count, {"lm loss": [sum, count]})."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss.detach(), mask.sum()])
    return loss, num_tokens, {"lm loss": report}


def forward_step(progress, data_iterator, model):
    batch = next(data_iterator)  # BatchLoader: this rank's micro-batch, CP share and packing included
    progress.microbatch_started()
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   loss_mask=batch["loss_mask"], packed_seq_params=batch.get("packed_seq_params"))
    return output, partial(loss_func, batch["loss_mask"])


# ----------------------------------------------------------------------------------------------------- 4. loop
def setup(args):
    """Everything before the first iteration, built from the flags alone (so any error is the same on every
    rank): process groups, data files, tokenizer, model, optimizer, scheduler, the checkpoint to resume.
    Returns a namespace with those and ``iteration`` / ``consumed`` (0 without a checkpoint)."""
    from types import SimpleNamespace

    from layers.shared.tp_replicated_grads import finalize_model_grads  # megatron-core's + the once-per-step TP sums

    from prepare_data import BPETokenizer

    device = initialize(args)
    prepare_default_data(args)
    tokenizer = BPETokenizer(args.tokenizer)
    vocab_size = model_vocab_size(args, tokenizer.vocab_size)
    config = build_config(args, vocab_size)
    model = build_model(args, config, vocab_size)
    config = model.config  # HybridModel's: the same fields in its layer numbering
    optimizer = build_optimizer(args, model)
    scheduler = build_scheduler(args, optimizer)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    iteration, consumed = resume(args, model, optimizer, scheduler)
    return SimpleNamespace(device=device, tokenizer=tokenizer, vocab_size=vocab_size, config=config, model=model,
                           optimizer=optimizer, scheduler=scheduler, iteration=iteration, consumed=consumed,
                           model_description=model_description(args, vocab_size, tokenizer.vocab_size))


def model_description(args, vocab_size, tokenizer_vocab):
    """What each checkpoint stores to rebuild the model, as Megatron-LM stores ``args``: ``--hp-hf-config``'s
    config.json (``{"hf_config": ...}``, as a converted checkpoint) or the model flags
    (``hp_megatron.training.model_args.stored_model_args``); ``python -m hp_megatron.generate --load`` reads them."""
    model_class = {"model_class": args.model_class}
    if args.hp_preset is not None:
        from hp_megatron.convert.safetensors_io import load_hf_config

        return {"hf_config": load_hf_config(args.hp_hf_config), **model_class}
    return {MODEL_ARGS_KEY: stored_model_args(args, padded_vocab_size=vocab_size, vocab_size=tokenizer_vocab),
            **model_class, "hybrid_layer_pattern": args.hybrid_layer_pattern}


def evaluate(args, model, loader, forward_step_func, num_micro, device):
    """Mean validation token loss over ``--eval-iters`` global batches (the first ones of the split)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.eval()
    reports = []
    with torch.no_grad():
        for k in range(args.eval_iters):
            reports += get_forward_backward_func()(
                forward_step_func=forward_step_func, data_iterator=loader.global_batch(k * args.global_batch_size),
                model=model, num_microbatches=num_micro, seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length, forward_only=True)
    model.train()
    return reduce_lm_loss(reports, device)


def train(args):
    """Run the training loop; returns a list of per-iteration dicts (on every rank: loss, grad norm, lr)
    and, after evaluations, ``{"iteration", "validation_lm_loss"}`` entries."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    run_start = time.perf_counter()
    with same_on_every_rank():
        run = setup(args)
    device, tokenizer, model, optimizer, scheduler = run.device, run.tokenizer, run.model, run.optimizer, run.scheduler
    iteration, consumed = run.iteration, run.consumed
    if iteration >= args.train_iters:
        if dist.get_rank() == 0:
            print(f"nothing to train: the checkpoint in {args.load} is at iteration {iteration} and --train-iters "
                  f"is {args.train_iters}; raise --train-iters to continue", flush=True)
        parallel_state.destroy_model_parallel()
        return []
    with same_on_every_rank():
        train_data, valid_data = build_datasets(args, tokenizer)
    loader = BatchLoader(train_data, args, device, tokenizer.pad, model.config)
    valid_loader = (BatchLoader(valid_data, args, device, tokenizer.pad, model.config) if valid_data is not None
                    else None)
    log_rank = dist.get_world_size() - 1
    is_log_rank = dist.get_rank() == log_rank
    num_micro = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    progress = ProgressDisplay(enabled=is_log_rank and not args.no_progress, num_microbatches=num_micro)
    step_func = partial(forward_step, progress)
    if is_log_rank:
        n_params = sum(p.numel() for p in model.parameters())
        print(describe_model(args, run.vocab_size, n_params, device), flush=True)
        print(describe_data(args, tokenizer, train_data), flush=True)
        if not args.save:
            print("no --save: no checkpoint will be written", flush=True)
    fwd_bwd = get_forward_backward_func()
    aux_log = AuxLossLog([model], run.config, num_micro)
    history, saved_to = [], None
    first_iteration, train_seconds = iteration, 0.0
    model.train()
    while iteration < args.train_iters:
        start = time.perf_counter()
        progress.start(iteration + 1)
        optimizer.zero_grad()
        model.zero_grad_buffer()
        aux_log.before_step()
        losses = fwd_bwd(forward_step_func=step_func,
                         data_iterator=loader.global_batch(consumed), model=model, num_microbatches=num_micro,
                         seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                         decoder_seq_length=args.seq_length, forward_only=False)
        aux_entries = aux_log.after_step()  # finalize_model_grads (in fwd_bwd) updated the routers' expert bias
        update_ok, grad_norm, _ = optimizer.step()
        if not update_ok:
            raise RuntimeError(f"optimizer step failed at iteration {iteration + 1} (non-finite gradients?)")
        scheduler.step(increment=args.global_batch_size)
        progress.stop()
        iteration += 1
        consumed += args.global_batch_size
        lm_loss = reduce_lm_loss(losses, device)
        elapsed = time.perf_counter() - start
        train_seconds += elapsed
        lr = optimizer.param_groups[0]["lr"]
        history.append({"iteration": iteration, "lm_loss": lm_loss, "grad_norm": float(grad_norm), "lr": lr,
                        **aux_entries})
        if is_log_rank and iteration % args.log_interval == 0:
            tokens = args.global_batch_size * args.seq_length
            print(log_line(iteration, args.train_iters, consumed, elapsed, lr, args.global_batch_size,
                           lm_loss, grad_norm, tokens / elapsed, aux_entries), flush=True)
        last = iteration == args.train_iters or bool(args.exit_interval and iteration % args.exit_interval == 0)
        if valid_loader is not None and (last or (args.eval_interval and iteration % args.eval_interval == 0)):
            progress.start(iteration)
            valid_loss = evaluate(args, model, valid_loader, step_func, num_micro, device)
            progress.stop()
            history.append({"iteration": iteration, "validation_lm_loss": valid_loss})
            if is_log_rank:
                print("\n".join(validation_log_lines(iteration, valid_loss)), flush=True)
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            saved_to = save_checkpoint(args.save, iteration, consumed, model, optimizer, scheduler,
                                       run.model_description)
        if last:
            break
    if args.save and (not args.save_interval or iteration % args.save_interval):
        saved_to = save_checkpoint(args.save, iteration, consumed, model, optimizer, scheduler,
                                   run.model_description)
    progress.close()
    if is_log_rank:
        other_seconds = time.perf_counter() - run_start - train_seconds
        print(run_summary(args, history, iteration - first_iteration, train_seconds, other_seconds, saved_to),
              flush=True)
    parallel_state.destroy_model_parallel()
    return history


def _run(argv):
    with same_on_every_rank():
        args = parse_args(argv)
    train(args)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    """Entry point: exit status 0, 1 for a reported error (one line on rank 0), 2 for a usage error."""
    verbose = "--verbose" in (sys.argv[1:] if argv is None else argv)
    if not verbose:
        quiet_known_warnings()
    return run_reporting_errors(_run, argv, verbose=verbose)


if __name__ == "__main__":
    sys.exit(main())
