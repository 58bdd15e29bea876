"""Pretrain a small hybrid GPT (GDN / KDA / MLA / attention layers) on megatron-core alone.

Launch with torchrun; gloo on CPU, NCCL on GPU. Flags follow Megatron-LM's names, plus ours (``--hp-*``):

    torchrun --nproc-per-node 2 examples/pretrain/pretrain_hybrid.py --context-parallel-size 2

Without ``--data-path`` the default dataset (CPython's documentation text, BPE tokenizer trained
offline, Megatron indexed format; see prepare_data.py) is built under ``out/data/pydoc`` on first use.
Parallelism: TP, SP, CP (our mixers' CP methods), PP (megatron-core's schedules, also on gloo). Model:
megatron-core ``GPTModel`` with ``hp_megatron.specs.get_hybrid_layer_spec(--hp-layer-pattern)``. Data:
megatron-core ``GPTDataset``. Gradients: megatron-core DDP over the data-parallel x CP group. Optimizer:
megatron-core's on GPU; on CPU (its grad scaler allocates CUDA) torch's AdamW over DDP's main grads,
with megatron's gradient-norm clipping semantics. Checkpoints: ``dist_checkpointing`` (model, optimizer,
scheduler, iteration, consumed samples), loadable under any other TP/CP/PP layout.
"""
from __future__ import annotations

import argparse
import math
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

from hp_megatron.arguments import add_hp_arguments, apply_hp_config  # noqa: E402
from hp_megatron.platform import apply_cpu_training_shims  # noqa: E402
from training import (BatchLoader, ProgressDisplay, TorchOptimizer, build_datasets, load_checkpoint,  # noqa: E402
                      log_line, reduce_lm_loss, save_checkpoint)

DEFAULT_DATA_DIR = os.path.join(REPO, "out", "data", "pydoc")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Pretrain a hybrid GDN/KDA/MLA GPT with megatron-core",
                                     allow_abbrev=False)
    g = parser.add_argument_group("parallelism (Megatron-LM names)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g = parser.add_argument_group("model (Megatron-LM names)")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 8/3 x hidden, multiple of 64")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--num-query-groups", type=int, default=None, help="GQA groups of the attention layers")
    g.add_argument("--seq-length", type=int, default=256)
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--bf16", action="store_true")
    g = parser.add_argument_group("training (Megatron-LM names)")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=8)
    g.add_argument("--train-iters", type=int, default=60)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=3e-4)
    g.add_argument("--lr-warmup-iters", type=int, default=5)
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="cosine")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--exit-interval", type=int, default=None, help="stop after this iteration (for resume tests)")
    g.add_argument("--no-progress", action="store_true", help="no progress display during long iterations")
    g = parser.add_argument_group("data and checkpoints (Megatron-LM names)")
    g.add_argument("--data-path", default=None, help="indexed-dataset prefix; default: build the pydoc dataset")
    g.add_argument("--tokenizer", default=None, help="tokenizer.json (default: next to the default dataset)")
    g.add_argument("--split", default="100,0,0")
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None)
    add_hp_arguments(parser)
    args = parser.parse_args(argv)
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 64 * math.ceil(8 * args.hidden_size / 3 / 64)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_iters >= args.lr_decay_iters:
        parser.error(f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than --lr-decay-iters "
                     f"(default --train-iters) {args.lr_decay_iters}")
    if args.hp_layer_pattern is None:
        args.hp_layer_pattern = "KKKM"
    return args


def initialize(args):
    """Process group, megatron parallel state, seeds. Returns the device."""
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if on_gpu else "gloo")
    if not on_gpu:
        apply_cpu_training_shims(args.seed)
    from megatron.core import parallel_state, tensor_parallel

    world = dist.get_world_size()
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    if world % model_parallel:
        raise ValueError(f"world size {world} is not divisible by TP x PP x CP = {model_parallel}")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size)
    args.data_parallel_size = parallel_state.get_data_parallel_world_size()
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        raise ValueError(f"global batch size {args.global_batch_size} is not divisible by micro batch size x "
                         f"data-parallel size = {per_step}")
    if on_gpu:
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")


def build_config(args, vocab_size):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float32
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
    apply_hp_config(config, args)
    return config


def build_model(args, config, vocab_size):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel

    from hp_megatron.specs import get_hybrid_layer_spec

    import megatron.core.transformer.transformer_block as transformer_block
    from layers.norm import RMSNorm

    # The block's final norm for a layer-spec is megatron's module-level LayerNormImpl (TE, apex or
    # WrappedTorchNorm, which refuses sequence parallelism); use our RMSNorm, as every layer does.
    transformer_block.LayerNormImpl = RMSNorm
    spec = get_hybrid_layer_spec(args.hp_layer_pattern, backend=args.hp_backend, linear=args.hp_linear,
                                 cp_layout=args.hp_cp_layout)
    uses_rope = "A" in args.hp_layer_pattern
    if uses_rope and args.context_parallel_size > 1 and args.hp_cp_layout != "zigzag":
        raise ValueError("attention layers ('A') use megatron's rotary embedding, which assumes the zigzag CP "
                         f"layout; got --hp-cp-layout {args.hp_cp_layout}")
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=vocab_size, max_sequence_length=args.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope" if uses_rope else "none", rotary_base=args.rotary_base)
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
        wd_incr_style="constant")


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
    if args.data_path is not None:
        if args.tokenizer is None:
            raise ValueError("--data-path needs --tokenizer (a tokenizers JSON file)")
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


def train(args):
    """Run the training loop; returns a list of per-iteration dicts (on every rank: loss, grad norm)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from prepare_data import BPETokenizer

    device = initialize(args)
    prepare_default_data(args)
    tokenizer = BPETokenizer(args.tokenizer)
    vocab_size = pad_vocab(tokenizer.vocab_size, args.tensor_model_parallel_size)
    config = build_config(args, vocab_size)
    model = build_model(args, config, vocab_size)
    optimizer = build_optimizer(args, model)
    scheduler = build_scheduler(args, optimizer)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync

    iteration, consumed = 0, 0
    if args.load:
        iteration, consumed = load_checkpoint(args.load, model, optimizer, scheduler)
    dataset = build_datasets(args, tokenizer)
    loader = BatchLoader(dataset, args, device)
    log_rank = dist.get_world_size() - 1
    is_log_rank = dist.get_rank() == log_rank
    num_micro = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    progress = ProgressDisplay(enabled=is_log_rank and not args.no_progress, num_microbatches=num_micro)
    if is_log_rank:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"hybrid GPT: pattern {args.hp_layer_pattern} x {args.num_layers} layers, hidden {args.hidden_size}, "
              f"vocab {vocab_size}, {n_params} parameters on this rank; TP={args.tensor_model_parallel_size} "
              f"CP={args.context_parallel_size} PP={args.pipeline_model_parallel_size} "
              f"DP={args.data_parallel_size}; backend {args.hp_backend}, CP method {args.hp_cp_method}, "
              f"layout {args.hp_cp_layout}; device {device}", flush=True)
    fwd_bwd = get_forward_backward_func()
    history = []
    model.train()
    while iteration < args.train_iters:
        start = time.perf_counter()
        progress.start(iteration + 1)
        optimizer.zero_grad()
        model.zero_grad_buffer()
        losses = fwd_bwd(forward_step_func=partial(forward_step, progress),
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
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint(args.save, iteration, consumed, model, optimizer, scheduler)
        if args.exit_interval and iteration % args.exit_interval == 0:
            break
    if args.save and (not args.save_interval or iteration % args.save_interval):
        save_checkpoint(args.save, iteration, consumed, model, optimizer, scheduler)
    progress.close()
    parallel_state.destroy_model_parallel()
    return history


def main(argv=None):
    args = parse_args(argv)
    train(args)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
