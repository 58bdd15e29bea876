"""Activation bytes saved for backward per token, and kernels per forward / backward, of GDN / KDA layers.

Rows (one process, TP = CP = 1, CPU; FLA's Triton kernels run through Triton's interpreter, so the triton rows
need no GPU: what autograd saves and which kernels launch do not depend on the device):
  ours eager / ours triton   layers.GatedDeltaNet / layers.KimiDeltaAttention with that backend
  ours + recompute           the same with ``--recompute-granularity selective --recompute-modules hp_conv
                             hp_gated_norm`` (layers/shared/recompute.py: conv and gated-norm outputs freed after their
                             consumers, recomputed in backward)
  FLA layer                  fla.layers.GatedDeltaNet / fla.layers.KimiDeltaAttention (FLA 0.6, defaults of
                             our shapes: expand_v 1, conv 4, gated output norm)
  megatron-core              megatron.core.ssm.gated_delta_net.GatedDeltaNet (GDN only; a row says why when
                             it cannot be built here), megatron's local linears and our RMSNorm in place of its
                             TE modules; its ``@jit_fuser`` helpers (``torch.compile`` in megatron-core 0.17+)
                             run uncompiled (``disable_jit_fuser()``: the same aten ops, no CPU compile): on a
                             GPU they are compiled, fusing their element-wise ops into fewer kernels. Its
                             selective recompute (``--recompute-modules gdn_norm_out``) is not measured: megatron's
                             ``CheckpointWithoutOutput`` stashes the CUDA RNG state (no CPU run)
  MLA (--kinds mla)          layers.MultiLatentAttention, DeepSeek-V3 head dims, with / without hp_mla_up_proj
  transformers               Qwen3NextGatedDeltaNet / KimiLinearDeltaAttention on their pure-PyTorch paths
                             (benchmarks/layers.py's ``build_hf``)

Saved bytes: one forward under ``torch.autograd.graph.saved_tensors_hooks``; every tensor autograd packs is
reduced to its storage (``untyped_storage().data_ptr()``), each storage counted once with its full
``nbytes()`` at the end of the forward (a storage freed for recompute counts 0); storages of the layer's
parameters are excluded, the layer input is included (the layer keeps it alive). Divided by B*T tokens. Tensors a custom
autograd Function keeps as plain ``ctx`` attributes are invisible to the hooks (FLA keeps none of size; ours keep none).

Kernels: the aten ops that reach a kernel during one forward, and separately during its backward (loss =
sum(y * dy)), counted by a ``TorchDispatchMode`` (the dispatcher level below autograd and composite
decompositions, i.e. what ``torch.profiler`` shows as leaf ``aten::`` kernel events, without the profiler's
overhead on the interpreter), minus views (``OpOverload.is_view``) and the allocation / metadata ops of
:data:`NO_KERNEL`; plus every Triton kernel launch (each ``InterpretedFunction.run``; aten ops inside a launch
are the interpreter's own host copies and are not counted). Gradient accumulation into parameters is part of the
backward count. Rows without Triton kernels get one untimed warm-up fwd+bwd first (our chunk layouts are cached
on first use); interpreter rows do not (on the interpreter Triton's autotuner launches nothing extra, so a first
call launches what any call does). On a GPU one aten op can launch more than one kernel (a split-K GEMM) or none
(a host scalar); the count is a like-for-like proxy for every row.

Usage: ``python benchmarks/layer_memory.py [--hidden 1024 2048] [--dtypes float32 bfloat16] [--T 64]
[--breakdown] [--forward-only (saved bytes and forward kernels, no backward)] [--write-docs (table into
docs/benchmarks.md, rows into docs/layer_memory.json)]``;
``--dsa-seq-lengths 4096 16384 65536 [--write-docs]`` measures only the DSA table instead (:func:`dsa_rows`: our DSA
layer against our dense MLA of the same small heads at each T, forward peak and saved bytes per token; docs section
``dsa_memory``). ``--merge A.json B.json ...`` measures nothing and publishes the rows of earlier runs' ``--json``
files as one table (a later file's row replaces an earlier one of the same layer, implementation and shape), for tables
measured piecewise (the interpreter takes minutes per row on a small machine). ``--docs-section NAME`` publishes into
the section ``NAME`` of docs/benchmarks.md and docs/NAME.json instead of ``layer_memory`` (a table measured with another
megatron-core beside the main one, e.g. ``layer_memory_mcore019``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import traceback
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before benchmarks/, whose layers.py would shadow the package

from tests.support import triton_interpreter  # noqa: E402  (FLA's kernels on CPU)

if triton_interpreter.available() is None and "fla" not in sys.modules:
    triton_interpreter.enable()  # before anything imports fla (a process that already has fla keeps it as it is)

import megatron.core.jit  # noqa: E402

megatron.core.jit.disable_jit_fuser()  # before megatron-core's GDN is imported (module docstring)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks._common import add_output_args, publish, run_meta  # noqa: E402
from hp_megatron.platform import single_rank_megatron  # noqa: E402

HEAD_DIM = 128
DOCS_JSON = ROOT / "docs" / "layer_memory.json"   # --write-docs also writes the rows here
# aten ops that are not views (``OpOverload.is_view``) and still launch no device kernel: allocations, multi-output
# views, metadata, and ``_local_scalar_dense`` (``.item()``, a host read)
NO_KERNEL = frozenset((
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "set_", "split",
    "split_with_sizes", "unbind", "chunk", "unsafe_split", "unsafe_chunk", "lift_fresh", "_local_scalar_dense",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type"))


# ----------------------------------------------------------------------------------------------------- measuring

def saved_bytes(run, params) -> tuple:
    """``(bytes, by_node, out)``: bytes of the unique non-parameter storages autograd saves while ``out = run()``
    builds the graph, and the same bytes attributed to the autograd nodes that saved them (``{node name: bytes}``)."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in param_ptrs and ptr not in seen:
            seen[ptr] = storage
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(s.nbytes() for s in seen.values()), _by_node(out, param_ptrs), out


def _node_saved(node):
    """Tensors saved by one autograd node (built-in ops: ``_saved_*`` attributes; Functions: saved_tensors)."""
    tensors = []
    try:
        tensors += [t for t in getattr(node, "saved_tensors", ()) if isinstance(t, torch.Tensor)]
    except RuntimeError:
        pass
    for name in dir(node):
        if name.startswith("_saved_"):
            value = getattr(node, name, None)
            values = value if isinstance(value, (tuple, list)) else (value,)
            tensors += [v for v in values if isinstance(v, torch.Tensor)]
    return tensors


def _by_node(out, param_ptrs) -> dict:
    """Walk the graph from ``out``: each saved storage is attributed to the first node (forward order of
    discovery from the output) that holds it."""
    roots = [t.grad_fn for t in (out if isinstance(out, (tuple, list)) else (out,))
             if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen_nodes, seen_ptrs, by = set(), set(), Counter()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node is None or node in seen_nodes:
            continue
        seen_nodes.add(node)
        for t in _node_saved(node):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in param_ptrs or ptr in seen_ptrs:
                continue
            seen_ptrs.add(ptr)
            by[node.name()] += storage.nbytes()
        stack.extend(fn for fn, _ in node.next_functions)
    return dict(by.most_common())


class KernelCounter(TorchDispatchMode):
    """Counts the aten ops that reach a kernel (below autograd and composite decompositions) and Triton
    launches while active; aten ops inside a Triton launch (the interpreter's own host copies) are skipped."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()
        self.in_launch = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.in_launch and launches_kernel(func):
            self.ops[f"aten::{func.overloadpacket.__name__}"] += 1
        return func(*args, **(kwargs or {}))

    def totals(self) -> tuple[int, int]:
        """(aten kernels, triton launches)."""
        triton = sum(n for name, n in self.ops.items() if name.startswith("triton::"))
        return sum(self.ops.values()) - triton, triton


def launches_kernel(func) -> bool:
    """False for views, allocations and metadata ops (no device kernel)."""
    return not func.is_view and func.overloadpacket.__name__ not in NO_KERNEL


_COUNTERS: list = []


def wrap_triton_launches() -> None:
    """Count every interpreted Triton launch in the active :class:`KernelCounter` (once per process)."""
    from triton.runtime.interpreter import InterpretedFunction

    if getattr(InterpretedFunction.run, "_counted", False):
        return
    original = InterpretedFunction.run

    def run(self, *args, **kwargs):
        counter = _COUNTERS[-1] if _COUNTERS else None
        if counter is None:
            return original(self, *args, **kwargs)
        counter.ops[f"triton::{self.fn.__name__}"] += 1
        counter.in_launch += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            counter.in_launch -= 1

    run._counted = True
    InterpretedFunction.run = run


def count_kernels(run):
    """``(result of run(), KernelCounter)``."""
    counter = KernelCounter()
    _COUNTERS.append(counter)
    try:
        with counter:
            out = run()
    finally:
        _COUNTERS.pop()
    return out, counter


# ----------------------------------------------------------------------------------------------------- layers

class BTHLayer(torch.nn.Module):
    """A ``[b, t, h]`` layer (FLA) behind megatron's call convention: ``[s, b, h]`` in, ``(out, None)`` out."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x, attention_mask=None):
        return self.module(x.transpose(0, 1))[0].transpose(0, 1), None


def layer_args(hidden, gva, backend="eager"):
    """``benchmarks/layers.py``'s argument namespace for one shape: heads = hidden / 128 value heads, GVA halves
    the query/key heads."""
    value_heads = hidden // HEAD_DIM
    return SimpleNamespace(hidden=hidden, heads=value_heads // 2 if gva else value_heads, value_heads=value_heads,
                           head_dim=HEAD_DIM, backend=backend)


def build(kind, impl, hidden, gva, dtype):
    from benchmarks import layers as bl

    if kind == "mla":   # DeepSeek-V3's per-head dims (qk 128 + rope 64, v 128, kv latent 512), heads = hidden / 128
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        from hp_megatron.specs import get_mixer_spec
        from layers.mixers.mla.layer import MultiLatentAttention

        config = MLATransformerConfig(
            num_layers=1, hidden_size=hidden, num_attention_heads=hidden // HEAD_DIM, q_lora_rank=hidden // 2,
            kv_lora_rank=512, qk_head_dim=HEAD_DIM, qk_pos_emb_head_dim=64, v_head_dim=HEAD_DIM, rope_type="rope",
            use_cpu_initialization=True, params_dtype=dtype, gradient_accumulation_fusion=False,
            bias_dropout_fusion=False, add_bias_linear=False)
        if impl.endswith(RECOMPUTE):
            config.recompute_granularity, config.hp_recompute_modules = "selective", ("hp_mla_up_proj",)
        return MultiLatentAttention(config, get_mixer_spec("mla").submodules, layer_number=1)
    backend = impl.removesuffix(RECOMPUTE)
    args = layer_args(hidden, gva, backend=backend if backend in ("eager", "triton") else "eager")
    if backend in ("eager", "triton"):
        from layers import GatedDeltaNet, KimiDeltaAttention

        cls = GatedDeltaNet if kind == "gdn" else KimiDeltaAttention
        config = bl.transformer_config(args, dtype, torch.device("cpu"))
        if impl.endswith(RECOMPUTE):   # what hp_megatron.config makes of the flags (layers read these fields)
            config.recompute_granularity, config.hp_recompute_modules = "selective", RECOMPUTE_MODULES
        return cls(config, None, layer_number=1, backend=backend, **bl.dims(args))
    if impl == "fla":
        import fla.layers

        if kind == "gdn":
            module = fla.layers.GatedDeltaNet(hidden_size=hidden, expand_v=1, head_dim=HEAD_DIM, num_heads=args.heads,
                                              num_v_heads=args.value_heads, conv_size=4, norm_eps=1e-6)
        else:
            module = fla.layers.KimiDeltaAttention(hidden_size=hidden, expand_v=1, head_dim=HEAD_DIM,
                                                   num_heads=args.heads, num_v_heads=args.value_heads,
                                                   conv_size=4, norm_eps=1e-6)
        return BTHLayer(module.to(dtype))
    if impl == "mcore":
        return bl.build_mcore_gdn(args, dtype, torch.device("cpu"))
    if impl == "hf":
        if gva and kind == "kda":
            raise ValueError("Kimi Linear's KimiLinearDeltaAttention has one head count (no GVA)")
        ours = build(kind, "eager", hidden, gva, dtype)
        return bl.build_hf(kind, args, dtype, torch.device("cpu"), ours.global_parts(), bl.dims(args))
    raise ValueError(f"unknown implementation {impl!r}")


def measure(kind, impl, hidden, gva, dtype, T, breakdown, forward_only=False):
    row = dict(kind=kind, impl=impl, hidden=hidden, gva=gva, dtype=str(dtype).replace("torch.", ""), T=T)
    try:
        layer = build(kind, impl, hidden, gva, dtype)
        row["heads"] = layer_args(hidden, gva).heads
        gen = torch.Generator().manual_seed(0)
        x = (torch.randn(T, 1, hidden, generator=gen) * 0.5).to(dtype)
        dy = torch.randn(T, 1, hidden, generator=gen).to(dtype)
        params = list(layer.parameters())

        def forward():
            return layer(x.detach().requires_grad_(True), None)[0]

        if impl in WARM_UP:   # Python-level caches (chunk layouts) build on first call; interpreter rows: see doc
            (forward().float() * dy.float()).sum().backward()
            layer.zero_grad(set_to_none=True)
        (total, by_node, y), fwd = count_kernels(lambda: saved_bytes(forward, params))
        row["saved_bytes_per_token"] = total / T
        if breakdown:
            row["saved_by_node"] = by_node
        (fwd_aten, fwd_triton) = fwd.totals()
        row.update(fwd_aten=fwd_aten, fwd_triton=fwd_triton)
        if breakdown:
            row["fwd_ops"] = dict(fwd.ops.most_common())
        if forward_only:   # saved bytes are complete after the forward; backward kernels stay unmeasured
            del y
            print(f"  {kind} {impl:6s} h{hidden} gva={gva} {row['dtype']}: {row['saved_bytes_per_token'] / 1e3:7.1f} "
                  f"kB/token, kernels fwd {fwd_aten}+{fwd_triton} (forward only)", flush=True)
            return row
        loss = (y.float() * dy.float()).sum()
        del y
        _, bwd = count_kernels(loss.backward)
        bwd_aten, bwd_triton = bwd.totals()
        row.update(bwd_aten=bwd_aten, bwd_triton=bwd_triton, kernels=fwd_aten + fwd_triton + bwd_aten + bwd_triton)
        if breakdown:
            row["bwd_ops"] = dict(bwd.ops.most_common())
        print(f"  {kind} {impl:6s} h{hidden} gva={gva} {row['dtype']}: {row['saved_bytes_per_token'] / 1e3:7.1f} "
              f"kB/token, kernels fwd {fwd_aten}+{fwd_triton} bwd {bwd_aten}+{bwd_triton}", flush=True)
    except Exception as err:  # recorded in the table; the other rows still run
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
        print(f"  {kind} {impl:6s} h{hidden} gva={gva}: cannot run: {row['error']}", flush=True)
        if os.environ.get("LAYER_MEMORY_VERBOSE"):
            traceback.print_exc()
    return row


# ----------------------------------------------------------------------------------------------------- DSA rows

# small heads so that T = 64K runs on a CPU: 2 attention heads (qk 32 + rope 16, v 32, latent 64), indexer 4 x 32,
# top-k 512; fp32, B 1, TP = CP = 1, our eager path
DSA_SHAPE = dict(hidden=256, heads=2, q_lora_rank=64, kv_lora_rank=64, qk=32, pe=16, v=32, index_heads=4,
                 index_dim=32, topk=512)


def build_dsa_or_mla(kind: str):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from hp_megatron.specs import get_mixer_spec
    from layers.mixers.mla.dsa import DSAttention
    from layers.mixers.mla.layer import MultiLatentAttention

    d = DSA_SHAPE
    config = MLATransformerConfig(
        num_layers=1, hidden_size=d["hidden"], num_attention_heads=d["heads"], q_lora_rank=d["q_lora_rank"],
        kv_lora_rank=d["kv_lora_rank"], qk_head_dim=d["qk"], qk_pos_emb_head_dim=d["pe"], v_head_dim=d["v"],
        rope_type="rope", use_cpu_initialization=True, params_dtype=torch.float32, gradient_accumulation_fusion=False,
        bias_dropout_fusion=False, add_bias_linear=False, dsa_indexer_n_heads=d["index_heads"],
        dsa_indexer_head_dim=d["index_dim"], dsa_indexer_topk=d["topk"])
    cls = DSAttention if kind == "dsa" else MultiLatentAttention
    return cls(config, get_mixer_spec(kind).submodules, layer_number=1)


DENSE_MAX_T = 4096   # our dense MLA's eager attention saves [heads, T, T] fp32 probabilities: not run beyond


def _memory_of_forward(run) -> tuple:
    """``(peak, retained)``: the peak of PyTorch's running total of allocated CPU bytes during ``out = run()`` and the
    total still allocated at its end while ``out`` (with its autograd graph) is alive, both above what existed before
    (``benchmarks/_common.cpu_memory_of``)."""
    from benchmarks._common import cpu_memory_of

    _, peak, retained = cpu_memory_of(run)
    return peak, retained


def dsa_rows(seq_lengths) -> list:
    """Per T and layer (our DSA, our dense MLA up to :data:`DENSE_MAX_T`): bytes kept after one forward for its
    backward (the autograd graph and everything it holds, including the output and what recomputing blocks keep as
    inputs) and the forward's peak, each per token."""
    rows = []
    for T in seq_lengths:
        for kind in ("dsa", "mla"):
            if kind == "mla" and T > DENSE_MAX_T:
                d = DSA_SHAPE
                rows.append(dict(kind=kind, T=T, skipped=f"saves {d['heads']} x T x T fp32 probabilities "
                                                         f"({d['heads'] * T * T * 4 / 2**30:.1f} GiB)"))
                continue
            torch.manual_seed(0)
            layer = build_dsa_or_mla(kind)
            x = torch.randn(T, 1, DSA_SHAPE["hidden"]) * 0.5
            peak, retained = _memory_of_forward(
                lambda layer=layer, x=x: layer(x.detach().requires_grad_(True), None)[0])
            rows.append(dict(kind=kind, T=T, retained_bytes_per_token=retained / T,
                             forward_peak_bytes_per_token=peak / T))
            print(f"  {kind} T={T}: kept {retained / T / 1e3:.2f} kB/token, forward peak {peak / T / 1e3:.2f} "
                  "kB/token", flush=True)
    return rows


def dsa_markdown(rows, meta) -> str:
    d = DSA_SHAPE
    lines = [f"Command: `{meta['command']}`", "",
             f"CPU, fp32, torch {meta['torch']}, megatron-core {meta['megatron_core']}; one layer, B 1, TP = CP = 1, "
             f"eager. Shape: hidden {d['hidden']}, {d['heads']} heads (qk {d['qk']} + rope {d['pe']}, v {d['v']}), "
             f"q / kv latent {d['q_lora_rank']} / {d['kv_lora_rank']}; DSA indexer {d['index_heads']} heads x "
             f"{d['index_dim']}, top-k {d['topk']}. Kept: CPU bytes still allocated after one forward while its output "
             "and autograd graph live (what backward needs, the output included) / T; forward peak: the peak of "
             "PyTorch's allocated CPU bytes during that forward / T; both above what existed before it "
             "(torch.profiler memory events; `dsa_rows`).", "",
             "| layer | T | kept for backward kB/token | forward peak kB/token |", "|---|---|---|---|"]
    for r in rows:
        name = "DSA (ours)" if r["kind"] == "dsa" else "dense MLA (ours)"
        if "skipped" in r:
            lines.append(f"| {name} | {r['T']} | not run: {r['skipped']} | - |")
            continue
        lines.append(f"| {name} | {r['T']} | {r['retained_bytes_per_token'] / 1e3:.2f} | "
                     f"{r['forward_peak_bytes_per_token'] / 1e3:.2f} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------- output

RECOMPUTE = "+recompute"
RECOMPUTE_MODULES = ("hp_conv", "hp_gated_norm")   # the GDN/KDA parts; MLA rows recompute hp_mla_up_proj
WARM_UP = ("eager", "hf", "eager" + RECOMPUTE)   # rows without Triton kernels (cheap); see the module docstring
IMPLS = {"gdn": ("triton", "triton" + RECOMPUTE, "eager", "eager" + RECOMPUTE, "fla", "mcore", "hf"),
         "kda": ("triton", "triton" + RECOMPUTE, "eager", "eager" + RECOMPUTE, "fla", "hf"),
         "mla": ("eager", "eager" + RECOMPUTE)}   # ours only (MLA has no delta-rule backend; FLA has no MLA layer)
NAMES = {"triton": "ours (triton)", "eager": "ours (eager)", "triton" + RECOMPUTE: "ours (triton) + recompute",
         "eager" + RECOMPUTE: "ours (eager) + recompute", "fla": "FLA 0.6 layer",
         "mcore": "megatron-core GatedDeltaNet", "hf": "transformers (pure PyTorch)"}


def _covers(command: str):
    """Predicate: does the measuring ``command`` (``python benchmarks/layer_memory.py ARGS``) produce this row?"""
    args = _parser().parse_args(shlex.split(command)[2:])
    return lambda r: (r["kind"] in args.kinds and r["hidden"] in args.hidden and r["dtype"] in args.dtypes
                      and ("yes" if r["gva"] else "no") in args.gva and (args.impls is None or r["impl"] in args.impls))


def merge(paths) -> dict:
    """One result from several ``--json`` files: rows keyed by (layer, implementation, shape), later files win,
    in main()'s loop order; the other metadata of the last file (same software versions required). The commands:
    those that measured a row of the result (each row taken from the last command, in file order, whose options
    cover it), so that a command whose rows were all measured again later drops out."""
    rows, metas = {}, []
    for path in paths:
        result = json.loads(Path(path).read_text(encoding="utf-8"))
        metas.append(result["meta"])
        for row in result["rows"]:
            rows[(row["kind"], row["impl"], row["hidden"], row["gva"], row["dtype"])] = row
    versions = ("torch", "megatron_core", "transformers", "fla", "triton", "T")
    if any(tuple(m.get(v) for v in versions) != tuple(metas[-1].get(v) for v in versions) for m in metas):
        raise ValueError(f"--merge: the files were measured with different {versions}: "
                         f"{[tuple(m.get(v) for v in versions) for m in metas]}")
    dtypes = ("float32", "bfloat16")
    order = lambda r: (dtypes.index(r["dtype"]), r["hidden"], r["gva"], r["kind"],   # noqa: E731
                       IMPLS[r["kind"]].index(r["impl"]))
    commands = []
    for m in metas:   # a merged file's command is already a "` + `" list; the --json paths are the inputs here
        commands += [c for c in (re.sub(r" --json \S+", "", c) for c in m["command"].split("` + `"))]
    covers = [_covers(c) for c in commands]
    used = {max(i for i, cover in enumerate(covers) if cover(r)) for r in rows.values()}
    kept = [c for i, c in enumerate(commands) if i in used and c not in commands[i + 1:]]
    return dict(meta=dict(metas[-1], command="` + `".join(kept)), rows=sorted(rows.values(), key=order))


def markdown(rows, meta) -> str:
    lines = [f"Command: `{meta['command']}`", "",
             f"CPU, FLA's Triton kernels through Triton's interpreter; torch {meta['torch']}, megatron-core "
             f"{meta['megatron_core']}, transformers {meta['transformers']}, flash-linear-attention {meta['fla']}, "
             f"triton {meta['triton']}. One layer, B 1, T {meta['T']}, K = V = {HEAD_DIM}, value heads = hidden / "
             f"{HEAD_DIM}; GVA: half as many query/key heads (KDA layers without GVA support: error row). "
             "kB/token: unique non-parameter storages saved for backward (input included) / tokens. Kernels: leaf "
             "aten ops that launch a kernel + Triton launches, forward and backward (module docstring of "
             "`benchmarks/layer_memory.py`). Ratios: saved bytes relative to ours (triton) and to FLA's layer at the "
             "same shape; + recompute: `--recompute-modules hp_conv hp_gated_norm`; megatron-core's `@jit_fuser` "
             "helpers run uncompiled here.", "",
             "| layer | hidden | heads qk/v | dtype | implementation | saved kB/token | vs ours (triton) | "
             "vs FLA layer | kernels fwd (aten+triton) | kernels bwd (aten+triton) | kernels fwd+bwd |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def per_shape(impl):
        return {(r["kind"], r["hidden"], r["gva"], r["dtype"]): r.get("saved_bytes_per_token")
                for r in rows if r["impl"] == impl}

    bases = (per_shape("triton"), per_shape("fla"))
    for r in rows:
        heads = f"{layer_args(r['hidden'], r['gva']).heads}/{r['hidden'] // HEAD_DIM}"
        head = f"| {r['kind'].upper()} | {r['hidden']} | {heads} | {r['dtype']} | {NAMES[r['impl']]} |"
        if "error" in r:
            lines.append(f"{head} cannot run here: {r['error']} | - | - | - | - | - |")
            continue
        refs = (base.get((r["kind"], r["hidden"], r["gva"], r["dtype"])) for base in bases)
        ratios = " | ".join(f"{r['saved_bytes_per_token'] / ref:.2f}x" if ref else "-" for ref in refs)
        bwd = f"{r['bwd_aten']}+{r['bwd_triton']} | {r['kernels']}" if "kernels" in r else "not measured | -"
        lines.append(f"{head} {r['saved_bytes_per_token'] / 1e3:.1f} | {ratios} | {r['fwd_aten']}+{r['fwd_triton']} | "
                     f"{bwd} |")
    return "\n".join(lines)


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"])
    parser.add_argument("--gva", nargs="+", choices=("no", "yes"), default=["no", "yes"])
    parser.add_argument("--kinds", nargs="+", choices=("gdn", "kda", "mla"), default=["gdn", "kda"],
                        help="mla: our MLA layer with and without hp_mla_up_proj recompute")
    parser.add_argument("--impls", nargs="+", choices=sorted(NAMES), default=None, help="default: all")
    parser.add_argument("--T", type=int, default=64, help="tokens (B = 1)")
    parser.add_argument("--breakdown", action="store_true", help="per-node saved bytes and per-op kernel counts")
    parser.add_argument("--forward-only", action="store_true",
                        help="saved bytes and forward kernels only (no backward: a third of the interpreter's time)")
    parser.add_argument("--merge", nargs="+", type=Path, default=None, metavar="JSON",
                        help="publish the rows of these --json files as one table (measures nothing)")
    parser.add_argument("--dsa-seq-lengths", type=int, nargs="+", default=None, metavar="T",
                        help="measure only the DSA vs dense MLA table at these sequence lengths (docs section "
                             "dsa_memory)")
    parser.add_argument("--docs-section", default="layer_memory",
                        help="section of docs/benchmarks.md (and docs/NAME.json) --write-docs replaces")
    add_output_args(parser)
    return parser


def main(argv=None):
    args = _parser().parse_args(argv)
    if args.write_docs and args.json is None:
        args.json = DOCS_JSON.with_name(f"{args.docs_section}.json")
    if args.dsa_seq_lengths:
        with single_rank_megatron(0):
            meta = run_meta("layer_memory.py", argv)
            rows = dsa_rows(args.dsa_seq_lengths)
        publish(dict(meta=meta, rows=rows), dsa_markdown(rows, meta), args, "dsa_memory", "### Measured")
        return
    if args.merge:
        result = merge(args.merge)
        publish(result, markdown(result["rows"], result["meta"]), args, args.docs_section, "### Measured")
        return
    reason = triton_interpreter.available()
    if reason is not None:
        raise RuntimeError(f"benchmarks/layer_memory.py runs FLA's kernels through Triton's interpreter: {reason}")
    wrap_triton_launches()
    import fla
    import triton

    torch.manual_seed(0)
    with single_rank_megatron(0):
        meta = dict(run_meta("layer_memory.py", argv), fla=fla.__version__, triton=triton.__version__, T=args.T)
        rows = []
        for dtype in args.dtypes:
            for hidden in args.hidden:
                for gva in args.gva:
                    for kind in args.kinds:
                        for impl in IMPLS[kind]:
                            if args.impls is None or impl in args.impls:
                                rows.append(measure(kind, impl, hidden, gva == "yes", getattr(torch, dtype),
                                                    args.T, args.breakdown, args.forward_only))
        # the section's heading and the before/after notes stand above the markers in docs/benchmarks.md
        publish(dict(meta=meta, rows=rows), markdown(rows, meta), args, args.docs_section, "### Measured")


if __name__ == "__main__":
    main()
