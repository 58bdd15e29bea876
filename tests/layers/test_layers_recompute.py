"""Selective recompute of our mixer parts (``--recompute-granularity selective --recompute-modules hp_conv
hp_gated_norm hp_mla_up_proj``; layers/shared/recompute.py): the GDN / KDA / MLA layer with recompute must give the same
output, input gradient and every parameter gradient as the same layer without, bit for bit (fp32, CPU): the recompute
re-runs the same ops on the same saved inputs. Single rank (BSHD and packed THD documents; eager, and triton through
Triton's interpreter) and on two gloo ranks under TP2 + SP and CP2 (MLA: TP2 + SP; its recompute is CP 1 only). On the
triton backend ``hp_conv`` also moves q/k's L2 norm from FLA's op into the recomputed part (FLA's own l2norm kernel, the
op then without ``use_qk_l2norm_in_kernel``): checked single rank on packed documents and under CP2 on both triton CP
paths (FLA's own KCP for allgather on a contiguous packed sequence, FLA's kernels with our exchange for p2p zigzag).
Also: the refill of a freed output by a storage pointer swap (no copy) with the part's own graph still exact, the
same with the copy fallback of torches without the swap (on the part and on each layer), the config / command-line split
of our names from megatron-core's, and the one-line error for bad names.
"""
from __future__ import annotations

import argparse

import pytest
import torch

from tests.support import triton_interpreter
from tests.support.delta_layer_cases import DIMS, HALF_HEADS, HIDDEN, SEQ, build_layer, groups
from tests.support.dist import run_distributed
from tests.support.mla_layer import build_layer as build_mla
from tests.support.mla_layer import make_config as mla_config
from tests.support.reference import rel_err

OURS = ["hp_conv", "hp_gated_norm"]


def _config(tp, cp, sp, recompute):
    from hp_megatron.config import HybridTransformerConfig

    extra = dict(recompute_granularity="selective", recompute_modules=list(OURS)) if recompute else {}
    return HybridTransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4,
                                   use_cpu_initialization=True, params_dtype=torch.float32,
                                   gradient_accumulation_fusion=False, bias_dropout_fusion=False,
                                   tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp,
                                   **extra)


def _run(kind, tp, cp, sp, recompute, x, dy, packed=None, backend="eager", cp_options=None):
    """Output, input gradient and parameter gradients of a freshly built layer (same seed every call)."""
    torch.manual_seed(5)
    tp_group, cp_group = groups(tp, cp)
    layer = build_layer(kind, tp_group, cp_group, _config(tp, cp, sp, recompute),
                        dict(cp_options or {"cp_method": "allgather"}, backend=backend))
    assert (layer.recompute_conv, layer.recompute_norm) == (recompute, recompute)
    assert (layer._part_l2norm is not None) == (recompute and backend == "triton")
    x = x.clone().requires_grad_(True)
    y, _ = layer(x, packed_seq_params=packed)
    y.backward(dy)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return y.detach(), x.grad, grads


def _run_mla(tp, sp, recompute, x, dy):
    torch.manual_seed(5)
    config = mla_config(tp=tp, sequence_parallel=sp)
    if recompute:   # the fields hp_megatron.config makes of the flags (the layer reads them)
        config.recompute_granularity, config.hp_recompute_modules = "selective", ("hp_mla_up_proj",)
    layer = build_mla(config, *groups(tp, 1))
    assert layer.recompute_up_proj == recompute
    x = x.clone().requires_grad_(True)
    y, _ = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def _compare(kind, tp, cp, sp, x, dy, packed=None, backend="eager", cp_options=None):
    """Names of the results that differ between recompute and no recompute (empty: identical)."""
    if kind == "mla":
        ref, got = _run_mla(tp, sp, False, x, dy), _run_mla(tp, sp, True, x, dy)
    else:
        ref = _run(kind, tp, cp, sp, False, x, dy, packed, backend, cp_options)
        got = _run(kind, tp, cp, sp, True, x, dy, packed, backend, cp_options)
    diff = [name for name, a, b in (("out", ref[0], got[0]), ("x_grad", ref[1], got[1])) if not torch.equal(a, b)]
    assert sorted(ref[2]) == sorted(got[2])
    return diff + [n for n in ref[2] if not _same(kind, n, ref[2][n], got[2][n])]


def _same(kind, name, a, b):
    """Bit-equal, except MLA's latent-norm weight gradient: a sum over tokens of the latent's gradient, which
    arrives through the recompute as a fresh contiguous tensor instead of a strided one, so the reduction adds in
    another order (observed 3.7e-9 on 0.04: one fp32 ulp, i.e. ~1e-7 relative)."""
    if kind == "mla" and name == "kv_layernorm.weight":
        return rel_err(b, a) <= 1e-6
    return torch.equal(a, b)


def _inputs(seq, batch):
    gen = torch.Generator().manual_seed(3)
    return torch.randn(seq, batch, HIDDEN, generator=gen), torch.randn(seq, batch, HIDDEN, generator=gen)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("thd", [False, True])
def test_recompute_is_exact_single_rank(single_rank, kind, thd):
    x, dy = _inputs(SEQ, 1 if thd else 2)
    assert _compare(kind, 1, 1, False, x, dy, _packed_docs() if thd else None) == []


def _packed_docs():
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, 16, 24, SEQ], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=24, max_seqlen_kv=24)


# CP2 cases of the triton backend: (cp options, packed documents) per kind, one per CP path of layers/cp/triton.py
TRITON_CP2 = {"gdn": ({"cp_method": "allgather", "cp_layout": "contiguous"}, True),   # FLA's own KCP
              "kda": ({"cp_method": "p2p", "cp_layout": "zigzag"}, False)}          # FLA's kernels, our exchange


def _cp2_index(layout, rank):
    if layout == "contiguous":
        return torch.arange(rank * SEQ // 2, (rank + 1) * SEQ // 2)
    zig = SEQ // 4   # zigzag: chunks rank and 3 - rank
    return torch.cat([torch.arange(c * zig, (c + 1) * zig) for c in (rank, 3 - rank)])


def _triton_worker(rank, world):
    """Two ranks with Triton's interpreter on before FLA is imported: the triton backend's layers under CP2, then
    single rank on packed documents (GDN on rank 0, KDA on rank 1)."""
    triton_interpreter.enable()   # before megatron-core, which imports triton
    from megatron.core import parallel_state

    from hp_megatron.platform import apply_cpu_shims
    from hp_megatron.selfcheck.gloo import accept_stacked_all_gather_on_gloo

    accept_stacked_all_gather_on_gloo()
    parallel_state.initialize_model_parallel(1, 1)
    for layout in ((1, 1), (1, 2)):
        groups(*layout)
    apply_cpu_shims(2024)
    x, dy = _inputs(SEQ, 1)
    results = {}
    for kind, (options, thd) in TRITON_CP2.items():
        index = _cp2_index(options["cp_layout"], rank)
        results[f"{kind}-cp2-{options['cp_method']}"] = _compare(
            kind, 1, 2, False, x[index], dy[index], _packed_docs() if thd else None, "triton",
            {**options, **HALF_HEADS[kind]})
    kind = ("gdn", "kda")[rank]
    results[f"{kind}-packed"] = _compare(kind, 1, 1, False, x, dy, _packed_docs(), "triton",
                                         {"cp_method": "allgather", **HALF_HEADS[kind]})
    parallel_state.destroy_model_parallel()
    return results


@pytest.mark.skipif(triton_interpreter.available() is not None,
                    reason=f"triton interpreter: {triton_interpreter.available()}")
def test_recompute_is_exact_triton_backend_packed_and_cp2():
    cp2 = {f"{kind}-cp2-{options['cp_method']}": [] for kind, (options, _) in TRITON_CP2.items()}
    for rank, results in enumerate(run_distributed(_triton_worker, 2)):
        assert results == {**cp2, f"{('gdn', 'kda')[rank]}-packed": []}, (rank, results)


def test_mla_up_proj_recompute_is_exact_single_rank(single_rank):
    x, dy = _inputs(SEQ, 2)
    assert _compare("mla", 1, 1, False, x, dy) == []


def test_recompute_frees_the_parts_outputs(single_rank):
    """With recompute the layer keeps fewer bytes for backward (the conv output and the norm output are freed)."""
    x, _ = _inputs(SEQ, 2)
    held = {}
    for recompute in (False, True):
        torch.manual_seed(5)
        layer = build_layer("gdn", *groups(1, 1), _config(1, 1, False, recompute), {})
        params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        storages = {}

        def pack(t, params=params, storages=storages):
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                storages[s.data_ptr()] = s
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y, _ = layer(x.clone().requires_grad_(True))
        held[recompute] = sum(s.nbytes() for s in storages.values())
        del y
    conv_out = SEQ * 2 * (2 * 4 * 8 + 8 * 8) * 4   # [s, b, 2 K_dim + V_dim] fp32, DIMS["gdn"]
    norm_out = SEQ * 2 * 8 * 8 * 4
    assert DIMS["gdn"]["num_key_heads"] == 4 and DIMS["gdn"]["num_value_heads"] == 8
    assert held[False] - held[True] >= conv_out + norm_out - SEQ * 2 * HIDDEN * 4, held


@pytest.mark.parametrize("swap", [True, False], ids=["pointer_swap", "copy_fallback"])
def test_part_refill_moves_no_bytes_and_its_graph_keeps_the_output(monkeypatch, swap):
    """The refill gives the freed storage the recomputed output's memory (no copy kernel where torch has the
    storage pointer swap); the part's own recomputed graph saved that output (exp keeps its result) and still
    backpropagates it exactly; after backward the kept output holds its values again. ``copy_fallback`` forces the
    path of a torch without the swap (``layers.base.compat.STORAGE_SWAP`` False: resize and copy)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from layers.base import compat
    from layers.shared.recompute import PartRecompute

    if swap and not compat.STORAGE_SWAP:
        pytest.skip(f"torch {torch.__version__} has no UntypedStorage._swap_data_ptr_")
    monkeypatch.setattr(compat, "STORAGE_SWAP", swap)

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(7)
    x0, w, dz = (torch.randn(8, 4, generator=gen) for _ in range(3))
    x = x0.clone().requires_grad_(True)
    part = PartRecompute()
    y = part.run(torch.exp, x)
    z = y * w   # keeps y for its backward
    part.discard(z)
    assert y.untyped_storage().nbytes() == 0
    ops = Ops()
    with ops:
        z.backward(dz)
    x_ref = x0.clone().requires_grad_(True)
    (torch.exp(x_ref) * w).backward(dz)
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(y.detach(), torch.exp(x0))
    assert ("copy_" in ops.names) == (not swap), ops.names


@pytest.mark.parametrize("kind", ["gdn", "kda", "mla"])
def test_recompute_is_exact_with_the_copy_fallback(single_rank, monkeypatch, kind):
    """The layers' recompute on the path of a torch without the storage pointer swap (torch 2.6, setup.py's floor:
    the freed outputs are refilled by a copy) gives the same output and gradients as no recompute, bit for bit."""
    from layers.base import compat

    monkeypatch.setattr(compat, "STORAGE_SWAP", False)
    x, dy = _inputs(SEQ, 2)
    assert _compare(kind, 1, 1, False, x, dy) == []


def _worker(rank, world_size):
    from megatron.core import parallel_state

    from hp_megatron.platform import apply_cpu_shims

    parallel_state.initialize_model_parallel(1, 1)  # megatron's global buffers (SP all-gather); groups are ours
    for layout in ((1, 1), (2, 1), (1, 2)):
        groups(*layout)
    apply_cpu_shims(2024)
    x, dy = _inputs(SEQ, 2)
    tokens = SEQ // 2
    results = {}
    for kind in ("gdn", "kda"):   # TP2 + SP: each rank holds half the sequence
        part = slice(rank * tokens, (rank + 1) * tokens)
        results[f"{kind}-tp2-sp"] = _compare(kind, 2, 1, True, x[part], dy[part])
        zig = SEQ // 4   # CP2, zigzag: chunks rank and 3 - rank
        index = torch.cat([torch.arange(c * zig, (c + 1) * zig) for c in (rank, 3 - rank)])
        results[f"{kind}-cp2"] = _compare(kind, 1, 2, False, x[index], dy[index])
    part = slice(rank * tokens, (rank + 1) * tokens)
    results["mla-tp2-sp"] = _compare("mla", 2, 1, True, x[part], dy[part])
    parallel_state.destroy_model_parallel()
    return results


def test_recompute_is_exact_tp2_sp_and_cp2():
    for rank, results in enumerate(run_distributed(_worker, 2)):
        expected = {f"{k}-{c}": [] for k in ("gdn", "kda") for c in ("tp2-sp", "cp2")}
        assert results == {**expected, "mla-tp2-sp": []}, (rank, results)


def test_recompute_names_split_from_megatron():
    from hp_megatron.config import split_recompute_modules

    args = argparse.Namespace(recompute_modules=["core_attn", "hp_conv", "hp_gated_norm"])
    split_recompute_modules(args)
    assert args.recompute_modules == ["core_attn"] and args.hp_recompute_modules == ("hp_conv", "hp_gated_norm")
    config = _config(1, 1, False, True)
    assert config.recompute_modules == [] and config.hp_recompute_modules == tuple(OURS)
    # megatron-core 0.19's name for its GDN's output-norm recompute is our layers' gated norm
    args = argparse.Namespace(recompute_modules=["gdn_norm_out", "mlp"])
    split_recompute_modules(args)
    assert args.recompute_modules == ["mlp"] and args.hp_recompute_modules == ("hp_gated_norm",)


def test_bad_recompute_name_is_one_line():
    from hp_megatron.config import split_recompute_modules

    with pytest.raises(ValueError) as err:
        split_recompute_modules(argparse.Namespace(recompute_modules=["hp_conv", "conv"]))
    message = str(err.value)
    assert "\n" not in message and "conv" in message
    for name in ("core_attn", "mla_up_proj", "hp_conv", "hp_gated_norm", "hp_mla_up_proj", "gdn_norm_out"):
        assert name in message
