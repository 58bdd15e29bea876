"""Training pieces of the example that megatron-core leaves to Megatron-LM: data order, the CPU optimizer,
checkpoints, logging. Kept apart from pretrain_hybrid.py so each part stays small."""
from __future__ import annotations

import math
import os
import sys
import threading
import time
from itertools import chain

import torch
import torch.distributed as dist

from hp_megatron.data import get_batch_on_this_cp_rank

# ----------------------------------------------------------------------------------------------- data
def dataset_sizes(args):
    """Samples of the train / validation / test splits: ``train_iters x GBS`` and, with evaluation,
    ``eval_iters x GBS`` (every evaluation reads the same first validation batches)."""
    valid = args.eval_iters * args.global_batch_size if args.eval_interval else 0
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
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, dataset_sizes(args), lambda: True, config).build()
    if train is None:
        raise ValueError(f"no training split in {args.data_path} with --split {args.split}")
    if args.eval_interval and valid is None:
        raise ValueError(f"no validation split in {args.data_path} with --split {args.split}")
    return train, valid


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

    With ``--reset-attention-mask`` each micro-batch is packed into one THD row (``packing.py``) and
    carries its ``packed_seq_params``; the CP share is ``hp_megatron.data.get_batch_on_this_cp_rank``'s."""

    def __init__(self, dataset, args, device, pad_id):
        from megatron.core import parallel_state

        from packing import document_multiple

        self.dataset, self.device, self.pad_id = dataset, device, pad_id
        self.mbs, self.gbs = args.micro_batch_size, args.global_batch_size
        self.dp = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.layout = args.hp_cp_layout
        self.packed = args.reset_attention_mask
        self.multiple = document_multiple(args.context_parallel_size, args.hp_cp_layout,
                                          args.tensor_model_parallel_size, args.sequence_parallel)

    def _micro_batch(self, first):
        from packing import PACKED_KEYS, pack_documents

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
        batch = get_batch_on_this_cp_rank(batch, params, layout=self.layout)
        batch["packed_seq_params"] = params
        return batch

    def global_batch(self, consumed_samples):
        num_micro = self.gbs // (self.mbs * self.dp)
        for m in range(num_micro):
            yield self._micro_batch(consumed_samples + (m * self.dp + self.dp_rank) * self.mbs)


# ------------------------------------------------------------------------------------------ optimizer
class TorchOptimizer:
    """``torch.optim.AdamW`` over megatron DDP's ``main_grad`` buffers with megatron's optimizer interface
    (``step() -> (ok, grad_norm, None)``, ``param_groups``, ``sharded_state_dict``), for CPU runs.

    Gradient norm: L2 over parameters that are not tensor-parallel duplicates, summed over the
    model-parallel group (TP x PP); clipping scales all gradients by ``clip / (norm + 1e-6)`` when < 1.
    """

    def __init__(self, model_chunks, lr, weight_decay, betas, eps, clip_grad):
        decay, no_decay = [], []
        for chunk in model_chunks:
            for name, param in chunk.named_parameters():
                if param.requires_grad:
                    (no_decay if param.dim() == 1 or name.endswith(".bias") else decay).append(param)
        groups = [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
        self.clip_grad = clip_grad

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def _params(self):
        return list(chain.from_iterable(g["params"] for g in self.optimizer.param_groups))

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def grad_norm(self):
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        grads = [p.grad for p in self._params() if p.grad is not None and param_is_not_shared(p)
                 and param_is_not_tensor_parallel_duplicate(p)]
        total = torch.zeros((), dtype=torch.float64)
        for g in grads:
            total += g.detach().double().pow(2).sum().cpu()
        dist.all_reduce(total, group=parallel_state.get_model_parallel_group())
        return float(total.sqrt())

    def step(self):
        for p in self._params():
            p.grad = p.main_grad.to(p.dtype) if getattr(p, "main_grad", None) is not None else p.grad
        norm = self.grad_norm()
        if not torch.isfinite(torch.tensor(norm)):
            return False, norm, None
        if self.clip_grad and self.clip_grad > 0:
            coef = self.clip_grad / (norm + 1e-6)
            if coef < 1.0:
                for p in self._params():
                    if p.grad is not None:
                        p.grad.mul_(coef)
        self.optimizer.step()
        return True, norm, None

    def sharded_state_dict(self, model_sharded_state_dict, is_loading=False):
        from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                                optim_state_to_sharding_state)

        if is_loading:  # materialize Adam state so the template has every tensor to load into
            for p in self._params():
                state = self.optimizer.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state = self.optimizer.state_dict()
        steps = {float(s["step"]) for s in state["state"].values() if "step" in s}
        if len(steps) > 1:
            raise ValueError(f"parameters have different Adam step counts {sorted(steps)}")
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, self._params())
        optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
        state["common_step"] = steps.pop() if steps else 0.0
        return state

    def load_state_dict(self, state):
        step = state.pop("common_step")
        for param_state in state["state"].values():
            param_state["step"] = torch.tensor(float(step))
        self.optimizer.load_state_dict(state)


# -------------------------------------------------------------------------------------------- logging
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


def log_line(iteration, train_iters, consumed, elapsed_s, lr, gbs, lm_loss, grad_norm, tokens_per_s):
    return (f" iteration {iteration:8d}/{train_iters:8d} | consumed samples: {consumed:12d} | "
            f"elapsed time per iteration (ms): {elapsed_s * 1000:.1f} | learning rate: {lr:.6E} | "
            f"global batch size: {gbs:5d} | lm loss: {lm_loss:.6E} | grad norm: {grad_norm:.3f} | "
            f"tokens/s: {tokens_per_s:.0f} |")


def validation_log_lines(iteration, lm_loss):
    """Megatron-LM's evaluation report: the line between two rules of dashes."""
    line = (f" validation loss at iteration {iteration} | lm loss value: {lm_loss:.6E} | "
            f"lm loss PPL: {math.exp(min(20.0, lm_loss)):.6E} | ")
    rule = "-" * (len(line) + 1)
    return [rule, line, rule]


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
