"""Batched generation through megatron-core's static inference path.

megatron-core classes that run (on CPU with :func:`hp_megatron.platform.apply_cpu_shims`, and on GPU):
``StaticInferenceContext`` (the caches: every layer keeps its KV / recurrent / latent cache in
``key_value_memory_dict[layer_number]``), ``GPTInferenceWrapper`` (``prep_model_for_inference``,
``prep_inference_input``, ``get_batch_for_context_window``, ``run_one_forward_step``: the model forward with the
context, logits gathered over TP, the context's sequence offset advanced) and ``TextGenerationController``
(``pad_input_prompt_tokens``, ``sample_from_logits``: greedy / temperature / top-k / top-p from its seeded
generator) with ``SamplingParams``.

The step loop itself is :meth:`StaticGenerator.generate`, the algorithm of the controller's
``generate_all_output_tokens_static_batch``: one prefill of every prompt's first ``min(len)`` tokens, then one
token per sequence per step (a prompt longer than the shortest feeds its own next token until it starts
generating). The controller's loop cannot run without CUDA (it times steps with ``torch.cuda.Event`` and calls
``.cuda()`` on a counter), so it is not used on any device: one loop, the same on CPU and GPU.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class GenerationResult:
    """New tokens per prompt (``tokens[i]``: at most ``max_new_tokens``, cut after a stop token), the
    log-probability of each under the model's raw logits (fp32, before temperature / top-k / top-p), and the
    timing: ``prefill_tokens`` (batch x shortest prompt) in ``prefill_seconds`` (the first forward), every later
    step's ``decode_tokens`` (batch x steps) in ``decode_seconds``."""

    tokens: list
    log_probs: list
    prefill_tokens: int
    prefill_seconds: float
    decode_tokens: int
    decode_seconds: float

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / max(self.prefill_seconds, 1e-9)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / max(self.decode_seconds, 1e-9)


def sampling_params(*, max_new_tokens: int, temperature: float = 1.0, top_k: int = 1, top_p: float = 0.0):
    """megatron-core ``SamplingParams`` (``top_k=1``: greedy; ``top_k=0, top_p=0``: the full distribution);
    ValueError for values megatron-core's sampler would assert on."""
    from megatron.core.inference.sampling_params import SamplingParams

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (1: greedy, 0: no top-k), got {top_k}")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"top_p must be in [0, 1] (0: no top-p), got {top_p}")
    if top_k > 1 and top_p > 0.0:
        raise ValueError(f"top_k={top_k} and top_p={top_p}: megatron-core samples with one of them, not both")
    return SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                          num_tokens_to_generate=int(max_new_tokens))


def check_batch(prompts, max_new_tokens: int, *, vocab_size: int, max_positions: int, max_batch_size: int,
                max_sequence_length: int) -> None:
    """ValueError naming the constraint and the values when a batch cannot be generated: no prompts, more
    prompts than the cache holds (``max_batch_size``), an empty prompt, a token id outside the vocabulary, or a
    prompt plus ``max_new_tokens`` longer than the model's positions or the cache (``max_sequence_length``)."""
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    if len(prompts) > max_batch_size:
        raise ValueError(f"{len(prompts)} prompts exceed the cache's batch size {max_batch_size} "
                         "(--inference-max-requests)")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty (0 tokens); every prompt needs at least one token")
        bad = [int(t) for t in prompt if not 0 <= int(t) < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    longest = max(len(p) for p in prompts)
    total = longest + max_new_tokens
    for limit, what in ((max_positions, "the model's positions (max_position_embeddings)"),
                        (max_sequence_length, "the cache's length (--inference-max-seq-length)")):
        if total > limit:
            raise ValueError(f"longest prompt {longest} + max_new_tokens {max_new_tokens} = {total} tokens "
                             f"exceeds {what} {limit}")


class _PadTokenizer:
    """What the controller reads of a tokenizer for padding and sampling: ``eod`` (the pad id)."""

    def __init__(self, eod: int):
        self.eod = eod


class StaticGenerator:
    """Generation for a ``GPTModel`` (this rank's TP shard, PP=1) on megatron-core's static inference context.

    ``max_batch_size`` / ``max_sequence_length``: the cache sizes (Megatron-LM's ``--inference-max-requests`` /
    ``--inference-max-seq-length``); ``max_positions``: the model's positions (``max_position_embeddings``);
    ``vocab_size``: the real vocabulary (sampling never returns the padded tail); ``pad_id``: the id filling the
    prompt tensor past each prompt. Every TP rank must call :meth:`generate` with the same arguments."""

    def __init__(self, model, *, vocab_size: int, max_positions: int, max_batch_size: int = 8,
                 max_sequence_length: int = 2560, pad_id: int = 0):
        from megatron.core import parallel_state

        if parallel_state.get_pipeline_model_parallel_world_size() != 1:
            raise ValueError("generation runs at pipeline-parallel size 1, got "
                             f"{parallel_state.get_pipeline_model_parallel_world_size()}")
        if max_batch_size < 1 or max_sequence_length < 2:
            raise ValueError(f"cache sizes must be positive: max_batch_size={max_batch_size}, "
                             f"max_sequence_length={max_sequence_length}")
        self.model = model
        self.vocab_size = int(vocab_size)
        self.max_positions = int(max_positions)
        self.max_batch_size = int(max_batch_size)
        self.max_sequence_length = int(max_sequence_length)
        self.pad_id = int(pad_id)
        self.context = None  # the StaticInferenceContext of the last generate() (its caches)

    def generate(self, prompts, params, *, seed: int = 0, stop_id: int | None = None,
                 clock=time.perf_counter) -> GenerationResult:
        """Generate ``params.num_tokens_to_generate`` tokens after each prompt (lists of token ids, different
        lengths allowed), sampling with ``params`` (:func:`sampling_params`) from a generator seeded with
        ``seed``; a sequence stops after ``stop_id`` (the loop stops when all have). Every check runs before the
        first forward. ``clock``: the timer of the timings (wall clock; ``time.process_time`` gives this
        process's CPU seconds, the fairer measure on a shared machine)."""
        from megatron.core.inference.contexts import StaticInferenceContext
        from megatron.core.inference.text_generation_controllers.text_generation_controller import (
            TextGenerationController)

        from layers.base.megatron_compat import gpt_inference_wrapper, inference_mode

        new = params.num_tokens_to_generate
        check_batch(prompts, new, vocab_size=self.vocab_size, max_positions=self.max_positions,
                    max_batch_size=self.max_batch_size, max_sequence_length=self.max_sequence_length)
        context = self.context = StaticInferenceContext(self.max_batch_size, self.max_sequence_length)
        wrapper = gpt_inference_wrapper(self.model, context, max_batch_size=self.max_batch_size,
                                        max_sequence_length=self.max_sequence_length)
        controller = TextGenerationController(wrapper, _PadTokenizer(self.pad_id))
        controller.sampling_rng.manual_seed(seed)

        batch = len(prompts)
        lengths = torch.tensor([len(p) for p in prompts])
        first, longest = int(lengths.min()), int(lengths.max())
        total = longest + new
        tokens = controller.pad_input_prompt_tokens([[int(t) for t in p] for p in prompts], batch, total)
        device = tokens.device
        lengths_dev = lengths.to(device)
        out_tokens = torch.full((batch, new), self.pad_id, dtype=torch.long, device=device)
        out_log_probs = torch.zeros(batch, new, dtype=torch.float32, device=device)
        rows = torch.arange(batch, device=device)
        stopped = torch.zeros(batch, dtype=torch.bool, device=device)
        seconds = []
        with torch.inference_mode(), inference_mode():
            wrapper.prep_model_for_inference()  # eval(), context reset
            inputs = wrapper.prep_inference_input(tokens)
            start, end = 0, first
            while end < total:
                window = wrapper.get_batch_for_context_window(inputs, start, end)
                began = clock()
                logits = wrapper.run_one_forward_step(window)[:, -1, :self.vocab_size]
                sampled = controller.sample_from_logits(logits, params, self.vocab_size)
                _synchronize()
                seconds.append(clock() - began)
                started = lengths_dev <= end          # sequences whose prompt is consumed: `end` is a new token
                tokens[:, end] = torch.where(started, sampled, tokens[:, end])
                step = (end - lengths_dev).clamp(0, new - 1)
                keep = started & (end - lengths_dev < new) & ~stopped
                log_probs = torch.log_softmax(logits.float(), dim=-1).gather(1, sampled[:, None])[:, 0]
                out_tokens[rows[keep], step[keep]] = sampled[keep]
                out_log_probs[rows[keep], step[keep]] = log_probs[keep]
                if stop_id is not None:
                    stopped |= keep & (sampled == stop_id)
                start, end = end, end + 1
                if end > longest:  # every prompt is consumed
                    context.enable_decode_mode()
                    if stop_id is not None and bool(stopped.all()):
                        break
        counts = _kept_lengths(out_tokens, stop_id)
        tokens_list = [out_tokens[i, :counts[i]].tolist() for i in range(batch)]
        log_probs_list = [out_log_probs[i, :counts[i]].tolist() for i in range(batch)]
        return GenerationResult(tokens_list, log_probs_list, prefill_tokens=batch * first, prefill_seconds=seconds[0],
                                decode_tokens=batch * (len(seconds) - 1), decode_seconds=sum(seconds[1:]))


def _kept_lengths(out_tokens, stop_id) -> list:
    """New tokens kept per sequence: all, or up to and including the first ``stop_id``."""
    new = out_tokens.shape[1]
    if stop_id is None:
        return [new] * out_tokens.shape[0]
    hits = out_tokens == stop_id
    return torch.where(hits.any(1), hits.int().argmax(1) + 1, new).tolist()


def _synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()
