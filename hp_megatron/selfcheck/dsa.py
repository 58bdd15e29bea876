"""Self-check rows of DSA (DeepSeek Sparse Attention, ``layers/mixers/mla/sparse.py``): its one path is eager PyTorch
on whatever device runs the check, so the rows compare that path on the device in the checked dtype with itself in
fp32 on the host CPU (identical by construction when the check itself runs on the CPU in fp32): the indexer scores
(``scores``), the sparse attention over the fp32 run's selection (``fwd``: top-k is discontinuous, so both runs attend
to the same tokens) and its gradients (``bwd``); packed documents, causal top-k."""
from __future__ import annotations

import torch

from hp_megatron.selfcheck.report import Row, error_rows
from layers.mixers.mla.sparse import index_scores, select_topk, sparse_attention

OP = "dsa_sparse_attention"
CASE = "T=48 2 docs k=8 H=4 Hi=4"


def dsa_rows(device, dtype):
    try:
        gen = torch.Generator().manual_seed(21)
        T, H, dq, dv, Hi, d, k = 48, 4, 24, 16, 4, 16, 8
        cu = torch.tensor([0, 20, 48])
        base = {"iq": torch.randn(1, T, Hi, d, generator=gen), "iw": torch.randn(1, T, Hi, generator=gen),
                "ik": torch.randn(1, T, d, generator=gen), "q": torch.randn(1, T, H, dq, generator=gen),
                "key": torch.randn(1, T, H, dq, generator=gen), "value": torch.randn(1, T, H, dv, generator=gen)}
        dout = torch.randn(1, T, H, dv, generator=gen)
        topk = select_topk(base["iq"], base["iw"], base["ik"], k, cu_seqlens=cu)     # fp32 on the host
        results = []
        for run_device, run_dtype in ((device, dtype), (torch.device("cpu"), torch.float32)):
            x = {n: t.to(run_device, run_dtype).requires_grad_(n in ("q", "key", "value")) for n, t in base.items()}
            scores = index_scores(x["iq"], x["iw"], x["ik"])
            out = sparse_attention(x["q"], x["key"], x["value"], topk.to(run_device), scale=dq ** -0.5, block_size=16)
            grads = torch.autograd.grad((out.float() * dout.to(run_device)).sum(), [x["q"], x["key"], x["value"]])
            results.append((scores.detach(), out.detach(), dict(zip(("dq", "dkey", "dvalue"), grads))))
    except Exception as error:  # noqa: BLE001 - a row per failure, the check goes on
        return error_rows(OP, CASE, ("scores", "fwd", "bwd"), dtype, error)
    (s, o, g), (s_ref, o_ref, g_ref) = results
    from hp_megatron.selfcheck.report import rel_err

    return [Row(OP, CASE, "scores", dtype, {"index_scores": rel_err(s, s_ref)}).judge(),
            Row(OP, CASE, "fwd", dtype, {"o": rel_err(o, o_ref)}).judge(),
            Row(OP, CASE, "bwd", dtype, {n: rel_err(g[n], g_ref[n]) for n in g_ref}).judge()]
