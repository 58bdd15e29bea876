"""State-passing CP for the triton backend (``NATIVE_CP``): flash-linear-attention's own KCP path (FLA's exchange)
where it is our decomposition, else FLA's kernels with the engine's exchange (``triton_engine_exchange.py``).

FLA 0.6's ``cp_context`` path (``fla.ops.cp``) is the ``allgather`` method on FLA's kernels: in the forward each
rank writes the affine summary ``[E | M]`` of its boundary sequence(s) with ``chunk_cp_fwd_h``, from the WY
factors the forward computes anyway (no outputs, no extra op pass), all-gathers them and folds the earlier
ranks' summaries into the initial state of its first sequence (``chunk_cp_merge``); the backward mirrors it with
``chunk_cp_bwd_dh``. The engine's generic path instead runs a second op pass with values ``[v | 0]`` (V+K wide)
and differentiates through it, so FLA's path costs each rank much less compute for the same exchange.

FLA's partition equals ours (checked: FLA's local boundaries must equal the plan's) when
- the state method is ``allgather`` (alone, or under a Ulysses level: then over the state group),
- there is one row (B == 1: BSHD with micro-batch 1, or packed THD), and
- the layout is ``contiguous`` (documents packed in any way), or ``zigzag`` with a single sequence (FLA's zigzag
  halves the whole token stream, Megatron's THD zigzag halves every document).
Every other case (any method, layout, batch) runs FLA's summary kernels with our exchange
(``triton_engine_exchange.py``).
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from layers.cp.triton_engine_exchange import NATIVE, native_state_passing
from layers.ops.kinds import GDN, delta_kind
from layers.ops.triton.backend import check_gdn_backward
from layers.ops.triton.runtime import check_inputs, load_fla

# kinds whose FLA backward cannot run on some devices: the check to run before the forward (GDN: FLA issue #640)
BACKWARD_BLOCKERS = {GDN: check_gdn_backward}
_FLA_CONTEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ChainPlan -> {(device, group): ctx}


def uses_fla_cp(ctx, plan) -> bool:
    """Whether FLA's KCP path computes this rank's CP for ``plan`` (see the module doc)."""
    if ctx.state_method != "allgather" or plan.batch != 1:
        return False
    if plan.layout == "contiguous":
        return True
    cu = ctx.cu_seqlens
    return plan.layout == "zigzag" and (cu is None or cu.numel() == 2)


def _group(ctx):
    return ctx.state_group if ctx.state_group is not None else dist.group.WORLD


def fla_cp_context(ctx, plan, device: torch.device):
    """FLA's ``FLACPContext`` for this rank (cached per plan, device and process group); RuntimeError if FLA's
    local boundaries differ from the plan's (FLA's partition would not be ours)."""
    group = _group(ctx)
    cached = _FLA_CONTEXTS.setdefault(plan, {})
    if (device, group) in cached:
        return cached[device, group]
    from fla.ops.cp import build_cp_context as fla_build_cp_context

    T = plan.seq_len
    cu = ctx.cu_seqlens if ctx.cu_seqlens is not None else torch.tensor([0, T], dtype=torch.int64)
    fla_ctx = fla_build_cp_context(cu.to(device), group=group, cu_seqlens_cpu=cu, layout=plan.layout)
    placement = (dist.get_rank(group=group), dist.get_world_size(group=group))
    if placement != (plan.rank, plan.world_size):
        raise RuntimeError(f"backend='triton' CP: the state group places this rank at {placement} (rank, size), "
                           f"the plan at {(plan.rank, plan.world_size)}")
    ours = plan.local_cu_seqlens.to(torch.int64)
    theirs = fla_ctx.cu_seqlens_cpu.to(torch.int64)
    if not torch.equal(ours, theirs):
        raise RuntimeError(f"backend='triton' CP: flash-linear-attention's {plan.layout} partition of rank "
                           f"{plan.rank} has local boundaries {theirs.tolist()}, ours {ours.tolist()}")
    cached[device, group] = fla_ctx
    return fla_ctx


def _summary_bytes(plan, HV: int, K: int, V: int) -> int:
    """Bytes of one rank's all-gathered summaries: [HV, K, V+K] fp32 per part (zigzag: two parts)."""
    return (2 if plan.layout == "zigzag" else 1) * HV * K * (V + K) * 4


class _RecordBackwardGather(torch.autograd.Function):
    """Identity on o whose backward accounts FLA's backward all-gather in the context's CommStats."""

    @staticmethod
    def forward(ctx, o, stats, sent, received):
        ctx.stats, ctx.sent, ctx.received = stats, sent, received
        return o.view_as(o)

    @staticmethod
    def backward(ctx, do):
        ctx.stats.add("fla_cp_all_gather", ctx.sent, ctx.received, phase="backward")
        return do, None, None, None


def state_passing_cp(kind, ctx, plan, q, k, v, g, beta, *, scale, flags):
    """CP engine hook: the delta rule ``kind`` (name or descriptor) on this rank's ``[B, T_local, ...]`` shard in
    ``plan``'s local order -> o.

    FLA's own KCP path where it is our decomposition (module doc), else FLA's kernels with our exchange."""
    kind = delta_kind(kind)
    kind.pick(NATIVE, "backend='triton' CP")   # refuse a kind this backend's CP has no kernels for, on either path
    fla = load_fla()
    check_inputs(q, k, v, g, beta)
    blocker = BACKWARD_BLOCKERS.get(kind)
    if blocker is not None:
        blocker(q, k, v, g, beta, flags.get("A_log"), flags.get("dt_bias"))
    if not uses_fla_cp(ctx, plan):
        return native_state_passing(kind, ctx, plan, q, k, v, g, beta, scale=scale, flags=flags)
    K, (HV, V) = q.shape[-1], v.shape[2:]
    fla_ctx = fla_cp_context(ctx, plan, q.device)
    gate = flags.get("use_gate_in_kernel", False)
    common = dict(scale=scale, initial_state=None, output_final_state=False, cp_context=fla_ctx,
                  use_qk_l2norm_in_kernel=flags.get("use_qk_l2norm_in_kernel", False),
                  use_beta_sigmoid_in_kernel=flags.get("use_beta_sigmoid_in_kernel", False))
    gate_args = {"A_log": flags.get("A_log"), "dt_bias": flags.get("dt_bias"), "use_gate_in_kernel": True} if gate \
        else {}
    if kind.lower_bound_gate:
        gate_args.update(use_gate_in_kernel=gate, safe_gate=flags.get("safe_gate", False),
                         lower_bound=flags.get("lower_bound"))
    o, _ = getattr(fla, kind.op)(q=q, k=k, v=v, g=g, beta=beta, **common, **gate_args)   # FLA's op of that name
    P = ctx.state_world_size
    sent = _summary_bytes(plan, HV, K, V)
    ctx.stats.add("fla_cp_all_gather", sent, (P - 1) * sent, phase="forward")
    if torch.is_grad_enabled() and o.requires_grad:
        o = _RecordBackwardGather.apply(o, ctx.stats, sent, (P - 1) * sent)
    return o
