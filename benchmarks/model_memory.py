"""Capacity table: activation bytes per token of the real presets, and the longest sequence per GPU that fits.

Measured, not modelled: every distinct layer kind of a preset (mixer symbol x dense/MoE MLP) is built as a
one-layer megatron-core ``TransformerBlock`` of our ``PatternLayer`` at the preset's real shapes (bf16, TP = CP = 1,
CPU, ``--backend`` mixers, default eager) and one forward is measured with ``benchmarks/layer_memory.py``'s
:func:`~benchmarks.layer_memory.saved_bytes` (saved-tensor hooks, unique storages, parameters excluded, the
layer's input included). The whole layer is measured: input norm, mixer, residual, pre-MLP norm and the MLP or
megatron-core ``MoELayer`` (router, allgather dispatcher, SequentialMLP experts, shared expert).

Per token: saved bytes are ``fixed + per_token * T + per_token_squared * T**2``; each kind is measured at three
lengths (``--T``, default 64, 128, 192: multiples of the delta rules' chunk of 64, whose padding would otherwise
bend the line) and the parabola through them separates the parts. ``fixed``: per-sequence state. ``T**2``: only
our eager core attention has one, in MLA layers: torch's CPU SDPA (as measured) takes its math path for MLA's
unequal q/k and v head dims and keeps the ``[heads, T, T]`` probabilities; a flash-attention kernel (the GPU
path) keeps the output and its log-sum-exp only, so the planning figures below leave the ``T**2`` part out and
the per-layer table shows it. Delta rules (GDN, KDA) and Qwen3-Next's gated attention (equal head dims) measure
linear in T.

MoE layers are measured with two reduced routed-expert counts (``moe_experts``: 2 and 4 times top-k, rounded up
to the router's groups) at the real top-k, hidden and expert width, and the per-token bytes are
extrapolated linearly in the expert count to the real one (what grows with the expert count is the router's
``[T, experts]`` scores, probabilities and routing map; the expert activations depend on top-k only). Every
coefficient is measured this way; what the capacity figures use is ``per_token``.

TP / SP (derived, not measured): with sequence parallelism every activation a layer saves is either sharded on
the sequence (norms, residual, router, the input megatron's column-parallel linears keep: they save the
sequence shard and all-gather again in backward) or on heads / the hidden of the TP-split linears; so per-rank
bytes = TP-1 bytes / TP. MoE layers: this assumes experts spread by expert parallelism with expert TP 1 (each
rank's experts see, on average, T / TP x top-k tokens); with megatron's default expert TP = TP the routed
experts' inputs are kept whole on every TP rank and the figures are optimistic. Other exceptions (also
optimistic): key/value heads fewer than TP are replicated (Qwen3-Next attention has 2 KV groups at TP 4 / 8),
and parts a TP group computes whole (the check below finds one: a compiled megatron-core function whose saved
bytes per rank do not shrink with TP). ``--check-tp`` measures the derivation on tiny models of
the three architectures at TP = EP = 2 with SP on gloo ranks.

Full recompute (``--recompute-granularity full --recompute-method uniform``) keeps each layer's input (bf16
``[T/TP, hidden]`` with SP) and, in backward, one layer's full activations at a time: bytes per token =
layers * 2 * hidden / TP + max over layer kinds / TP.

Loss head (computed, not measured): the fp32 ``[T, vocab/TP]`` logits the vocab-parallel cross entropy keeps
(4 * vocab / TP bytes per token; full recompute does not cover it). It is listed separately and included in the totals.

Capacity: with CP the sequence is split over CP ranks, each holding T / CP tokens of every layer; the tokens a
GPU can hold are ``budget / bytes_per_token(TP)``, and a sequence of S tokens needs CP = ceil(S / that) (rounded
up to a power of two, as CP layouts are) and TP * CP GPUs. ``--budget-gb``: the activation budget per GPU
(what is left after weights, gradients, optimizer shards and workspace; see docs/models.md for how to get it).

Usage: ``python benchmarks/model_memory.py [--presets ...] [--T 64 128 192] [--budget-gb 20 40 80] [--check-tp 2]
[--backend eager|triton] [--write-docs] [--json PATH]``
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks._common import add_output_args, publish, run_meta  # noqa: E402
from benchmarks.layer_memory import saved_bytes  # noqa: E402

GB = 1e9
TP_SIZES = (1, 2, 4, 8)
SEQUENCES = (128 * 1024, 512 * 1024, 1024 * 1024)
DOCS_JSON = ROOT / "docs" / "model_memory.json"

# Published config.json of Qwen/Qwen3-Next-80B-A3B-Instruct (huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct)
QWEN3_NEXT_80B_A3B = dict(
    model_type="qwen3_next", hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, hidden_act="silu", rms_norm_eps=1e-6, vocab_size=151936,
    tie_word_embeddings=False, full_attention_interval=4, decoder_sparse_step=1, mlp_only_layers=[],
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
    linear_value_head_dim=128, moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=512,
    num_experts_per_tok=10, norm_topk_prob=True, output_router_logits=False, partial_rotary_factor=0.25,
    rope_theta=10000000, rope_scaling=None, attention_bias=False, attention_dropout=0.0)

# Published config.json of moonshotai/Kimi-Linear-48B-A3B-Instruct (huggingface.co/moonshotai/Kimi-Linear-48B-A3B-
# Instruct; fields of activation size as published; routed_scaling_factor and rms_norm_eps do not change them)
KIMI_LINEAR_48B_A3B = dict(
    model_type="kimi_linear", hidden_size=2304, head_dim=72, intermediate_size=9216, num_hidden_layers=27,
    num_attention_heads=32, num_key_value_heads=32, hidden_act="silu", vocab_size=163840, rms_norm_eps=1e-5,
    tie_word_embeddings=False, first_k_dense_replace=1, moe_layer_freq=1, moe_intermediate_size=1024,
    num_experts=256, num_experts_per_token=8, num_shared_experts=1, num_expert_group=1, topk_group=1,
    moe_renormalize=True, moe_router_activation_func="sigmoid", routed_scaling_factor=2.446, mla_use_nope=True,
    kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    linear_attn_config=dict(full_attn_layers=[4, 8, 12, 16, 20, 24, 27], head_dim=128, num_heads=32,
                            short_conv_kernel_size=4,
                            kda_layers=[1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26]))

# Published config.json of deepseek-ai/DeepSeek-V3 (huggingface.co/deepseek-ai/DeepSeek-V3); the MTP layer
# (num_nextn_predict_layers) is left out here: the preset does not model it
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
    n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
    first_k_dense_replace=3, moe_layer_freq=1, norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    hidden_act="silu", rms_norm_eps=1e-6, vocab_size=129280, tie_word_embeddings=False,
    max_position_embeddings=163840, rope_theta=10000, attention_bias=False, attention_dropout=0.0,
    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                      mscale=1.0, mscale_all_dim=1.0))



def transformers_defaults(config_class: str) -> dict:
    """config.json of a transformers config class at its defaults, which its docstring names as a released model's
    shapes (``OlmoHybridConfig``: allenai/Olmo-Hybrid-7B; ``BailingHybridConfig``: inclusionAI/Ling-3.0-Flash;
    ``Qwen3_5TextConfig``: Qwen/Qwen3.5-27B; ``Qwen3_5MoeTextConfig``: Qwen/Qwen3.5-35B-A3B, the language models of
    the released VL checkpoints); OLMo-Hybrid without RoPE, as its released checkpoints."""
    import transformers

    hf = getattr(transformers, config_class)().to_dict()
    if hf["model_type"] == "olmo_hybrid":
        hf["rope_parameters"] = {"rope_type": "default", "rope_theta": None}
    return hf


PRESETS = {"Qwen3-Next-80B-A3B": QWEN3_NEXT_80B_A3B, "Kimi-Linear-48B-A3B": KIMI_LINEAR_48B_A3B,
           "DeepSeek-V3": DEEPSEEK_V3, "OLMo-Hybrid-7B": lambda: transformers_defaults("OlmoHybridConfig"),
           "Ling-3.0-Flash": lambda: transformers_defaults("BailingHybridConfig"),
           "Qwen3.5-27B": lambda: transformers_defaults("Qwen3_5TextConfig"),
           "Qwen3.5-35B-A3B": lambda: transformers_defaults("Qwen3_5MoeTextConfig")}
MIXERS = {"G": "GDN", "K": "KDA", "M": "MLA", "A": "attention (Qwen3-Next: gated)"}


def preset_config(name: str) -> dict:
    """The config.json dict of preset ``name`` (a literal, or read from transformers' defaults)."""
    preset = PRESETS[name]
    return preset() if callable(preset) else preset


# ----------------------------------------------------------------------------------------------------- layers

def layer_kinds(preset) -> list[tuple[str, bool]]:
    """``(mixer symbol, MoE MLP)`` of every layer of ``preset`` (a ``ModelPreset``)."""
    freq = preset.transformer_fields.get("moe_layer_freq")
    n = len(preset.pattern)
    if not preset.transformer_fields.get("num_moe_experts"):
        flags = [False] * n
    elif isinstance(freq, (list, tuple)):
        flags = [bool(f) for f in freq]
    else:
        flags = [i % (freq or 1) == 0 for i in range(n)]
    return list(zip(preset.pattern, flags))


def moe_experts(fields: dict) -> tuple[int, int]:
    """The two reduced routed-expert counts a MoE kind is measured at: 2x and 4x top-k, multiples of the groups."""
    groups = fields.get("moe_router_num_groups") or 1
    return tuple(math.ceil(m * fields["moe_router_topk"] / groups) * groups for m in (2, 4))


def build_block(preset, kinds, *, backend="eager", dtype=torch.bfloat16, experts=None, **parallel):
    """A megatron-core ``TransformerBlock`` (no final norm) of ``preset``'s layers of ``kinds`` (``[(symbol,
    moe)]``, in order), ``experts`` routed experts in its MoE layers (default: the preset's); ``parallel``:
    ``TransformerConfig`` parallel fields (``tensor_model_parallel_size``, ``sequence_parallel``)."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    from hp_megatron.models import preset_transformer_config
    from hp_megatron.specs import get_hybrid_layer_spec

    pattern = "".join(symbol for symbol, _ in kinds)
    overrides = dict(num_layers=len(kinds), hp_layer_pattern=pattern, params_dtype=dtype,
                     bf16=dtype == torch.bfloat16, use_cpu_initialization=True, perform_initialization=True,
                     **parallel)
    if preset.transformer_fields.get("num_moe_experts"):
        overrides["moe_layer_freq"] = [int(moe) for _, moe in kinds]
        if experts is not None:
            overrides["num_moe_experts"] = experts
    config = preset_transformer_config(preset, **overrides)
    spec = get_hybrid_layer_spec(pattern, backend, qk_layernorm=preset.qk_layernorm)
    return TransformerBlock(config, spec, pre_process=True, post_process=False).to(dtype)


def measure_block(block, T, hidden, dtype=torch.bfloat16, seed=0, rank=0, ranks=1) -> int:
    """Bytes ``block`` saves for backward over one forward of a random ``[T, 1, hidden]`` input (layer_memory's
    ``saved_bytes``); with ``ranks`` > 1 (sequence parallelism) the input is sequence shard ``rank`` of it."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, 1, hidden, generator=gen) * 0.5).to(dtype).chunk(ranks, 0)[rank].contiguous()
    total, _, out = saved_bytes(lambda: block(x.requires_grad_(True), None), list(block.parameters()))
    del out
    return total


def poly_fit(points: dict) -> list[float]:
    """Coefficients ``[c0, c1, ...]`` (constant first) of the polynomial of degree ``len(points) - 1`` through
    ``{x: y}``, solved in float64."""
    xs = torch.tensor(sorted(points), dtype=torch.float64)
    ys = torch.tensor([points[x] for x in sorted(points)], dtype=torch.float64)
    vander = torch.stack([xs ** i for i in range(len(xs))], 1)
    return torch.linalg.solve(vander, ys).tolist()


def measure_kind(preset, symbol, moe, Ts, backend="eager", log=print) -> dict:
    """Per-token and fixed saved bytes of one layer kind at the preset's shapes (TP 1, bf16)."""
    fields = preset.transformer_fields
    hidden = fields["hidden_size"]
    counts = moe_experts(fields) if moe else (None,)
    per_count = {}
    for experts in counts:
        torch.manual_seed(0)
        block = build_block(preset, [(symbol, moe)], backend=backend, experts=experts)
        points = {T: measure_block(block, T, hidden) for T in Ts}
        per_count[experts] = dict(points=points, fit=poly_fit(points))
        del block
        log(f"  {MIXERS[symbol]:15s} {'MoE' if moe else 'dense'} experts={experts}: "
            + ", ".join(f"T{T} {b / T / 1e3:.1f} kB/token" for T, b in points.items()))
    if moe:   # each coefficient linear in the routed-expert count, evaluated at the real count
        real = fields["num_moe_experts"]
        fit = [sum(c * real ** i for i, c in enumerate(poly_fit({e: r["fit"][j] for e, r in per_count.items()})))
               for j in range(len(Ts))]
    else:
        fit = per_count[None]["fit"]
    fit += [0.0] * (3 - len(fit))
    return dict(mixer=MIXERS[symbol], symbol=symbol, moe=moe, fixed_bytes=fit[0], bytes_per_token=fit[1],
                bytes_per_token_squared=fit[2],
                measured={str(e): {str(T): b for T, b in r["points"].items()} for e, r in per_count.items()})


def predicted_bytes(kind: dict, T: int) -> float:
    """Saved bytes of one layer of ``kind`` (a :func:`measure_kind` result) at ``T`` tokens, every part."""
    return kind["fixed_bytes"] + kind["bytes_per_token"] * T + kind["bytes_per_token_squared"] * T * T


def _tp_rank_bytes(rank, world_size, arch, T):
    """On one of ``world_size`` gloo ranks: bytes a tiny ``arch`` model at TP = EP = world_size with SP and
    expert TP 1 saves on this rank for ``T`` tokens (its input: this rank's ``T / TP`` sequence shard)."""
    from megatron.core import parallel_state

    from hp_megatron.models.architectures import preset_from_hf
    from hp_megatron.models.tiny import tiny_hf_config
    from hp_megatron.platform import apply_cpu_shims

    experts = dict(expert_model_parallel_size=world_size, expert_tensor_parallel_size=1)
    parallel_state.initialize_model_parallel(world_size, 1, **experts)
    apply_cpu_shims(0)
    try:
        preset = preset_from_hf(tiny_hf_config(arch)[1].to_dict())
        torch.manual_seed(0)
        block = build_block(preset, layer_kinds(preset), tensor_model_parallel_size=world_size,
                            sequence_parallel=world_size > 1, **experts)
        return measure_block(block, T, preset.transformer_fields["hidden_size"], rank=rank, ranks=world_size)
    finally:
        parallel_state.destroy_model_parallel()


def tp_check(tp: int, T: int = 256, archs=("qwen3_next", "kimi_linear", "deepseek_v3")) -> list[dict]:
    """The TP / SP derivation checked: per-rank saved bytes of tiny models at TP ``tp`` with SP, experts spread by
    EP = ``tp`` with expert TP 1 (``tp`` gloo ranks), against their TP-1 bytes / ``tp``."""
    from benchmarks._common import spawn_gloo

    rows = []
    for arch in archs:
        tp1, = spawn_gloo(_tp_rank_bytes, 1, arch, T)
        ranks = spawn_gloo(_tp_rank_bytes, tp, arch, T)
        rows.append(dict(arch=arch, T=T, tp=tp, tp1_bytes=tp1, rank_bytes=ranks, ratio=max(ranks) * tp / tp1))
        print(f"  TP check {arch}: TP1 {tp1} B, TP{tp} ranks {ranks} B: max rank x TP / TP1 = "
              f"{rows[-1]['ratio']:.3f}", flush=True)
    return rows


# ----------------------------------------------------------------------------------------------------- capacity

def model_figures(preset, kinds_measured: dict, vocab: int) -> dict:
    """Whole-model activation bytes per token per GPU at each TP with SP, without and with full recompute."""
    hidden = preset.transformer_fields["hidden_size"]
    kinds = layer_kinds(preset)
    layers = sum(kinds_measured[k]["bytes_per_token"] for k in kinds)
    largest = max(kinds_measured[k]["bytes_per_token"] for k in set(kinds))
    recompute = len(kinds) * 2 * hidden + largest       # layer inputs (bf16) + one layer live in backward
    head = 4 * vocab                                     # fp32 [T, vocab] kept by the cross entropy
    out = {}
    for tp in TP_SIZES:
        out[tp] = dict(layers=layers / tp, head=head / tp, total=(layers + head) / tp,
                       total_recompute=(recompute + head) / tp)
    return out


def pow2_ceil(n: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def capacity(bytes_per_token: float, budget_gb: float, tp: int) -> dict:
    """Tokens one GPU holds, and CP size / GPUs for each of :data:`SEQUENCES`."""
    tokens = budget_gb * GB / bytes_per_token
    plan = {}
    for seq in SEQUENCES:
        cp = pow2_ceil(seq / tokens) if tokens >= 1 else None
        plan[seq] = dict(cp=cp, gpus=None if cp is None else cp * tp)
    return dict(tokens_per_gpu=int(tokens), plan=plan)


def preset_result(name, hf, Ts, backend, budgets, log=print) -> dict:
    from hp_megatron.models.architectures import preset_from_hf

    preset = preset_from_hf(hf)
    log(f"{name}: pattern {preset.pattern}")
    measured = {}
    for symbol, moe in sorted(set(layer_kinds(preset))):
        measured[(symbol, moe)] = measure_kind(preset, symbol, moe, Ts, backend, log)
    figures = model_figures(preset, measured, hf["vocab_size"])
    caps = {f"{budget:g}": {tp: {rc: capacity(figures[tp]["total_recompute" if rc else "total"], budget, tp)
                                 for rc in (False, True)} for tp in TP_SIZES} for budget in budgets}
    return dict(name=name, pattern=preset.pattern, layers=len(preset.pattern),
                hidden=preset.transformer_fields["hidden_size"], vocab=hf["vocab_size"],
                kinds=[dict(r, count=sum(k == key for k in layer_kinds(preset))) for key, r in measured.items()],
                per_token=figures, capacity=caps)


# ----------------------------------------------------------------------------------------------------- output

def _seq(n: int) -> str:
    return f"{n // 1024}k" if n < 1024 * 1024 else f"{n // (1024 * 1024)}M"


def markdown(results, meta, checks=()) -> str:
    lines = [f"Command: `{meta['command']}`", "",
             f"CPU, torch {meta['torch']}, megatron-core {meta['megatron_core']}; bf16, {meta['backend']} mixers, "
             f"layers measured at T {' and '.join(map(str, meta['T']))} (B 1), TP 1, and scaled as the docstring of "
             "`benchmarks/model_memory.py` states (per-token coefficient of the three lengths; MoE extrapolated in the "
             "routed-expert count; TP > 1 with SP: / TP; full recompute: layer inputs + one layer; loss head: "
             "computed fp32 logits, 4 * vocab / TP bytes per token).", "",
             "Per layer kind (TP 1, whole layer: norms + mixer + MLP/MoE):", "",
             "| model | layer | MLP | layers | kB/token | fixed kB per sequence | eager-attention bytes per T^2 "
             "(left out below) |", "|---|---|---|---|---|---|---|"]
    for r in results:
        for k in r["kinds"]:
            lines.append(f"| {r['name']} | {k['mixer']} | {'MoE' if k['moe'] else 'dense'} | {k['count']} | "
                         f"{k['bytes_per_token'] / 1e3:.1f} | {k['fixed_bytes'] / 1e3:.0f} | "
                         f"{round(k['bytes_per_token_squared'], 1) + 0.0:.1f} |")   # no "-0.0"
    lines += ["", "Whole model, activation GB per 1k tokens per GPU (TP with SP; in parentheses: with full recompute; "
              "loss head included):", "",
              "| model | " + " | ".join(f"TP {tp}" for tp in TP_SIZES) + " |", "|---" * (len(TP_SIZES) + 1) + "|"]
    for r in results:
        cells = [f"{f['total'] * 1024 / GB:.2f} ({f['total_recompute'] * 1024 / GB:.2f})"
                 for f in (r["per_token"][tp] for tp in TP_SIZES)]
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    budgets = list(results[0]["capacity"]) if results else []
    lines += ["", "Longest sequence per GPU, and GPUs (TP x CP, CP a power of two) for 128k / 512k / 1M tokens, per "
              "activation budget per GPU (cell: tokens per GPU; GPUs for 128k / 512k / 1M; `-`: not one token fits):",
              "", "| model | recompute | TP | " + " | ".join(f"{b} GB" for b in budgets) + " |",
              "|---|---|---" + "|---" * len(budgets) + "|"]
    for r in results:
        for rc in (False, True):
            for tp in TP_SIZES:
                cells = []
                for budget in budgets:
                    c = r["capacity"][budget][tp][rc]
                    gpus = " / ".join(str(c["plan"][s]["gpus"] or "-") for s in SEQUENCES)
                    cells.append(f"{c['tokens_per_gpu']:,}; {gpus}")
                lines.append(f"| {r['name']} | {'full' if rc else 'none'} | {tp} | " + " | ".join(cells) + " |")
    if checks:
        lines += ["", f"TP / SP derivation checked (`--check-tp {checks[0]['tp']}`): tiny models of each architecture "
                  f"(hp_megatron.models.tiny, bf16, T {checks[0]['T']}) at TP 1 and at TP = EP = "
                  f"{checks[0]['tp']} with SP and expert TP 1 on gloo ranks; measured bytes of the largest rank x TP "
                  "/ TP-1 bytes:", "",
                  "| tiny model | TP 1 bytes | per-rank bytes | largest rank x TP / TP 1 |", "|---|---|---|---|"]
        for c in checks:
            lines.append(f"| {c['arch']} | {c['tp1_bytes']:,} | {', '.join(f'{b:,}' for b in c['rank_bytes'])} | "
                         f"{c['ratio']:.3f} |")
    return "\n".join(lines)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", choices=sorted(PRESETS), default=list(PRESETS))
    parser.add_argument("--T", type=int, nargs=3, default=[64, 128, 192],
                        help="the three measured lengths (B = 1; multiples of the delta rules' chunk of 64)")
    parser.add_argument("--backend", choices=("eager", "triton"), default="eager",
                        help="mixer backend (triton: FLA's kernels through Triton's interpreter)")
    parser.add_argument("--check-tp", type=int, default=2,
                        help="check the / TP derivation on tiny models at this TP with SP (gloo ranks); 0: skip")
    parser.add_argument("--budget-gb", type=float, nargs="+", default=[20.0, 40.0, 80.0],
                        help="activation memory per GPU, GB (after weights, gradients, optimizer, workspace)")
    add_output_args(parser)
    args = parser.parse_args(argv)
    if len(set(args.T)) != 3 or min(args.T) < 1:
        raise ValueError(f"--T needs three different positive lengths, got {args.T}")
    if args.check_tp < 0 or args.check_tp == 1:
        raise ValueError(f"--check-tp must be 0 (skip) or at least 2, got {args.check_tp}")
    if min(args.budget_gb) <= 0:
        raise ValueError(f"--budget-gb must be positive, got {args.budget_gb}")
    if args.backend == "triton":   # benchmarks.layer_memory enabled the interpreter on import where it can run
        from tests.support import triton_interpreter

        reason = triton_interpreter.available()
        if reason is not None:
            raise RuntimeError(f"--backend triton runs FLA's kernels through Triton's interpreter: {reason}")
    from hp_megatron.platform import single_rank_megatron

    with single_rank_megatron(0):
        meta = dict(run_meta("model_memory.py", argv), T=args.T, backend=args.backend)
        results = [preset_result(name, preset_config(name), args.T, args.backend, args.budget_gb)
                   for name in args.presets]
    checks = tp_check(args.check_tp) if args.check_tp else []
    if args.write_docs and args.json is None:
        args.json = DOCS_JSON
    publish(_jsonable(dict(meta=meta, results=results, tp_check=checks)), markdown(results, meta, checks), args,
            "model_memory", "### Measured")


if __name__ == "__main__":
    main()
