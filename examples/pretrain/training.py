"""What the example's loop needs that megatron-core leaves to Megatron-LM's ``megatron/training``: the sample order
of the data-parallel ranks, the LR schedule, and what the loop prints (header, iteration and validation lines,
progress, the closing summary). Kept apart from pretrain_hybrid.py, which reads like Megatron-LM's pretrain_gpt.py.
The library parts (packing, the model builder, the optimizer) are in ``hp_megatron.training``."""
from __future__ import annotations

import math
import sys
import threading
import time

import torch
import torch.distributed as dist

from hp_megatron.data import get_batch_on_this_cp_rank
from hp_megatron.training.packing import PACKED_KEYS, document_multiple, pack_documents

# ----------------------------------------------------------------------------------------------- data
def describe_data(args, tokenizer, dataset) -> str:
    """One line: which data, how much of it, which tokenizer."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    indexed = IndexedDataset(args.data_path)
    return (f"data: {args.data_path} ({len(indexed)} documents, {int(indexed.sequence_lengths.sum())} tokens), "
            f"--split {args.split}, {len(dataset)} training samples of {args.seq_length} tokens"
            f"{', packed per document (THD)' if args.reset_attention_mask else ''}; tokenizer {args.tokenizer} "
            f"(vocab {tokenizer.vocab_size})")


class BatchLoader:
    """Megatron's pretraining sample order: global batch g holds samples [g*GBS, (g+1)*GBS); micro-batch m
    of data-parallel rank d reads samples ``g*GBS + (m*DP + d)*MBS + [0, MBS)``. The position is just the
    consumed-sample count, so a resumed run continues with the very next sample.

    With ``--reset-attention-mask`` each micro-batch is packed into one THD row
    (``hp_megatron.training.packing``) and carries its ``packed_seq_params``; the CP share is
    ``hp_megatron.data.get_batch_on_this_cp_rank``'s."""

    def __init__(self, dataset, args, device, pad_id, model_config=None):
        from megatron.core import parallel_state

        self.dataset, self.device, self.pad_id = dataset, device, pad_id
        self.model_config = model_config   # the model's config: the CP layout its layers were built for
        self.mbs, self.gbs = args.micro_batch_size, args.global_batch_size
        self.dp = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.layout = args.hp_cp_layout
        self.packed = args.reset_attention_mask
        self.multiple = document_multiple(args.context_parallel_size, args.hp_cp_layout,
                                          args.tensor_model_parallel_size, args.sequence_parallel)

    def _micro_batch(self, first):
        samples = [self.dataset[first + i] for i in range(self.mbs)]
        batch = {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in PACKED_KEYS}
        batch["tokens"] = batch["tokens"].long()
        batch["labels"] = batch["labels"].long()
        params = None
        if self.packed:
            batch, params = pack_documents(batch, self.pad_id, self.multiple)
        batch = {key: value.to(self.device) for key, value in batch.items()}
        if params is not None:
            for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
                setattr(params, name, getattr(params, name).to(self.device))
        batch = get_batch_on_this_cp_rank(batch, params, layout=self.layout, config=self.model_config)
        batch["packed_seq_params"] = params
        return batch

    def global_batch(self, consumed_samples):
        num_micro = self.gbs // (self.mbs * self.dp)
        for m in range(num_micro):
            yield self._micro_batch(consumed_samples + (m * self.dp + self.dp_rank) * self.mbs)


# ------------------------------------------------------------------------------------------- schedule
def build_scheduler(args, optimizer):
    """megatron-core's ``OptimizerParamScheduler`` of the flags (counted in samples, as Megatron-LM does)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gbs = args.global_batch_size
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant", use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=args.override_opt_param_scheduler)


# -------------------------------------------------------------------------------------------- logging
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
    if args.num_experts is not None:
        parts.append(describe_moe(args))
    if args.mtp_num_layers:
        parts.append(f"MTP: {args.mtp_num_layers} depth(s) on the last stage, loss scaling factor "
                     f"{args.mtp_loss_scaling_factor:g}")
    cp = args.context_parallel_size
    from hp_megatron.registry import symbols_where

    from hp_megatron.cp_choice import layer_methods

    if set(pattern) & set(symbols_where(lambda e: e.family == "delta")):
        text = f"GDN/KDA: backend {args.hp_backend}"
        for method, degree, source in layer_methods(args, "delta_cp_method") if cp > 1 else ():
            if method == "auto":
                text += (", CP method auto (method, group size and Ulysses degree chosen per layer shape at the first "
                         "step)")
                continue
            ulysses = cp if method == "ulysses" else (degree or 1)
            text += f", CP method {method}, Ulysses degree {ulysses}"
            if args.hp_cp_group_size:
                text += f", group size {args.hp_cp_group_size}"
            text += f" ({source})"
        parts.append(text)
    if set(pattern) & set(symbols_where(lambda e: e.family == "mla")) and cp > 1:
        parts.append("MLA CP " + ", ".join(f"{m} ({s})" for m, _, s in layer_methods(args, "mla_cp_strategy")))
    if cp > 1:
        parts.append(f"layout {args.hp_cp_layout}")
    parts.append(f"device {device}")
    return "; ".join(parts)


def describe_moe(args) -> str:
    """The MoE part of the header: experts, routing, expert parallelism, load balancing."""
    text = (f"MoE: {args.num_experts} experts of FFN {args.moe_ffn_hidden_size}, top-{args.moe_router_topk} "
            f"{args.moe_router_score_function} router, EP={args.expert_model_parallel_size} "
            f"ETP={args.expert_tensor_parallel_size} ({args.num_experts // args.expert_model_parallel_size} experts "
            f"per rank)")
    if args.moe_aux_loss_coeff > 0 and args.moe_router_load_balancing_type != "none":
        text += f", {args.moe_router_load_balancing_type} coeff {args.moe_aux_loss_coeff:g}"
    if args.moe_router_enable_expert_bias:
        text += f", expert bias update rate {args.moe_router_bias_update_rate:g}"
    return text


def reduce_lm_loss(losses_reduced, device):
    """Mean token loss of the global batch (last pipeline stage; NaN elsewhere), as Megatron-LM reports it."""
    from megatron.core import parallel_state

    if not parallel_state.is_pipeline_last_stage():
        return float("nan")
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for item in losses_reduced:
        total += item["lm loss"].to(torch.float64)
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return float(total[0] / total[1])


def log_line(iteration, train_iters, consumed, elapsed_s, lr, gbs, lm_loss, grad_norm, tokens_per_s, extra=None):
    """Megatron-LM's iteration line; ``extra``: further ``{name: value}`` after the lm loss, as Megatron-LM adds
    the MoE load-balancing and MTP losses (``hp_megatron.training.aux_losses``)."""
    more = "".join(f" {name}: {value:.6E} |" for name, value in (extra or {}).items())
    return (f" iteration {iteration:8d}/{train_iters:8d} | consumed samples: {consumed:12d} | "
            f"elapsed time per iteration (ms): {elapsed_s * 1000:.1f} | learning rate: {lr:.6E} | "
            f"global batch size: {gbs:5d} | lm loss: {lm_loss:.6E} |{more} grad norm: {grad_norm:.3f} | "
            f"tokens/s: {tokens_per_s:.0f} |")


def validation_log_lines(iteration, lm_loss):
    """Megatron-LM's evaluation report: the line between two rules of dashes."""
    line = (f" validation loss at iteration {iteration} | lm loss value: {lm_loss:.6E} | "
            f"lm loss PPL: {math.exp(min(20.0, lm_loss)):.6E} | ")
    rule = "-" * (len(line) + 1)
    return [rule, line, rule]


def run_summary(args, history, iterations_run, train_seconds, other_seconds, saved_to) -> str:
    """The end-of-run line. Throughput as Megatron-LM reports it: tokens over the time spent in the training
    iterations (``train_seconds``: forward, backward and optimizer steps, the sum of the logged per-iteration
    times), not start-up, evaluation and checkpoint saves (``other_seconds``, stated apart)."""
    train_losses = [h["lm_loss"] for h in history if "lm_loss" in h]
    valid_losses = [h["validation_lm_loss"] for h in history if "validation_lm_loss" in h]
    tokens = iterations_run * args.global_batch_size * args.seq_length
    text = (f"done: {iterations_run} iterations in {train_seconds:.1f} s of forward, backward and optimizer steps "
            f"({tokens / max(train_seconds, 1e-9):.0f} tokens/s), final lm loss {train_losses[-1]:.4f}")
    if valid_losses:
        text += f", validation lm loss {valid_losses[-1]:.4f}"
    text += f"; start-up, evaluation and checkpoints {other_seconds:.1f} s more"
    text += f"; checkpoint {saved_to}" if saved_to else "; no checkpoint written (pass --save DIR to write one)"
    return text


class ProgressDisplay:
    """While an iteration runs longer than ``after_s``, redraw one stderr line every ``every_s`` seconds:
    ``iteration N: micro-batch k/M, T s``."""

    def __init__(self, enabled, num_microbatches, after_s=3.0, every_s=1.0):
        self.enabled, self.num_micro, self.after_s, self.every_s = enabled, num_microbatches, after_s, every_s
        self._lock = threading.Lock()
        self._iteration, self._micro, self._start, self._shown = None, 0, 0.0, False
        self._stop = threading.Event()
        if enabled:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def start(self, iteration):
        with self._lock:
            self._iteration, self._micro, self._start = iteration, 0, time.perf_counter()

    def microbatch_started(self):
        with self._lock:
            self._micro += 1

    def stop(self):
        with self._lock:
            self._iteration = None
            if self._shown:
                sys.stderr.write("\r\033[K" if sys.stderr.isatty() else "")
                sys.stderr.flush()
                self._shown = False

    def close(self):
        self._stop.set()

    def _run(self):
        while not self._stop.wait(self.every_s):
            with self._lock:
                if self._iteration is None:
                    continue
                spent = time.perf_counter() - self._start
                if spent < self.after_s:
                    continue
                text = (f"  iteration {self._iteration}: micro-batch {min(self._micro, self.num_micro)}"
                        f"/{self.num_micro}, {spent:.0f} s")
                if sys.stderr.isatty():
                    sys.stderr.write("\r\033[K" + text)
                else:
                    sys.stderr.write(text + "\n")
                sys.stderr.flush()
                self._shown = True
