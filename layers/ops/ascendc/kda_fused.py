"""KDA backward on Ascend 910B / 910_93 (A2 / A3) through fla-npu's monolithic ``chunk_kda_bwd``, where the staged
backward (``ChunkKdaBwdPrepare`` / ``ChunkKdaBwdFinalize``) does not run (their op-defs register ascend950 only).

The op-def ``ChunkKdaBwd`` registers ascend910b, ascend910_93 and ascend950 (7a8a59a3, the head of PR #334,
``fla/ops/ascendc/kda/chunk_kda_bwd/op_host/chunk_kda_bwd_def.cpp``); the wrapper contract is the undated
``_stable.py`` version returning 8 slots ``(dq, dk, dv, db, dg, dh0, dA, dbias)``, checked as 7a8a59a3's
``_aclnn_ctypes.py`` checks it. What it takes, and what that costs here:

- the forward's saved tensors (``disable_recompute=True`` only): this backend's forward already keeps them (the
  staged prepare in "save" mode, ``chunk_fwd_h``), head-major; h chunk-first ``[B, NT, H, K, V]`` (packed
  ``[NT, H, K, V]``), transposed here when a build returns head-first chunk states;
- no ``initial_state`` / ``dht`` ("not supported by the current fused backward"): a call that needs either is
  refused up front (:func:`check_fused_backward`), and so are the state-passing CP methods, whose local runs
  need both; Ulysses (heads re-sharded, the single-rank path on full sequences) runs;
- ``safe_gate=True`` only (the kernel assumes the lower-bounded gate): other gates are refused;
- one head count for q, k and v: with GVA the q / k heads are repeated to HV and their gradients summed back
  (one copy of q / k per backward);
- no q/k L2-norm backward in the plain launch (the rstd inputs belong to an "optimized" launch whose selection
  policy was not read): the L2 norm, the beta sigmoid and the gate then run in PyTorch before the kernels
  (autograd differentiates them), as GDN's do off Ascend 950.
"""
from __future__ import annotations

import torch

from layers.ops.ascendc import runtime
from layers.ops.gates import kda_gate, l2norm

_OP = "chunk_kda_bwd"


def check_fused_backward(device_name: str, initial_state, safe_gate: bool, what: str = "this call") -> None:
    """One RuntimeError up front when a KDA call needing gradients off Ascend 950 asks for what the monolithic
    backward cannot take."""
    problems = []
    if initial_state is not None:
        problems.append("an initial_state")
    if not safe_gate:
        problems.append("safe_gate=False")
    if problems:
        raise RuntimeError(f"backend='ascendc' on {device_name}: KDA backward there is fla-npu's monolithic "
                           f"ChunkKdaBwd (ChunkKdaBwdPrepare / Finalize register Ascend950 only), which takes no "
                           f"initial_state / dht and safe_gate=True only; {what} has {' and '.join(problems)}: use "
                           "safe_gate=True with lower_bound, CP method 'ulysses' instead of state passing, "
                           "Ascend 950, or backend='eager'")


def _chunk_first(h, n_chunks: int, heads: int):
    """Chunk states in the build's layout -> chunk-first ``[B, NT, HV, K, V]`` (what the fused op checks)."""
    if n_chunks != heads and tuple(h.shape[1:3]) == (heads, n_chunks):
        return h.transpose(1, 2).contiguous()
    return h


def fused_backward(ops, saved, do_hm, meta):
    """(dq, dk, dv token-major per meta["layout"], dbeta [..,HV,T], dg [..,HV,T,K]) from the saved forward tensors
    of ``AscendCKimiDeltaAttention`` and the head-major upstream gradient ``do_hm``."""
    packed, cu = meta["packed"], meta["cu"]
    v_hm = saved["v_hm"]
    HV, H = v_hm.shape[-3], saved["q_hat"].shape[-3]
    group = HV // H
    head = -3
    q, k = (saved[n].repeat_interleave(group, dim=head) if group > 1 else saved[n] for n in ("q_hat", "k_hat"))
    n_chunks = len(meta["chunk_indices"]) // 2 if packed else -(-v_hm.shape[-2] // runtime.CHUNK)
    h = _chunk_first(saved["h"], n_chunks, HV)                       # rank 5; packed runs have B = 1
    h = h[0] if packed else h
    result = getattr(ops, _OP)(
        q, k, v_hm, saved["beta_eff"], saved["gk"], saved["Aqk"], saved["Akk"], saved["w"], saved["qg"],
        saved["kg"], saved["v_new"], h, do_hm.to(v_hm.dtype), meta["scale"], raw_g=None, A_log=None, dt_bias=None,
        initial_state=None, dht=None, cu_seqlens=cu, chunk_indices=meta["chunk_indices"], chunk_size=runtime.CHUNK,
        safe_gate=True, lower_bound=meta["lower_bound"], use_gate_in_kernel=False, disable_recompute=True,
        use_exp2=True, state_v_first=False)
    dq, dk, dv, dbeta, dg, _, _, _ = runtime.slots(_OP, result, 8, (0, 1, 2, 3, 4))
    if group > 1:
        dq, dk = (x.unflatten(head, (H, group)).sum(head) for x in (dq, dk))
    token_major = (lambda x: x.transpose(0, 1)) if packed else (lambda x: x.transpose(1, 2))
    return token_major(dq), token_major(dk), token_major(dv), dbeta, dg


def pre_transforms(q, k, beta, g, A_log, dt_bias, lower_bound, l2norm_in_kernel, beta_sigmoid, gate_in_kernel):
    """The in-kernel L2 norm, beta sigmoid and gate in PyTorch (differentiable), for the fused backward path."""
    if l2norm_in_kernel:
        q, k = l2norm(q.float()).to(q.dtype), l2norm(k.float()).to(k.dtype)
    if beta_sigmoid:
        beta = torch.sigmoid(beta.float()).to(beta.dtype)
    if gate_in_kernel:
        g = kda_gate(g.float(), A_log, dt_bias, lower_bound)
    return q, k, beta, g
