"""Pretrain a small hybrid GPT (GDN / KDA / MLA / attention layers) on megatron-core alone.

Launch with torchrun; gloo on CPU, NCCL on GPU. Flags follow Megatron-LM's names, plus ours (``--hp-*``):

    torchrun --nproc-per-node 2 examples/pretrain/pretrain_hybrid.py --context-parallel-size 2

Without ``--data-path`` the default dataset (CPython's documentation text, BPE tokenizer trained
offline, Megatron indexed format; see prepare_data.py) is built under ``out/data/pydoc`` on first use.
Parallelism: TP, SP, CP (our mixers' CP methods), PP (megatron-core's schedules, also on gloo). Model:
megatron-core ``GPTModel`` with ``hp_megatron.specs.get_hybrid_layer_spec(--hp-layer-pattern)``, or with
``--hp-hf-config HF_DIR`` the preset's model of a Qwen3-Next / Kimi Linear / DeepSeek-V3 config.json (start it from
``python -m hp_megatron.convert hf-to-mcore`` output with ``--load``; docs/models.md). Data:
megatron-core ``GPTDataset``. Gradients: megatron-core DDP over the data-parallel x CP group. Optimizer:
megatron-core's on GPU; on CPU (its grad scaler allocates CUDA) torch's AdamW over DDP's main grads,
with megatron's gradient-norm clipping semantics. Checkpoints: ``dist_checkpointing`` (model, optimizer,
scheduler, iteration, consumed samples), loadable under any other TP/CP/PP layout.
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

from checkpointing import TRACKER, find_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from cli import parse_args, quiet_known_warnings, run_reporting_errors, same_on_every_rank  # noqa: E402,F401 (parse_args: API)
from hp_megatron.arguments import apply_hp_config  # noqa: E402
from hp_megatron.cp_subgroups import register_cp_subgroups_from_args  # noqa: E402
from hp_megatron.platform import apply_cpu_training_shims  # noqa: E402
from training import (BatchLoader, ProgressDisplay, TorchOptimizer, build_datasets, describe_data,  # noqa: E402
                      log_line, reduce_lm_loss, validation_log_lines)

DEFAULT_DATA_DIR = os.path.join(REPO, "out", "data", "pydoc")


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
        context_parallel_size=args.context_parallel_size)
    args.data_parallel_size = parallel_state.get_data_parallel_world_size()
    register_cp_subgroups_from_args(args)   # every rank, here: CP groups smaller than the world need it
    if on_gpu:
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")


def build_config(args, vocab_size):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    if args.hp_preset is not None:  # --hp-hf-config: the architecture's fields, this run's parallelism and dtype
        config = args.hp_preset.transformer_config(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            context_parallel_size=args.context_parallel_size, sequence_parallel=args.sequence_parallel,
            init_method_std=args.init_method_std, use_cpu_initialization=True, params_dtype=dtype,
            pipeline_dtype=dtype, bf16=args.bf16, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
            masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
            variable_seq_lengths=False)
        return apply_hp_config(config, args)
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size, sequence_parallel=args.sequence_parallel,
        normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=args.init_method_std,
        use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype, bf16=args.bf16,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, variable_seq_lengths=False)
    return apply_hp_config(config, args)


def build_model(args, config, vocab_size):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from hp_megatron.specs import get_hybrid_layer_spec

    import megatron.core.transformer.transformer_block as transformer_block
    from layers.norm import RMSNorm

    if args.hp_preset is not None:  # exactly the model the conversion rules of --hp-hf-config target
        model = args.hp_preset.gpt_model(
            config, args.hp_backend, max_sequence_length=args.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
            linear=args.hp_linear, cp_layout=args.hp_cp_layout)
        return wrap_model(config, model)
    # The block's final norm for a layer-spec is megatron's module-level LayerNormImpl (TE, apex or
    # WrappedTorchNorm, which refuses sequence parallelism); use our RMSNorm, as every layer does.
    transformer_block.LayerNormImpl = RMSNorm
    spec = get_hybrid_layer_spec(args.hp_layer_pattern, backend=args.hp_backend, linear=args.hp_linear,
                                 cp_layout=args.hp_cp_layout)
    uses_rope = "A" in args.hp_layer_pattern  # zigzag with CP: checked by validate_hp_args
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=vocab_size, max_sequence_length=args.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope" if uses_rope else "none", rotary_base=args.rotary_base)
    return wrap_model(config, model)


def wrap_model(config, model):
    """megatron-core DDP around ``model`` (moved to the GPU when there is one)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def build_optimizer(args, model):
    """megatron-core's optimizer on GPU; ``TorchOptimizer`` (same clipping/norm semantics) on CPU."""
    if torch.cuda.is_available():
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        opt_config = OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr,
                                     weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
                                     adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
                                     bf16=args.bf16, params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
                                     use_distributed_optimizer=False)
        return get_megatron_optimizer(opt_config, [model])
    return TorchOptimizer([model], lr=args.lr, weight_decay=args.weight_decay,
                          betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, clip_grad=args.clip_grad)


def build_scheduler(args, optimizer):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gbs = args.global_batch_size
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant", use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=args.override_opt_param_scheduler)


def loss_func(loss_mask, output_tensor):
    """Megatron's 3-tuple loss: (sum of token losses, token count, {"lm loss": [sum, count]})."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss.detach(), mask.sum()])
    return loss, num_tokens, {"lm loss": report}


def forward_step(progress, data_iterator, model):
    batch = next(data_iterator)
    progress.microbatch_started()
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   packed_seq_params=batch.get("packed_seq_params"))
    return output, partial(loss_func, batch["loss_mask"])


def prepare_default_data(args):
    if args.data_path is not None:  # checked at parse time
        return
    from prepare_data import DATA_NAME, build, default_data_ready

    if dist.get_rank() == 0 and not default_data_ready(DEFAULT_DATA_DIR):
        print(f"building the default dataset in {DEFAULT_DATA_DIR} ...", flush=True)
        build(DEFAULT_DATA_DIR)
    dist.barrier()
    args.data_path = os.path.join(DEFAULT_DATA_DIR, DATA_NAME)
    args.tokenizer = os.path.join(DEFAULT_DATA_DIR, "tokenizer.json")


def pad_vocab(vocab_size, tp, multiple=128):
    step = multiple * tp
    return ((vocab_size + step - 1) // step) * step


def model_vocab_size(args, tokenizer_vocab: int) -> int:
    """The embedding rows: the tokenizer's vocabulary padded to 128 x TP, or with ``--hp-hf-config`` the HF
    config's ``vocab_size`` (the converted checkpoint's rows; it must hold the tokenizer's ids and split over TP)."""
    tp = args.tensor_model_parallel_size
    if args.hp_preset is None:
        return pad_vocab(tokenizer_vocab, tp)
    vocab = args.hp_preset.gpt_model_kwargs["vocab_size"]
    if vocab < tokenizer_vocab:
        raise ValueError(f"--hp-hf-config {args.hp_hf_config} has vocab_size {vocab}, fewer than the "
                         f"{tokenizer_vocab} ids of --tokenizer {args.tokenizer}: the data must use the model's tokenizer")
    if vocab % tp:
        raise ValueError(f"--hp-hf-config {args.hp_hf_config}: vocab_size {vocab} is not divisible by "
                         f"--tensor-model-parallel-size {tp}")
    return vocab


def describe_model(args, vocab_size, n_params, device) -> str:
    """The header: layer layout, sizes, parallel layout and, for the layers present, backend and CP methods."""
    pattern = args.hp_layer_pattern
    layout = "".join(pattern[i % len(pattern)] for i in range(args.num_layers))
    source = f"{args.hp_preset.model_type} from {args.hp_hf_config}, " if args.hp_preset is not None else ""
    parts = [f"hybrid GPT: {source}{args.num_layers} layers {layout} (pattern {pattern}), hidden {args.hidden_size}, "
             f"vocab {vocab_size}, {n_params} parameters on this rank",
             f"TP={args.tensor_model_parallel_size} CP={args.context_parallel_size} "
             f"PP={args.pipeline_model_parallel_size} DP={args.data_parallel_size}"
             f"{' SP' if args.sequence_parallel else ''}"]
    cp = args.context_parallel_size
    if set(pattern) & {"G", "K"}:
        text = f"GDN/KDA: backend {args.hp_backend}"
        if cp > 1 and args.hp_cp_method == "auto":
            text += ", CP method auto (method, group size and Ulysses degree chosen per layer shape at the first step)"
        elif cp > 1:
            ulysses = cp if args.hp_cp_method == "ulysses" else (args.hp_ulysses_degree or 1)
            text += f", CP method {args.hp_cp_method}, Ulysses degree {ulysses}"
            if args.hp_cp_group_size:
                text += f", group size {args.hp_cp_group_size}"
        parts.append(text)
    if "M" in pattern and cp > 1:
        parts.append(f"MLA CP {args.hp_mla_cp}")
    if cp > 1:
        parts.append(f"layout {args.hp_cp_layout}")
    parts.append(f"device {device}")
    return "; ".join(parts)


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


def setup(args):
    """Everything before the first iteration, built from the flags alone (so any error is the same on every
    rank): process groups, data files, tokenizer, model, optimizer, scheduler, the checkpoint to resume.
    Returns a namespace with those and ``iteration`` / ``consumed`` (0 without a checkpoint)."""
    from types import SimpleNamespace

    from megatron.core.distributed import finalize_model_grads

    from prepare_data import BPETokenizer

    device = initialize(args)
    prepare_default_data(args)
    tokenizer = BPETokenizer(args.tokenizer)
    vocab_size = model_vocab_size(args, tokenizer.vocab_size)
    config = build_config(args, vocab_size)
    model = build_model(args, config, vocab_size)
    optimizer = build_optimizer(args, model)
    scheduler = build_scheduler(args, optimizer)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    run = SimpleNamespace(device=device, tokenizer=tokenizer, vocab_size=vocab_size, config=config, model=model,
                          optimizer=optimizer, scheduler=scheduler, iteration=0, consumed=0)
    if args.load:
        found = find_checkpoint(args.load)
        if found is None:
            if dist.get_rank() == 0:
                print(f"no checkpoint in {args.load} (no {TRACKER}); training from scratch", flush=True)
        else:
            run.iteration, run.consumed = load_checkpoint(
                found, model, optimizer, scheduler, warn_schedule=not args.use_checkpoint_opt_param_scheduler)
    return run


def train(args):
    """Run the training loop; returns a list of per-iteration dicts (on every rank: loss, grad norm, lr)
    and, after evaluations, ``{"iteration", "validation_lm_loss"}`` entries."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

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
    loader = BatchLoader(train_data, args, device, tokenizer.pad)
    valid_loader = BatchLoader(valid_data, args, device, tokenizer.pad) if valid_data is not None else None
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
    history, saved_to = [], None
    first_iteration, run_start = iteration, time.perf_counter()
    model.train()
    while iteration < args.train_iters:
        start = time.perf_counter()
        progress.start(iteration + 1)
        optimizer.zero_grad()
        model.zero_grad_buffer()
        losses = fwd_bwd(forward_step_func=step_func,
                         data_iterator=loader.global_batch(consumed), model=model, num_microbatches=num_micro,
                         seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                         decoder_seq_length=args.seq_length, forward_only=False)
        update_ok, grad_norm, _ = optimizer.step()
        if not update_ok:
            raise RuntimeError(f"optimizer step failed at iteration {iteration + 1} (non-finite gradients?)")
        scheduler.step(increment=args.global_batch_size)
        progress.stop()
        iteration += 1
        consumed += args.global_batch_size
        lm_loss = reduce_lm_loss(losses, device)
        elapsed = time.perf_counter() - start
        lr = optimizer.param_groups[0]["lr"]
        history.append({"iteration": iteration, "lm_loss": lm_loss, "grad_norm": float(grad_norm), "lr": lr})
        if is_log_rank and iteration % args.log_interval == 0:
            tokens = args.global_batch_size * args.seq_length
            print(log_line(iteration, args.train_iters, consumed, elapsed, lr, args.global_batch_size,
                           lm_loss, grad_norm, tokens / elapsed), flush=True)
        last = iteration == args.train_iters or bool(args.exit_interval and iteration % args.exit_interval == 0)
        if valid_loader is not None and (last or (args.eval_interval and iteration % args.eval_interval == 0)):
            progress.start(iteration)
            valid_loss = evaluate(args, model, valid_loader, step_func, num_micro, device)
            progress.stop()
            history.append({"iteration": iteration, "validation_lm_loss": valid_loss})
            if is_log_rank:
                print("\n".join(validation_log_lines(iteration, valid_loss)), flush=True)
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            saved_to = save_checkpoint(args.save, iteration, consumed, model, optimizer, scheduler)
        if last:
            break
    if args.save and (not args.save_interval or iteration % args.save_interval):
        saved_to = save_checkpoint(args.save, iteration, consumed, model, optimizer, scheduler)
    progress.close()
    if is_log_rank:
        print(run_summary(args, history, iteration - first_iteration, time.perf_counter() - run_start, saved_to),
              flush=True)
    parallel_state.destroy_model_parallel()
    return history


def run_summary(args, history, iterations_run, seconds, saved_to) -> str:
    """The end-of-run line: iterations, time, tokens/s, final training (and validation) loss, checkpoint."""
    train_losses = [h["lm_loss"] for h in history if "lm_loss" in h]
    valid_losses = [h["validation_lm_loss"] for h in history if "validation_lm_loss" in h]
    tokens = iterations_run * args.global_batch_size * args.seq_length
    text = (f"done: {iterations_run} iterations in {seconds:.1f} s ({tokens / max(seconds, 1e-9):.0f} tokens/s), "
            f"final lm loss {train_losses[-1]:.4f}")
    if valid_losses:
        text += f", validation lm loss {valid_losses[-1]:.4f}"
    text += f"; checkpoint {saved_to}" if saved_to else "; no checkpoint written (pass --save DIR to write one)"
    return text


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
