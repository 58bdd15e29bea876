"""Layer-level fwd+bwd throughput and peak memory: our GDN / KDA mixers against other implementations.

Rows (one process, TP=1, CP=1, the current device; every row is wrapped so a failure is recorded, not fatal):
  ours GDN      layers.GatedDeltaNet (megatron-core module, ``--backend``, default eager on CPU, triton on GPU)
  ours KDA      layers.KimiDeltaAttention
  mcore GDN     megatron.core.ssm.gated_delta_net.GatedDeltaNet (needs flash-linear-attention and CUDA;
                the row says why when it cannot run)
  hf GDN / KDA  transformers' Qwen3NextGatedDeltaNet / KimiLinearDeltaAttention (pure-PyTorch paths), with
                the same weights as ours (``tests.support.hf_layers``), so their outputs are compared with ours

Input ``[T, B, hidden]`` (``[B, T, hidden]`` for transformers), loss = sum(y * dy) with a fixed random dy.
Time: wall clock of forward + backward (device-synchronised), ``--warmup`` untimed runs, then the median of
``--repeats``; tokens/s = B*T / time. Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` during one
fwd+bwd minus the memory allocated before it; on CPU the peak of PyTorch's running allocated CPU bytes over
one fwd+bwd (``torch.profiler`` memory events), i.e. activations, temporaries and gradients above the inputs.

Usage: ``python benchmarks/layers.py [--shapes B,T ...] [--hidden 1024] [--repeats 3] [--write-docs]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before benchmarks/, whose layers.py would shadow the package

from benchmarks._common import add_output_args, cpu_peak_bytes, publish, rel_err, run_meta  # noqa: E402
from hp_megatron.platform import single_rank_megatron  # noqa: E402


def transformer_config(args, dtype, device):
    from megatron.core.transformer import TransformerConfig

    kw = dict(num_layers=1, hidden_size=args.hidden, num_attention_heads=args.heads,
              use_cpu_initialization=device.type == "cpu", params_dtype=dtype, bf16=dtype == torch.bfloat16,
              gradient_accumulation_fusion=False, bias_dropout_fusion=False, layernorm_epsilon=1e-6)
    return TransformerConfig(**kw)


def dims(args):
    return dict(num_key_heads=args.heads, num_value_heads=args.value_heads, key_head_dim=args.head_dim,
                value_head_dim=args.head_dim, conv_kernel_dim=4)


def build_ours(kind, args, dtype, device):
    from layers import GatedDeltaNet, KimiDeltaAttention

    cls = GatedDeltaNet if kind == "gdn" else KimiDeltaAttention
    d = dims(args)
    if kind == "kda":
        d["num_value_heads"] = args.heads  # Kimi Linear has no GVA
    layer = cls(transformer_config(args, dtype, device), None, layer_number=1, backend=args.backend, **d)
    return layer.to(device), d


def build_mcore_gdn(args, dtype, device):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from layers.shared.norm import RMSNorm

    cfg = transformer_config(args, dtype, device)
    cfg.linear_num_key_heads, cfg.linear_num_value_heads = args.heads, args.value_heads
    cfg.linear_key_head_dim = cfg.linear_value_head_dim = args.head_dim
    cfg.linear_conv_kernel_dim = 4
    cfg.activation_func = torch.nn.functional.silu
    subs = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=RMSNorm, out_proj=RowParallelLinear)
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    return GatedDeltaNet(cfg, subs, layer_number=1, pg_collection=pgs).to(device)


class HFLayer(torch.nn.Module):
    """A transformers mixer behind our call convention: ``[s, b, h]`` in, ``(out, None)`` out."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x, attention_mask=None):
        return self.module(x.transpose(0, 1)).transpose(0, 1), None


def torch_path(modeling):
    """The modeling module with its GDN/KDA functions reset to the pure-PyTorch originals (transformers binds
    FLA's kernels in their place where FLA imports; the benchmark compares pure-PyTorch paths)."""
    for name in ("torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention"):
        fn = getattr(modeling, name, None)
        if fn is not None and hasattr(fn, "__wrapped__"):
            setattr(modeling, name, fn.__wrapped__)
    return modeling


def build_hf(kind, args, dtype, device, ours_parts, ours_dims):
    from tests.support.hf_layers import gdn_to_qwen3_next, kda_to_kimi_linear

    if kind == "gdn":
        from transformers.models.qwen3_next import modeling_qwen3_next as modeling
        from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

        Qwen3NextGatedDeltaNet = torch_path(modeling).Qwen3NextGatedDeltaNet

        cfg = Qwen3NextConfig(hidden_size=args.hidden, num_hidden_layers=1, layer_types=["linear_attention"],
                              linear_num_key_heads=args.heads, linear_num_value_heads=args.value_heads,
                              linear_key_head_dim=args.head_dim, linear_value_head_dim=args.head_dim,
                              linear_conv_kernel_dim=4, rms_norm_eps=1e-6, hidden_act="silu")
        module = Qwen3NextGatedDeltaNet(cfg, layer_idx=0)
        module.load_state_dict(gdn_to_qwen3_next(ours_parts, **ours_dims))
    else:
        from transformers.models.kimi_linear import modeling_kimi_linear as modeling
        from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

        KimiLinearDeltaAttention = torch_path(modeling).KimiLinearDeltaAttention

        cfg = KimiLinearConfig(hidden_size=args.hidden, num_hidden_layers=1, layer_types=["linear_attention"],
                               linear_attn_config={"head_dim": args.head_dim, "num_heads": args.heads,
                                                   "short_conv_kernel_size": 4},
                               rms_norm_eps=1e-6, hidden_act="silu")
        module = KimiLinearDeltaAttention(cfg, layer_idx=0)
        module.load_state_dict(kda_to_kimi_linear(ours_parts, **ours_dims))
    return HFLayer(module.to(device=device, dtype=dtype))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def fwd_bwd(layer, x, dy):
    x = x.detach().requires_grad_(True)
    y, _ = layer(x, None)   # megatron's mixer call: (hidden_states, attention_mask)
    (y.float() * dy).sum().backward()
    return y.detach(), x.grad


def timed(layer, x, dy, device, warmup, repeats):
    for _ in range(warmup):
        fwd_bwd(layer, x, dy)
    times = []
    for _ in range(repeats):
        layer.zero_grad(set_to_none=True)
        sync(device)
        start = time.perf_counter()
        fwd_bwd(layer, x, dy)
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def peak_bytes(layer, x, dy, device):
    layer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fwd_bwd(layer, x, dy)
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    return cpu_peak_bytes(lambda: fwd_bwd(layer, x, dy))


def run_shape(B, T, args, device, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, B, args.hidden, generator=gen).to(device=device, dtype=dtype)
    dy = torch.randn(T, B, args.hidden, generator=gen).to(device)
    rows = []

    def measure(kind, impl, build, repeats, reference=None):
        row = dict(B=B, T=T, kind=kind, impl=impl)
        try:
            layer = build()
            y, dx = fwd_bwd(layer, x, dy)
            if reference is not None:
                row["rel_err_vs_ours"] = max(rel_err(y, reference[0]), rel_err(dx, reference[1]))
            median, times = timed(layer, x, dy, device, args.warmup if repeats > 1 else 0, repeats)
            row.update(ms=1e3 * median, runs_ms=[round(1e3 * t, 2) for t in times], tokens_per_s=B * T / median,
                       peak_mib=peak_bytes(layer, x, dy, device) / 2**20)
            print(f"  {kind} {impl:6s} {row['ms']:9.1f} ms  {row['tokens_per_s']:10.0f} tok/s  "
                  f"peak {row['peak_mib']:8.1f} MiB", flush=True)
            rows.append(row)
            return layer, (y, dx)
        except Exception as err:  # recorded in the table; the other rows still run
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
            print(f"  {kind} {impl:6s} cannot run: {row['error']}", flush=True)
            if args.verbose:
                traceback.print_exc()
            rows.append(row)
            return None, None

    for kind in ("gdn", "kda"):
        built = {}

        def ours(kind=kind, built=built):
            layer, d = build_ours(kind, args, dtype, device)
            built["dims"], built["parts"] = d, layer.global_parts()
            return layer

        _, reference = measure(kind, "ours", ours, args.repeats)
        if kind == "gdn":
            measure(kind, "mcore", lambda: build_mcore_gdn(args, dtype, device), args.repeats)
        if "parts" in built and not args.skip_hf:
            slow = kind == "kda"  # transformers' KDA chunk loop takes seconds per call
            measure(kind, "hf",
                    lambda kind=kind, built=built: build_hf(kind, args, dtype, device, built["parts"], built["dims"]),
                    1 if slow else args.repeats, reference)
    return rows


NAMES = {"ours": "ours ({backend})", "mcore": "megatron-core GatedDeltaNet",
         "hf": "transformers (pure PyTorch)"}


def markdown(rows, meta):
    lines = [f"Command: `{meta['command']}`", "",
             f"Device: {meta['device_name']}; torch {meta['torch']} ({meta['threads']} threads), megatron-core "
             f"{meta['megatron_core']}, transformers {meta['transformers']}, {meta['dtype']}. Layer: hidden "
             f"{meta['hidden']}, GDN {meta['heads']} query/key heads and {meta['value_heads']} value heads, KDA "
             f"{meta['heads']} heads, head dim {meta['head_dim']}, conv 4; TP=1, CP=1. fwd+bwd wall time is the median "
             f"of {meta['repeats']} runs after {meta['warmup']} warmup (transformers' KDA: one run); peak memory is "
             f"the peak allocated above the inputs during one fwd+bwd. The last column is the largest relative L2 "
             f"difference from ours of the output and the input gradient (same weights). Load average at the "
             f"start: {meta['load_average']} (a shared machine makes CPU times noisy).", "",
             "| B | T | layer | implementation | fwd+bwd ms | tokens/s | peak MiB | rel. err vs ours |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = NAMES[r["impl"]].format(backend=meta["backend"])
        if "error" in r:
            lines.append(f"| {r['B']} | {r['T']} | {r['kind'].upper()} | {name} | cannot run here: "
                         f"{r['error']} | - | - | - |")
            continue
        err = f"{r['rel_err_vs_ours']:.1e}" if "rel_err_vs_ours" in r else "-"
        lines.append(f"| {r['B']} | {r['T']} | {r['kind'].upper()} | {name} | {r['ms']:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {r['peak_mib']:.1f} | {err} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["1,2048", "4,512"], help="B,T pairs")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=4, help="query/key heads (KDA: all heads)")
    parser.add_argument("--value-heads", type=int, default=8, help="GDN value heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="default: float32 on CPU, bfloat16 on GPU")
    parser.add_argument("--backend", default=None, help="ops backend of our layers (default: eager on CPU, "
                        "triton on CUDA)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-hf", action="store_true", help="skip the transformers rows")
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of rows that cannot run")
    add_output_args(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    args.backend = args.backend or ("triton" if device.type == "cuda" else "eager")
    with single_rank_megatron(0):  # gloo even on a GPU: TP = CP = 1 has no collective
        meta = dict(run_meta("layers.py", argv),
                    device_name=(torch.cuda.get_device_name(device) if device.type == "cuda"
                                 else f"CPU ({os.cpu_count()} cores)"),
                    dtype=str(dtype), backend=args.backend, hidden=args.hidden, heads=args.heads,
                    value_heads=args.value_heads, head_dim=args.head_dim, warmup=args.warmup, repeats=args.repeats,
                    load_average=[round(v, 1) for v in os.getloadavg()])
        rows = []
        for text in args.shapes:
            B, T = (int(v) for v in text.split(","))
            print(f"B={B} T={T}", flush=True)
            rows += run_shape(B, T, args, device, dtype)
        publish(dict(meta=meta, rows=rows), markdown(rows, meta), args, "layers",
                "## GDN / KDA layers, fwd+bwd (`benchmarks/layers.py`)")


if __name__ == "__main__":
    main()
