"""Per-layer-call time at tiny dims, where fixed per-call costs (plans, contexts, validation, bookkeeping) dominate.

Rows: GDN, KDA, MLA layer forward + backward (hidden ``--hidden``, ``--seq`` global tokens, batch 1, eager, fp32,
CPU; GDN/KDA with 4 key heads of dim 8 and ``--value-heads`` value heads of dim ``--value-dim``, MLA with 4 heads),
single rank and CP = ``--cp`` on gloo ranks (each rank holds ``seq / cp`` tokens; the CP time is the
slowest rank's median). Every call brings a fresh PackedSeqParams (``--thd``: three documents), as every
micro-batch does. Time: ``--warmup`` untimed calls, then the median of ``--repeats`` calls (wall clock).

Usage: ``python benchmarks/layer_calls.py [--hidden 32] [--seq 64] [--cp 2] [--thd] [--value-heads 4] [--value-dim 8]
[--repeats 50] [--write-docs]``. ``--value-heads 32 --value-dim 128`` are megatron-core 0.16's
``TransformerConfig`` defaults (``linear_num_value_heads``, ``linear_value_head_dim``), which a layer built with
only key heads and key dim as ModuleSpec params reads from the config.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before benchmarks/, whose layers.py would shadow the package

from benchmarks._common import add_output_args, publish, run_meta  # noqa: E402

KINDS = ("gdn", "kda", "mla")


def _build(kind, args, cp_group, solo):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    pgs = ProcessGroupCollection(tp=solo, cp=cp_group)
    common = dict(num_layers=1, hidden_size=args.hidden, use_cpu_initialization=True, params_dtype=torch.float32,
                  gradient_accumulation_fusion=False, bias_dropout_fusion=False, add_bias_linear=False)
    torch.manual_seed(0)
    if kind == "mla":
        from hp_megatron.specs import get_mixer_spec
        from layers.mixers.mla.layer import MultiLatentAttention

        config = MLATransformerConfig(num_attention_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8,
                                      qk_pos_emb_head_dim=8, v_head_dim=8, rope_type="rope", rotary_base=10000,
                                      layernorm_epsilon=1e-6, **common)
        return MultiLatentAttention(config, get_mixer_spec("mla").submodules, layer_number=1, pg_collection=pgs)
    from layers import GatedDeltaNet, KimiDeltaAttention

    config = TransformerConfig(num_attention_heads=4, **common)
    cls = GatedDeltaNet if kind == "gdn" else KimiDeltaAttention
    return cls(config, None, layer_number=1, pg_collection=pgs, num_key_heads=4, key_head_dim=8,
               num_value_heads=args.value_heads, value_head_dim=args.value_dim)


def _packed(seq, thd):
    if not thd:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, seq // 4, seq // 2, seq], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=seq // 2,
                           max_seqlen_kv=seq // 2)


def time_calls(kind, args, cp_group, solo, cp_size) -> float:
    """Median seconds of one layer forward + backward on this rank's ``seq / cp_size`` tokens."""
    import torch.distributed as dist

    layer = _build(kind, args, cp_group, solo)
    local = args.seq // cp_size
    x = torch.randn(local, 1, args.hidden, requires_grad=True)
    dy = torch.randn(local, 1, args.hidden)
    times = []
    for i in range(args.warmup + args.repeats):
        packed = _packed(args.seq, args.thd)          # every micro-batch brings its own
        if cp_size > 1:
            dist.barrier(group=cp_group)
        start = time.perf_counter()
        y, _ = layer(x, packed_seq_params=packed)
        y.backward(dy)
        elapsed = time.perf_counter() - start
        if i >= args.warmup:
            times.append(elapsed)
    return statistics.median(times)


def _worker(rank, world, port, args, queue):
    import torch.distributed as dist

    from hp_megatron.platform import apply_cpu_shims

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    apply_cpu_shims(0)
    solo = [dist.new_group([r]) for r in range(world)][rank]
    out = {kind: time_calls(kind, args, dist.group.WORLD, solo, world) for kind in args.kinds}
    queue.put((rank, out))
    dist.destroy_process_group()


def run_ranks(world: int, args) -> dict:
    """{kind: slowest rank's median seconds} over ``world`` gloo ranks (world 1: one rank, no CP)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    per_rank = [queue.get(timeout=1800) for _ in range(world)]
    for p in procs:
        p.join()
    return {kind: max(r[1][kind] for r in per_rank) for kind in args.kinds}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--thd", action="store_true", help="packed documents (PackedSeqParams) on every call")
    parser.add_argument("--value-heads", type=int, default=4,
                        help="GDN/KDA value heads (a multiple of the 4 key heads)")
    parser.add_argument("--value-dim", type=int, default=8, help="GDN/KDA value head dim")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=50)
    add_output_args(parser)
    args = parser.parse_args(argv)
    if args.seq % (2 * args.cp):
        raise ValueError(f"--seq {args.seq} must be divisible by 2 x --cp = {2 * args.cp} (zigzag layout)")
    single = run_ranks(1, args)
    cp = run_ranks(args.cp, args)
    rows = [dict(kind=k, single_ms=1e3 * single[k], cp_ms=1e3 * cp[k], cp_over_single=cp[k] / single[k])
            for k in args.kinds]
    result = dict(meta=run_meta("layer_calls.py", argv), hidden=args.hidden, seq=args.seq, cp=args.cp, thd=args.thd,
                  value_heads=args.value_heads, value_dim=args.value_dim, rows=rows)
    table = "\n".join([f"| layer | 1 rank (ms) | CP={args.cp} (ms) | CP / 1 rank |", "|---|---|---|---|"]
                      + [f"| {r['kind'].upper()} | {r['single_ms']:.1f} | {r['cp_ms']:.1f} | "
                         f"{r['cp_over_single']:.2f}x |" for r in rows])
    tiny = (args.value_heads, args.value_dim) == (4, 8)
    name = "layer_calls" + ("_thd" if args.thd else "") + ("" if tiny else f"_hv{args.value_heads}x{args.value_dim}")
    publish(result, table, args, name,
            f"### Per-layer-call time (fwd+bwd, hidden {args.hidden}, T={args.seq}{', THD' if args.thd else ''}, "
            f"GDN/KDA value heads {args.value_heads} x dim {args.value_dim}, eager, CPU)")


if __name__ == "__main__":
    main()
