"""Stand-in for ``fla_npu.ops.ascendc``: the operators ``layers/ops/ascendc`` uses, in PyTorch on CPU.

Pinned revision: flashserve/flash-linear-attention-npu at d05824feb13e20c620931b9eceafea88ae745890 (the
revision of ``examples/chunk_gdn_cp.py`` / ``examples/chunk_kda_cp.py`` read in full), completed by the
operator facts issue 27 records from commit 7e91c7d6 (composite GDN forward/backward) and by
``torch_custom/fla_npu/fla_npu/ops/ascendc/_aclnn_ctypes.py`` at 0220b7bf49b46ca78bd1c6b44374b131460d5129
(dhu / dv_local / fwd_h signatures, canonical ``chunk_indices``), and by the later files issue 33 read (the
composite GDN backward's op_api at 2a1b0ce9, the ChunkKdaBwdPrepare / ChunkKdaBwdFinalize op-defs, the
recurrent wrappers). docs/backends.md lists each fact with the revision and file it was read from. Where the
real package and hp_megatron's contract differ, this file follows the real package.

Knobs (environment variables) play the builds the revisions disagree on; the tests run each setting:
``FLA_NPU_STANDIN_SOC`` (SoC, default ``Ascend950PR``), ``FLA_NPU_STANDIN_KDA_BWD_EXPORTED`` (KDA backward stages
exported; read at import), ``FLA_NPU_STANDIN_KDA_FUSED_BWD_EXPORTED`` (the monolithic ``chunk_kda_bwd`` exported, as
PR #334's head 7a8a59a3 and later ``_stable.py`` versions do; read at import), ``FLA_NPU_STANDIN_DHU_USES_DHT`` (a
build whose reverse state pass honours ``dht``: the dhu op and the composite GDN backward),
``FLA_NPU_STANDIN_H_LAYOUT`` (``chunk_first`` h / dh ``[B,NT,HV,K,V]``, the default, or the earlier ``head_first``
``[B,HV,NT,K,V]``), ``FLA_NPU_STANDIN_RAW_WRAPPER`` (exports wrapped as fla-npu's ``_make_raw_wrapper`` does, whose
signature reads ``(name: str)``; read at import).

What it enforces like that revision (each check names the operator):
- exports: ``_ASCENDC_OPS`` lists ``npu_<op>``; each is exported under that name and its short name. The KDA
  backward stages (``chunk_kda_bwd_prepare`` / ``chunk_kda_bwd_finalize``) are NOT exported by the pinned
  revision (its KDA CP example reaches ``aclnnChunkKdaBwdPrepare`` through a private runtime call); later
  revisions export them (``FLA_NPU_STANDIN_KDA_BWD_EXPORTED=1`` models those). The backward CP summary is
  named ``chunk_delta_h_bwd_preprocess`` (later: ``pre_process_bwd_kernel_merged``). No ``__version__`` here.
- the declared SoC (``FLA_NPU_STANDIN_SOC``, default ``Ascend950PR``): every operator raises on a SoC its op-def
  does not register (``REGISTERED_SOCS``: the ``AddConfig`` SoCs read from each op-def, revision and file named;
  Ascend 950 only: the composite GDN backward, ``chunk_gated_delta_rule_fwd_prepare``, the KDA backward stages);
  the composite forward's in-kernel L2 norm / sigmoid take a 950-only path; Ascend 910_93 (A3) rejects the
  BSND/TND layouts of the composite forward.
- the monolithic KDA backward ``chunk_kda_bwd`` (op-def ChunkKdaBwd registers all three SoCs, 7a8a59a3): no
  ``initial_state`` / ``dht``, ``safe_gate=True`` only, no GVA (q/k/v one head count), head-major, chunk-first h.
- the GDN building blocks fla-npu's A2/A3 example composes (``recompute_w_u_fwd``, ``chunk_local_cumsum``,
  ``chunk_bwd_dqkwg``, ``prepare_wy_repr_bwd_da`` / ``_full``; signatures from main 17e24fdd ``_aclnn_ctypes.py``).
- dtypes: bf16 (composite GDN: bf16 only; KDA: ``chunk_fwd_h``, ``chunk_kda_fwd_finalize`` and the backward
  stages bf16 only, the prepare and the GDN building blocks bf16/fp16; ``ALLOW_FP32`` widens q/k/v-like tensors for
  exact tests but never the inputs the real ops demand in one dtype: composite backward ``initial_state``/``dht`` bf16
  (``dh0`` comes back bf16), ``gk`` of the backward CP summary bf16/fp16, ``dq_raw`` / ``d_aqk`` / ``gk`` / ``raw_g``
  of the KDA backward finalize fp32 (``chunk_kda_bwd_prepare`` returns ``dq_raw`` fp32)); ``beta_raw`` must
  have ``beta``'s dtype. The KDA backward stages are Ascend 950 only (their op-defs register ascend950).
- layouts/ranks: composite forward returns ``o`` ``[B,T,HV,V]`` whatever ``layout`` says and the backward takes
  ``d_o`` ``[B,T,HV,V]`` (BSND) whatever ``layout`` says; ``g_cumsum``/``beta_eff`` token-major ``[B,T,HV]``
  (``beta_eff`` None unless the sigmoid ran in the kernel); ``chunk_bwd_dv_local`` takes ``g`` head-major
  ``[B,HV,T]``; ``chunk_fwd_h`` takes rank-4 tensors only; h / dh follow ``FLA_NPU_STANDIN_H_LAYOUT`` and every
  op taking them checks the shape ("h must have NT-first shape ...").
- index arrays: ``cu_seqlens`` without ``chunk_indices`` is rejected by the composite forward/backward and
  ``chunk_bwd_dv_local``; the dhu op without them sizes chunks as ceil(T/64) (raised here, silent there).
- zero-length pieces are rejected by the composite forward and both CP summaries; the merge rejects N = 0.
- ``chunk_gated_delta_rule_bwd_dhu`` and the composite ``chunk_gated_delta_rule_bwd`` (which hands ``dht`` to the
  same kernel) ignore ``dht``; ``FLA_NPU_STANDIN_DHU_USES_DHT=1`` models a build that honours it.
- KDA gate: in-kernel gate without ``safe_gate`` is the softplus form whatever ``lower_bound`` says; with the
  in-kernel gate ``A_log`` must be float32 ``[HV]``, ``dt_bias`` float32 ``[HV*K]``, and with ``safe_gate``
  ``lower_bound`` in [-5, 0) (prepare, backward finalize, recurrent KDA).
- decode: ``recurrent_gated_delta_rule`` (V-first state, ``actual_seq_lengths`` with its prefix entry, bf16
  beta, no in-kernel transforms) and ``recurrent_kda`` (K-first state with ``state_v_first=False``, in-kernel
  transforms), both at most 8 tokens per sequence and call.
Values come from the chunked WY math in ``_math.py`` (fp32 internally).
"""
from __future__ import annotations

import functools
import os

import torch

from . import _math as m

REVISION = "d05824feb13e20c620931b9eceafea88ae745890"
ALLOW_FP32 = False          # stand-in only: the real kernels take bfloat16/float16
LAYOUTS = ("BSND", "BNSD", "TND", "NTD")
CALLS: list = []            # names of the operators called, in order (tests inspect the composition)
A3_SOCS = ("Ascend910_93", "Ascend910C")


def declared_soc() -> str:
    """The SoC this stand-in pretends to run on (``FLA_NPU_STANDIN_SOC``)."""
    return os.environ.get("FLA_NPU_STANDIN_SOC", "Ascend950PR")


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") == "1"


H_LAYOUTS = ("chunk_first", "head_first")


def h_layout() -> str:
    """Layout of the chunk states h / dh this build plays (``FLA_NPU_STANDIN_H_LAYOUT``): ``chunk_first``
    ``[B, NT, HV, K, V]`` (the default: builds after the h/dh migration, which the pinned examples fit) or
    ``head_first`` ``[B, HV, NT, K, V]`` (earlier builds)."""
    layout = os.environ.get("FLA_NPU_STANDIN_H_LAYOUT", "chunk_first")
    if layout not in H_LAYOUTS:
        raise ValueError(f"FLA_NPU_STANDIN_H_LAYOUT must be one of {H_LAYOUTS}, got {layout!r}")
    return layout


def _h_out(h_head_first):
    """Internal head-first [B, HV, NT, K, V] -> this build's layout."""
    return h_head_first.transpose(1, 2).contiguous() if h_layout() == "chunk_first" else h_head_first


def _h_in(op, name, h, B, HV, NT):
    """A chunk-state input checked against this build's layout -> head-first view [B, HV, NT, K, V]."""
    chunk_first = h_layout() == "chunk_first"
    want = (B, NT, HV) if chunk_first else (B, HV, NT)
    if h.dim() != 5 or tuple(h.shape[:3]) != want:
        raise RuntimeError(f"{op}: {name} must have {'NT-first' if chunk_first else 'head-first'} shape "
                           f"{list(want) + ['K', 'V']}, got {list(h.shape)}.")
    return h.transpose(1, 2) if chunk_first else h


def _total_chunks(T, cu, C):
    """Chunks along dim NT of h: per batch row ceil(T/C), or the sum over packed sequences."""
    if cu is None:
        return -(-T // C)
    return sum(m.num_chunks(e - s, C) for s, e in zip(cu[:-1], cu[1:]))


# Which SoCs each operator's op-def registers (``this->AICore().AddConfig("ascend910b" | "ascend910_93" |
# "ascend950")``), read from flashserve/flash-linear-attention-npu; each entry names the revision and file. A call on
# a declared SoC whose op-def does not register it raises (fla-npu's aclnn finds no kernel there). A2 = Ascend910B,
# A3 = Ascend910_93 / 910C, A5 = Ascend950.
ALL_SOCS = ("Ascend910B", "Ascend910_93", "Ascend910C", "Ascend950")
A5_ONLY = ("Ascend950",)
_GDN_BWD = "main 17e24fdd fla/ops/ascendc/gdn/chunk_gdn_bwd"
REGISTERED_SOCS = {
    # composite GDN: aclnn L2 compositions (no op-def of their own); forward over the A2/A3 "Phase6" blocks per
    # issue 27 (7e91c7d6), not verified; backward "supported on Ascend950 only" (2a1b0ce9 op_api)
    "npu_chunk_gated_delta_rule_fwd": (ALL_SOCS, "issue 27 (7e91c7d6), not verified"),
    "npu_chunk_gated_delta_rule_bwd": (A5_ONLY, "2a1b0ce9 chunk_gated_delta_rule_bwd/op_host/op_api/"
                                                "aclnn_chunk_gated_delta_rule_bwd.cpp"),
    # d05824fe examples/chunk_gdn_cp.py calls it in run_gdn_a5 only (run_gdn_a2_a3 composes the blocks below)
    "npu_chunk_gated_delta_rule_fwd_prepare": (A5_ONLY, "d05824fe examples/chunk_gdn_cp.py (op-def not read)"),
    "npu_chunk_bwd_dv_local": (ALL_SOCS, f"{_GDN_BWD}/chunk_bwd_dv_local/op_host/chunk_bwd_dv_local_def.cpp"),
    "npu_chunk_gated_delta_rule_bwd_dhu": (ALL_SOCS, f"{_GDN_BWD}/chunk_gated_delta_rule_bwd_dhu/op_host/"
                                                     "chunk_gated_delta_rule_bwd_dhu_def.cpp"),
    "npu_chunk_bwd_dqkwg": (ALL_SOCS, f"{_GDN_BWD}/chunk_bwd_dqkwg/op_host/chunk_bwd_dqkwg_def.cpp"),
    "npu_prepare_wy_repr_bwd_da": (ALL_SOCS, f"{_GDN_BWD}/prepare_wy_repr_bwd_da/op_host/"
                                             "prepare_wy_repr_bwd_da_def.cpp"),
    "npu_prepare_wy_repr_bwd_full": (ALL_SOCS, f"{_GDN_BWD}/prepare_wy_repr_bwd_full/op_host/"
                                               "prepare_wy_repr_bwd_full_def.cpp"),
    "npu_recompute_w_u_fwd": (ALL_SOCS, "main 17e24fdd fla/ops/ascendc/gdn/chunk_gdn_fwd/recompute_w_u_fwd/op_host/"
                                        "recompute_wu_fwd_def.cpp"),
    "npu_chunk_local_cumsum": (ALL_SOCS, "main 17e24fdd fla/ops/ascendc/gdn/chunk_gdn_fwd/chunk_local_cumsum/op_host/"
                                         "chunk_local_cumsum_def.cpp"),
    "npu_chunk_gated_delta_rule_fwd_h": (ALL_SOCS, "main 17e24fdd fla/ops/ascendc/gdn/chunk_gdn_fwd/"
                                                   "chunk_gated_delta_rule_fwd_h/op_host/"
                                                   "chunk_gated_delta_rule_fwd_h_def.cpp"),
    "npu_chunk_kda_fwd_prepare": (ALL_SOCS, "af82e5a8 fla/ops/ascendc/kda/chunk_kda_fwd_prepare/op_host/"
                                            "chunk_kda_fwd_prepare_def.cpp"),
    "npu_chunk_kda_fwd_finalize": (ALL_SOCS, "775daabc fla/ops/ascendc/kda/chunk_kda_fwd_finalize/op_host/"
                                             "chunk_kda_fwd_finalize_def.cpp"),
    "npu_chunk_kda_bwd_prepare": (A5_ONLY, "b2f8a6b1 fla/ops/ascendc/kda/chunk_kda_bwd_prepare/op_host/"
                                           "chunk_kda_bwd_prepare_def.cpp"),
    "npu_chunk_kda_bwd_finalize": (A5_ONLY, "ccd5d25a fla/ops/ascendc/kda/chunk_kda_bwd_finalize/op_host/"
                                            "chunk_kda_bwd_finalize_def.cpp"),
    "npu_pre_process_fwd_kernel_merged": (ALL_SOCS, "916fb303 fla/ops/ascendc/cp/pre_process_fwd_kernel_merged/"
                                                    "op_host/pre_process_fwd_kernel_merged_def.cpp"),
    "npu_chunk_delta_h_bwd_preprocess": (ALL_SOCS, "ff571de0 fla/ops/ascendc/cp/chunk_delta_h_bwd_preprocess/op_host/"
                                                   "chunk_delta_h_bwd_preprocess_def.cpp"),
    "npu_merge_fwd_bwd_kernel": (ALL_SOCS, "MergeFwdBwdKernel op-def of an index version (path not named)"),
    "npu_recurrent_gated_delta_rule": (ALL_SOCS, "main 17e24fdd fla/ops/ascendc/gdn/recurrent_gdn/"
                                                 "recurrent_gated_delta_rule/op_host/"
                                                 "recurrent_gated_delta_rule_def.cpp"),
    "npu_recurrent_kda": (ALL_SOCS, "main 17e24fdd fla/ops/ascendc/kda/recurrent_kda/op_host/recurrent_kda_def.cpp"),
    # the monolithic KDA backward: PR #334 head 7a8a59a3 (2026-08-20; also 225d3136 / b8bedc76, 2026-06-27, with
    # other ABIs); not in main 17e24fdd's tree
    "npu_chunk_kda_bwd": (ALL_SOCS, "7a8a59a3 fla/ops/ascendc/kda/chunk_kda_bwd/op_host/chunk_kda_bwd_def.cpp"),
}


def _require_registered(op):
    """RuntimeError when the declared SoC is not among those ``op``'s op-def registers (REGISTERED_SOCS)."""
    socs, source = REGISTERED_SOCS[op]
    soc = declared_soc()
    if not soc.startswith(socs):
        raise RuntimeError(f"{op}: no kernel registered for {soc} (op-def registers {', '.join(socs)}; {source})")


def _require_950(op, what=""):
    soc = declared_soc()
    if not soc.startswith("Ascend950"):
        raise RuntimeError(f"{op}: {what or 'this operator'} is only available on Ascend950, running on {soc}")


# ------------------------------------------------------------------------------------------- helpers
_INSIDE: list = []          # a composite operator whose internal stages are running (not the caller's calls)


def _record(name):
    if _INSIDE:
        return
    CALLS.append(name)
    _require_registered(name)


def _check_dtype(op, name, x, extra=(), bf16_only=False):
    allowed = (torch.bfloat16,) + (() if bf16_only else (torch.float16,)) + tuple(extra) \
        + ((torch.float32,) if ALLOW_FP32 else ())
    if x is not None and x.dtype not in allowed:
        raise RuntimeError(f"{op}: {name} must be {'bfloat16' if bf16_only else 'bfloat16/float16'}, got {x.dtype}")


def _check_strict_dtype(op, name, x, allowed):
    """Inputs the real op demands in these dtypes whatever ALLOW_FP32 says."""
    if x is not None and x.dtype not in allowed:
        raise RuntimeError(f"{op}: {name} must be {'/'.join(str(d).replace('torch.', '') for d in allowed)}, "
                           f"got {x.dtype}")


def _canonical_indices(cu, C):
    return [v for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])) for c in range(-(-(e - s) // C)) for v in (n, c)]


def _check_indices(op, cu, chunk_indices, C, required):
    """cu_seqlens and chunk_indices go together (canonical sequence-major (seq, chunk) pairs)."""
    if cu is None:
        return
    if chunk_indices is None:
        if required:
            raise RuntimeError(f"{op}: cu_seqlens and chunk_indices must be provided together.")
        return
    if [int(x) for x in chunk_indices] != _canonical_indices(cu, C):
        raise RuntimeError(f"{op}: chunk_indices must use canonical sequence-major order.")


def _check_nonempty(op, cu):
    if cu is not None and any(b == a for a, b in zip(cu, cu[1:])):
        raise RuntimeError(f"{op}: zero-length sequences are not supported, got cu_seqlens {cu}")


def _host_list(op, cu_seqlens):
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.device.type != "cpu":
            raise RuntimeError(f"{op}: cu_seqlens must be a host sequence, got a {cu_seqlens.device} tensor")
        cu_seqlens = cu_seqlens.tolist()
    values = [int(x) for x in cu_seqlens]
    if len(values) < 2 or any(b < a for a, b in zip(values, values[1:])):
        raise RuntimeError(f"{op}: cu_seqlens must be a non-decreasing host list, got {values}")
    return values


def _to_head_major(op, x, layout):
    """q/k/v in ``layout`` -> [B, N, T, D]. TND/NTD: rank 3 ([T,N,D]/[N,T,D]) or rank 4 with B = 1."""
    if layout not in LAYOUTS:
        raise RuntimeError(f"{op}: layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "BSND":
        return x.transpose(1, 2)
    if layout == "BNSD":
        return x
    if layout == "TND":
        return (x.unsqueeze(0) if x.dim() == 3 else x).transpose(1, 2)
    return x.unsqueeze(0) if x.dim() == 3 else x


def _from_head_major(x, layout, rank):
    """[B, N, T, D] -> ``layout`` (rank 3 for TND/NTD when ``rank == 3``)."""
    if layout == "BSND":
        return x.transpose(1, 2)
    if layout == "BNSD":
        return x
    y = x.transpose(1, 2) if layout == "TND" else x
    return y.squeeze(0) if rank == 3 else y


def _units(use_exp2):
    """Factor turning a stored cumulative gate into natural log units."""
    return m.LN2 if use_exp2 else 1.0


def _check_dims(op, K, V, allowed_v=(128,)):
    if K != 128 or V not in allowed_v:
        raise RuntimeError(f"{op}: supports K=128 and V in {allowed_v}, got K={K}, V={V}")


def _check_chunk(op, chunk_size, allowed=(64,)):
    if int(chunk_size) not in allowed:
        raise RuntimeError(f"{op}: chunk_size must be one of {allowed}, got {chunk_size}")


def _segments(op, B, T, cu):
    if cu is not None:
        if B != 1:
            raise RuntimeError(f"{op}: cu_seqlens requires batch 1, got B={B}")
        if cu[0] != 0 or cu[-1] != T:
            raise RuntimeError(f"{op}: cu_seqlens must span [0, {T}], got {cu}")
    return m.segments(B, T, cu)


def _beta_derivative(beta_eff, allow_neg_eigval):
    s = beta_eff / (2.0 if allow_neg_eigval else 1.0)
    return (2.0 if allow_neg_eigval else 1.0) * s * (1 - s)


# ---------------------------------------------------------------------------------- GDN composite
def chunk_gated_delta_rule_fwd(q, k, v, g, beta, *, initial_state=None, output_final_state=False, chunk_size=64,
                               cu_seqlens=None, chunk_indices=None, scale=None, use_exp2=False,
                               use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                               use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, disable_recompute=True,
                               return_intermediate_states=False, state_v_first=False, a_log=None, dt_bias=None,
                               layout="BNSD"):
    """Fused GDN forward. q, k, v rank-4 in ``layout`` (TND means [1,T,N,D]); g, beta token-major [B,T,HV].

    Returns ten slots ``(o, final_state, g_cumsum, A, beta_eff, h, q_hat, k_hat, q_rstd, k_rstd)``: o
    ``[B,T,HV,V]`` whatever ``layout`` says (the ctypes wrapper allocates it so), in q's dtype; final_state
    [N,HV,K,V] fp32 (or None); g_cumsum fp32 (log2 units with
    use_exp2) token-major [B,T,HV] and A [B,HV,T,64] only with disable_recompute; beta_eff token-major [B,T,HV]
    fp32 only with the in-kernel sigmoid (else None); h (``h_layout()``) only with return_intermediate_states;
    q_hat/k_hat in ``layout`` (q/k themselves without L2 norm); q_rstd/k_rstd [B,H,T] fp32 or None.
    cu_seqlens needs chunk_indices; zero-length sequences are rejected; on Ascend 910B/910_93 the in-kernel
    L2 norm and sigmoid are not available and 910_93 rejects BSND/TND."""
    op = "npu_chunk_gated_delta_rule_fwd"
    _record(op)
    if use_gate_in_kernel:
        raise RuntimeError(f"{op}: use_gate_in_kernel=True is not supported.")
    if a_log is not None or dt_bias is not None:
        raise RuntimeError(f"{op}: a_log and dt_bias must be None while gate-in-kernel is unsupported.")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise RuntimeError(f"{op}: q, k and v must be rank-4 tensors.")
    if state_v_first:
        raise RuntimeError(f"{op}: the stand-in implements state_v_first=False only")
    if use_qk_l2norm_in_kernel or use_beta_sigmoid_in_kernel:
        _require_950(op, "the in-kernel L2 norm / beta sigmoid path")
    if declared_soc().startswith(A3_SOCS) and layout in ("BSND", "TND"):
        raise RuntimeError(f"{op}: layout {layout} is not supported on {declared_soc()}; use BNSD")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_dtype(op, name, x, bf16_only=True)
    _check_chunk(op, chunk_size, (64, 128))
    qh, kh, vh = (_to_head_major(op, x, layout).float() for x in (q, k, v))
    B, H, T, K = qh.shape
    HV, V = vh.shape[1], vh.shape[3]
    _check_dims(op, K, V, (128, 256))
    if HV % H:
        raise RuntimeError(f"{op}: HV={HV} must be a multiple of H={H}")
    if tuple(g.shape) != (B, T, HV) or tuple(beta.shape) != (B, T, HV):
        raise RuntimeError(f"{op}: g and beta must be [B,T,HV]={[B, T, HV]}, got {list(g.shape)}, {list(beta.shape)}")
    C = int(chunk_size)
    cu = _host_list(op, cu_seqlens)
    _check_indices(op, cu, chunk_indices, C, required=True)
    _check_nonempty(op, cu)
    segs = _segments(op, B, T, cu)
    scale = K ** -0.5 if scale is None else float(scale)
    q_rstd = k_rstd = None
    if use_qk_l2norm_in_kernel:
        qh, q_rstd = m.l2norm_with_rstd(qh)
        kh, k_rstd = m.l2norm_with_rstd(kh)
    g_hm = g.float().transpose(1, 2)
    beta_eff = m.beta_activation(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval).transpose(1, 2).contiguous()
    o = vh.new_zeros(B, HV, T, V)
    g_cumsum = vh.new_zeros(B, HV, T)
    A = vh.new_zeros(B, HV, T, C)
    finals, hs = [], {}
    for n, (b, s, e) in enumerate(segs):
        gam = m.chunk_cumsum(g_hm[b, :, s:e], C)
        P = m.prepare(m.expand_heads(qh[b, :, s:e], HV), m.expand_heads(kh[b, :, s:e], HV), vh[b, :, s:e],
                      beta_eff[b, :, s:e], gam, scale, C)
        h0 = None if initial_state is None else initial_state[n]
        h, v_new, S = m.state_pass(P["w"], P["u"], P["kg"], P["decay"], C, h0)
        o[b, :, s:e] = m.outputs(P["qg"], P["Aqk"], v_new, h, scale, C)
        g_cumsum[b, :, s:e] = gam / _units(use_exp2)
        A[b, :, s:e] = P["Akk"]
        finals.append(S)
        hs.setdefault(b, []).append(h)
    h_all = _h_out(torch.stack([torch.cat(hs[b], 1) for b in sorted(hs)], 0).to(k.dtype))
    return (o.transpose(1, 2).contiguous().to(q.dtype),
            torch.stack(finals, 0) if output_final_state else None,
            g_cumsum.transpose(1, 2).contiguous() if disable_recompute else None,
            A.to(q.dtype) if disable_recompute else None,
            beta_eff.transpose(1, 2).contiguous() if use_beta_sigmoid_in_kernel else None,
            h_all if return_intermediate_states else None,
            _from_head_major(qh.to(q.dtype), layout, 4) if use_qk_l2norm_in_kernel else q,
            _from_head_major(kh.to(k.dtype), layout, 4) if use_qk_l2norm_in_kernel else k,
            q_rstd, k_rstd)


def chunk_gated_delta_rule_bwd(q, k, v, g, beta, A, d_o, scale, *, chunk_size=64, cu_seqlens=None,
                               chunk_indices=None, initial_state=None, dht=None, q_rstd=None, k_rstd=None,
                               beta_raw=None, use_exp2=False, use_qk_l2norm_in_kernel=False,
                               use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                               return_intermediate_states=False, state_v_first=False, a_log=None, dt_bias=None,
                               layout="BNSD"):
    """Composite GDN backward (fla-npu documents it as Ascend 950 only; the adapter enforces that).

    q, k: the forward's q_hat/k_hat in ``layout``; v in ``layout``; g: the forward's g_cumsum [B,T,HV];
    beta [B,T,HV]: beta_eff with the in-kernel sigmoid, else the raw beta; A [B,HV,T,64]; d_o ``[B,T,HV,V]``
    (BSND) whatever ``layout`` says; initial_state and dht [N,HV,K,V] in bf16 only; beta_raw [B,T,HV] in
    beta's dtype (needed with use_beta_sigmoid_in_kernel). Ascend 950 only; cu_seqlens needs chunk_indices.
    ``dht`` is IGNORED, as on the real op: its op_api hands dht to ChunkGatedDeltaRuleBwdDhu, whose kernel does
    ``(void)dht;`` (``FLA_NPU_STANDIN_DHU_USES_DHT=1`` plays a build that honours it).
    Returns eight slots ``(dq, dk, dv, d_beta, d_g, dh0, d_a_log, d_dt_bias)``:
    dq/dk (w.r.t. the raw q/k when L2 norm ran in the kernel) and dv in ``layout``; d_beta (w.r.t. beta_raw with
    the in-kernel sigmoid) and d_g (w.r.t. the per-token natural-log gate) [B,T,HV] fp32; dh0 [N,HV,K,V] in
    initial_state's dtype (bf16: "initial_state and dh0 must use the main BF16 dtype") or None; the last two are
    reserved and None."""
    op = "npu_chunk_gated_delta_rule_bwd"
    _record(op)
    if use_gate_in_kernel:
        raise RuntimeError(f"{op}: use_gate_in_kernel=True is not supported.")
    for name, x in (("q", q), ("k", k), ("v", v), ("d_o", d_o)):
        _check_dtype(op, name, x, bf16_only=True)
    for name, x in (("initial_state", initial_state), ("dht", dht)):
        _check_strict_dtype(op, name, x, (torch.bfloat16,))
    if not _flag("FLA_NPU_STANDIN_DHU_USES_DHT"):
        dht = None
    if use_beta_sigmoid_in_kernel and (beta_raw is None or beta_raw.dtype != beta.dtype):
        raise RuntimeError(f"{op}: beta_raw must be given with beta's dtype {beta.dtype}, got "
                           f"{None if beta_raw is None else beta_raw.dtype}")
    _check_chunk(op, chunk_size, (64, 128))
    C = int(chunk_size)
    with torch.enable_grad():
        qh = _to_head_major(op, q, layout).detach().float().requires_grad_()
        kh = _to_head_major(op, k, layout).detach().float().requires_grad_()
        vh = _to_head_major(op, v, layout).detach().float().requires_grad_()
        B, H, T, K = qh.shape
        HV = vh.shape[1]
        if tuple(A.shape) != (B, HV, T, C):
            raise RuntimeError(f"{op}: A must be [B,HV,T,{C}]={[B, HV, T, C]}, got {list(A.shape)}")
        cu = _host_list(op, cu_seqlens)
        _check_indices(op, cu, chunk_indices, C, required=True)
        segs = _segments(op, B, T, cu)
        if tuple(g.shape) != (B, T, HV) or tuple(beta.shape) != (B, T, HV):
            raise RuntimeError(f"{op}: g and beta must be [B,T,HV]={[B, T, HV]}, got {list(g.shape)}, "
                               f"{list(beta.shape)}")
        g_nat = g.detach().float().transpose(1, 2) * _units(use_exp2)
        g_tok = torch.zeros_like(g_nat)
        for b, s, e in segs:
            g_tok[b, :, s:e] = m.per_token_gate(g_nat[b, :, s:e], C)
        g_tok.requires_grad_()
        beta_e = beta.detach().float().transpose(1, 2).requires_grad_()
        h0 = None if initial_state is None else initial_state.detach().float().requires_grad_()
        if tuple(d_o.shape) != (B, T, HV, vh.shape[3]):
            raise RuntimeError(f"{op}: d_o must be BSND [B,T,HV,V]={[B, T, HV, vh.shape[3]]}, got "
                               f"{list(d_o.shape)}.")
        do_hm = d_o.float().transpose(1, 2)
        loss = 0.0
        for n, (b, s, e) in enumerate(segs):
            gam = m.chunk_cumsum(g_tok[b, :, s:e], C)
            P = m.prepare(m.expand_heads(qh[b, :, s:e], HV), m.expand_heads(kh[b, :, s:e], HV), vh[b, :, s:e],
                          beta_e[b, :, s:e], gam, float(scale), C)
            h, v_new, S = m.state_pass(P["w"], P["u"], P["kg"], P["decay"], C, None if h0 is None else h0[n])
            o = m.outputs(P["qg"], P["Aqk"], v_new, h, float(scale), C)
            loss = loss + (o * do_hm[b, :, s:e]).sum()
            if dht is not None:
                loss = loss + (S * dht[n].float()).sum()
        leaves = [qh, kh, vh, g_tok, beta_e] + ([h0] if h0 is not None else [])
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    dq, dk, dv, dg, dbeta = (torch.zeros_like(x) if gr is None else gr for x, gr in zip(leaves[:5], grads[:5]))
    dh0 = grads[5].to(initial_state.dtype) if h0 is not None else None
    if use_qk_l2norm_in_kernel:
        dq = m.l2norm_backward(qh.detach(), q_rstd, dq)
        dk = m.l2norm_backward(kh.detach(), k_rstd, dk)
    if use_beta_sigmoid_in_kernel:
        dbeta = dbeta * _beta_derivative(beta.float().transpose(1, 2), allow_neg_eigval)
    return (_from_head_major(dq, layout, 4).to(q.dtype), _from_head_major(dk, layout, 4).to(k.dtype),
            _from_head_major(dv, layout, 4).to(v.dtype), dbeta.transpose(1, 2).contiguous(),
            dg.transpose(1, 2).contiguous(), dh0, None, None)


def chunk_gated_delta_rule_fwd_prepare(q, k, v, g, beta, chunk_size=64, *, use_qk_l2norm_in_kernel=False,
                                       use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                                       allow_neg_eigval=False, use_exp2=False, a_log=None, dt_bias=None,
                                       cu_seqlens=None, chunk_indices=None, output_a=True):
    """GDN prefill preparation. q, k, v BNSD; g, beta head-major [B,HV,T].

    Returns nine slots ``(q_hat, k_hat, q_rstd, k_rstd, beta_out, g_cumsum, w, u, a)``: q_hat/k_hat [B,H,T,K]
    (q/k themselves without L2 norm), rstd [B,H,T] fp32 or None, beta_out [B,HV,T] fp32, g_cumsum [B,HV,T]
    fp32 (log2 with use_exp2), w [B,HV,T,K], u [B,HV,T,V], a [B,HV,T,64] (None unless output_a)."""
    op = "npu_chunk_gated_delta_rule_fwd_prepare"
    _record(op)
    if use_gate_in_kernel:
        raise RuntimeError(f"{op}: use_gate_in_kernel currently only supports False.")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_dtype(op, name, x)
    _check_chunk(op, chunk_size)
    C = int(chunk_size)
    qh, kh, vh = q.float(), k.float(), v.float()
    B, H, T, K = qh.shape
    HV, V = vh.shape[1], vh.shape[3]
    _check_dims(op, K, V, (128, 256))
    segs = _segments(op, B, T, _host_list(op, cu_seqlens))
    q_rstd = k_rstd = None
    if use_qk_l2norm_in_kernel:
        qh, q_rstd = m.l2norm_with_rstd(qh)
        kh, k_rstd = m.l2norm_with_rstd(kh)
    beta_out = m.beta_activation(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval).contiguous()
    g_cumsum, w = vh.new_zeros(B, HV, T), vh.new_zeros(B, HV, T, K)
    u, a = vh.new_zeros(B, HV, T, V), vh.new_zeros(B, HV, T, C)
    for b, s, e in segs:
        gam = m.chunk_cumsum(g[b, :, s:e].float(), C)
        P = m.prepare(m.expand_heads(qh[b, :, s:e], HV), m.expand_heads(kh[b, :, s:e], HV), vh[b, :, s:e],
                      beta_out[b, :, s:e], gam, 1.0, C)
        g_cumsum[b, :, s:e] = gam / _units(use_exp2)
        w[b, :, s:e], u[b, :, s:e], a[b, :, s:e] = P["w"], P["u"], P["Akk"]
    return (qh.to(q.dtype) if use_qk_l2norm_in_kernel else q, kh.to(k.dtype) if use_qk_l2norm_in_kernel else k,
            q_rstd, k_rstd, beta_out, g_cumsum, w.to(k.dtype), u.to(v.dtype), a.to(q.dtype) if output_a else None)


def chunk_bwd_dv_local(q, k, d_o, g, scale, chunk_size, *, g_gamma=None, A=None, cu_seqlens=None,
                       chunk_indices=None):
    """Intra-chunk dv of GDN: dv = Aqk^T d_o with Aqk_ij = scale (q_i.k_j) e^{g_i - g_j} (i >= j, natural-log
    cumulative g [B,HV,T]). q, k [B,H,T,K], d_o [B,HV,T,V] head-major. Returns dv like d_o."""
    op = "npu_chunk_bwd_dv_local"
    _record(op)
    if g_gamma is not None or A is not None:
        raise RuntimeError(f"{op}: the stand-in implements the g path only (g_gamma and A must be None)")
    C = int(chunk_size)
    B, H, T, K = q.shape
    HV, V = d_o.shape[1], d_o.shape[3]
    if tuple(g.shape) != (B, HV, T):
        raise RuntimeError(f"{op}: g must be [B,HV,T]={[B, HV, T]}, got {list(g.shape)}")
    cu = _host_list(op, cu_seqlens)
    _check_indices(op, cu, chunk_indices, C, required=True)
    segs = _segments(op, B, T, cu)
    dv = d_o.new_zeros(B, HV, T, V, dtype=torch.float32)
    for b, s, e in segs:
        gam = g[b, :, s:e].float()
        P = m.prepare(m.expand_heads(q[b, :, s:e].float(), HV), m.expand_heads(k[b, :, s:e].float(), HV),
                      d_o.new_zeros(HV, e - s, V, dtype=torch.float32), d_o.new_zeros(HV, e - s, dtype=torch.float32),
                      gam, float(scale), C)
        ac, doc = m._pad_chunks(P["Aqk"], C), m._pad_chunks(d_o[b, :, s:e].float(), C)
        dv[b, :, s:e] = m._unpad(ac.transpose(-1, -2) @ doc, e - s)
    return dv.to(d_o.dtype)


# ------------------------------------------------------------------------ GDN building blocks (A2 / A3)
# The stages fla-npu's A2/A3 GDN example composes (d05824fe examples/chunk_gdn_cp.py ``run_gdn_a2_a3``): WY
# recompute and the staged backward. Signatures and slots from main 17e24fdd
# torch_custom/fla_npu/fla_npu/ops/ascendc/_aclnn_ctypes.py; shapes from each op's README at that revision.
def _head_inputs(op, names_tensors):
    for name, x in names_tensors:
        _check_dtype(op, name, x)


def recompute_w_u_fwd(k, v, beta, A, chunk_size, *, g=None, gk=None, cu_seqlens=None, chunk_indices=None):
    """WY tensors from the forward's A: w = A (beta k e^g), u = A (beta v) per chunk. Head-major k [B,HK,T,K],
    v [B,HV,T,V], beta [B,HV,T], A [B,HV,T,C], natural-log cumulative g [B,HV,T] (or per-channel gk
    [B,HV,T,K]). Returns ``(w [B,HV,T,K] in k's dtype, u like v)``."""
    op = "npu_recompute_w_u_fwd"
    _record(op)
    _head_inputs(op, (("k", k), ("v", v), ("A", A)))
    if (g is None) == (gk is None):
        raise RuntimeError(f"{op}: exactly one of g and gk must be provided.")
    C = int(chunk_size)
    B, HK, T, K = k.shape
    HV = v.shape[1]
    cu = _host_list(op, cu_seqlens)
    _check_indices(op, cu, chunk_indices, C, required=True)
    gate = (g if g is not None else gk).float()
    w, u = k.new_zeros(B, HV, T, K, dtype=torch.float32), v.new_zeros(v.shape, dtype=torch.float32)
    for b, s, e in _segments(op, B, T, cu):
        gam = gate[b, :, s:e]
        gam = gam if gam.dim() == 3 else gam[..., None].expand(HV, e - s, K)
        bt = beta[b, :, s:e].float()[..., None]
        Ac = m._pad_chunks(A[b, :, s:e].float(), C)
        x = m._pad_chunks(bt * m.expand_heads(k[b, :, s:e].float(), HV) * torch.exp(gam), C)
        w[b, :, s:e] = m._unpad(Ac @ x, e - s)
        u[b, :, s:e] = m._unpad(Ac @ m._pad_chunks(bt * v[b, :, s:e].float(), C), e - s)
    return w.to(k.dtype), u.to(v.dtype)


def chunk_local_cumsum(g, chunk_size, *, cu_seqlens=None, chunk_indices_out=None, reverse=False, scale=1.0,
                       head_first=True, output_dtype="float32"):
    """In-chunk cumulative sum (``reverse``: from the chunk's end) of g [B,H,T] (``head_first``) or [B,T,H],
    times ``scale``; fp32 out."""
    op = "npu_chunk_local_cumsum"
    _record(op)
    if output_dtype != "float32":
        raise RuntimeError(f"{op}: the stand-in implements output_dtype='float32' only")
    C = int(chunk_size)
    x = (g if head_first else g.transpose(1, 2)).float()
    B, _, T = x.shape[:3]
    cu = _host_list(op, cu_seqlens)
    out = torch.zeros_like(x)
    for b, s, e in _segments(op, B, T, cu):
        xc = m._pad_chunks(x[b, :, s:e], C)
        cs = xc.flip(2).cumsum(2).flip(2) if reverse else xc.cumsum(2)
        out[b, :, s:e] = m._unpad(cs, e - s) * float(scale)
    return out if head_first else out.transpose(1, 2).contiguous()


def _dqkwg_checks(op, q, v, w, g_gamma, use_exp2, transpose_state_layout, chunk_size):
    if w is not None or g_gamma is not None:
        raise RuntimeError(f"{op}: w and g_gamma must be None (reserved)")
    if use_exp2 or transpose_state_layout:
        raise RuntimeError(f"{op}: use_exp2 and transpose_state_layout must be false")
    _check_chunk(op, chunk_size, (64, 128))
    _check_dims(op, q.shape[-1], v.shape[-1], (128, 256))
    if v.shape[1] % q.shape[1]:
        raise RuntimeError(f"{op}: HV must be a multiple of HK, got HV={v.shape[1]}, HK={q.shape[1]}")


def chunk_bwd_dqkwg(q, k, v, g, h, dox, dh, dv, chunk_size, *, cu_seqlens=None, chunk_indices=None, w=None,
                    g_gamma=None, scale=None, use_exp2=None, transpose_state_layout=None):
    """GDN backward through the outputs and the state recurrence, with v_new, h, dh and dv (= dhu's dv2, the
    whole gradient of v_new) held: dq, dk from o = scale q_g h + Aqk v_new and h' = e^{g_C} h + k_g^T v_new,
    dw = -dv h^T, dg w.r.t. the natural-log cumulative g [B,HV,T]. q, k [B,HK,T,K]; v = v_new, dox, dv
    [B,HV,T,V]; h, dh (``h_layout()``). Returns ``(dq like q, dk like k, dw [B,HV,T,K], dg like g)`` (the
    ctypes wrapper allocates dq / dk like q / k)."""
    op = "npu_chunk_bwd_dqkwg"
    _record(op)
    _head_inputs(op, (("q", q), ("k", k), ("v", v), ("h", h), ("dox", dox), ("dh", dh), ("dv", dv)))
    _dqkwg_checks(op, q, v, w, g_gamma, use_exp2, transpose_state_layout, chunk_size)
    C, sc = int(chunk_size), 1.0 if scale is None else float(scale)
    B, HK, T, K = q.shape
    HV = v.shape[1]
    cu = _host_list(op, cu_seqlens)
    _check_indices(op, cu, chunk_indices, C, required=True)
    segs = _segments(op, B, T, cu)
    NT = _total_chunks(T, cu, C)
    h4, dh4 = _h_in(op, "h", h, B, HV, NT).float(), _h_in(op, "dh", dh, B, HV, NT).float()
    dq, dk = torch.zeros(B, HK, T, K), torch.zeros(B, HK, T, K)
    dw, dg = torch.zeros(B, HV, T, K), torch.zeros(B, HV, T)
    for (b, s, e), (_, c0, c1) in zip(segs, _split_h(h4, segs, T, C)):
        L = e - s
        hc, dhc = h4[b, :, c0:c1], dh4[b, :, c0:c1]
        vn, do_s, dv_s = (x[b, :, s:e].float() for x in (v, dox, dv))
        with torch.enable_grad():
            qe = m.expand_heads(q[b, :, s:e].float(), HV).requires_grad_()
            ke = m.expand_heads(k[b, :, s:e].float(), HV).requires_grad_()
            gam = g[b, :, s:e].detach().float().requires_grad_()
            P = m.prepare(qe, ke, torch.zeros_like(vn), torch.zeros(HV, L), gam, sc, C)
            d_kg = m._unpad(m._pad_chunks(vn, C) @ dhc.transpose(-1, -2), L)
            loss = (m.outputs(P["qg"], P["Aqk"], vn, hc, sc, C) * do_s).sum() + (P["kg"] * d_kg).sum() \
                + (P["decay"] * (hc * dhc).sum(-1)).sum()
            gq, gk, gg = torch.autograd.grad(loss, (qe, ke, gam))
        dq[b, :, s:e], dk[b, :, s:e], dg[b, :, s:e] = m.reduce_heads(gq, HK), m.reduce_heads(gk, HK), gg
        dw[b, :, s:e] = m._unpad(-(m._pad_chunks(dv_s, C) @ hc.transpose(-1, -2)), L)
    return dq.to(q.dtype), dk.to(k.dtype), dw.to(q.dtype), dg.to(g.dtype)


def _wy_inputs(op, k, v, beta, A, g, chunk_size, cu_seqlens, chunk_indices):
    C = int(chunk_size)
    B, HK, T, K = k.shape
    HV = v.shape[1]
    if tuple(A.shape) != (B, HV, T, C) or tuple(beta.shape) != (B, HV, T) or tuple(g.shape) != (B, HV, T):
        raise RuntimeError(f"{op}: A must be [B,HV,T,{C}] and beta, g [B,HV,T]={[B, HV, T]}, got "
                           f"{list(A.shape)}, {list(beta.shape)}, {list(g.shape)}")
    cu = _host_list(op, cu_seqlens)
    _check_indices(op, cu, chunk_indices, C, required=True)
    return C, B, HK, HV, T, _segments(op, B, T, cu)


def prepare_wy_repr_bwd_da(k, v, beta, A, dw, du, g, *, chunk_size, cu_seqlens=None, chunk_indices=None):
    """Gradient of the strictly lower L (A = (I + L)^-1, see ``_math.wy_lower``) from dw, du:
    dA = -A^T (dw (beta k e^g)^T + du (beta v)^T) A^T, strictly lower, per chunk. k [B,HK,T,K], v, du
    [B,HV,T,V], beta, g [B,HV,T] (natural-log cumulative), A [B,HV,T,C], dw [B,HV,T,K]. Returns dA like A."""
    op = "npu_prepare_wy_repr_bwd_da"
    _record(op)
    _head_inputs(op, (("k", k), ("v", v), ("A", A), ("dw", dw), ("du", du)))
    C, B, HK, HV, T, segs = _wy_inputs(op, k, v, beta, A, g, chunk_size, cu_seqlens, chunk_indices)
    lower = torch.tril(torch.ones(C, C, dtype=torch.bool), -1)
    dA = torch.zeros(A.shape)
    for b, s, e in segs:
        bt, gam = beta[b, :, s:e].float()[..., None], g[b, :, s:e].float()[..., None]
        x = m._pad_chunks(bt * m.expand_heads(k[b, :, s:e].float(), HV) * torch.exp(gam), C)
        y = m._pad_chunks(bt * v[b, :, s:e].float(), C)
        grad_a = m._pad_chunks(dw[b, :, s:e].float(), C) @ x.transpose(-1, -2) \
            + m._pad_chunks(du[b, :, s:e].float(), C) @ y.transpose(-1, -2)
        Ac = m._pad_chunks(A[b, :, s:e].float(), C).transpose(-1, -2)
        dA[b, :, s:e] = m._unpad((-(Ac @ grad_a @ Ac)).masked_fill(~lower, 0.0), e - s)
    return dA.to(A.dtype)


def prepare_wy_repr_bwd_full(k, v, beta, A, dA, dw, du, g, chunk_size, *, cu_seqlens=None, chunk_indices=None):
    """The WY part of the gradients: through w = A (beta k e^g), u = A (beta v) with A held, and through L (its
    gradient dA from ``prepare_wy_repr_bwd_da``). Shapes as there (dw: [B,HV,T,K], as chunk_bwd_dqkwg returns it
    and prepare_wy_repr_bwd_da takes it; this op's README at 17e24fdd lists [B,HK,T,K]: not verified for HV > HK).
    Returns ``(dk like k, dv like v, dbeta like beta, dg like g)``, dg w.r.t. the cumulative g."""
    op = "npu_prepare_wy_repr_bwd_full"
    _record(op)
    _head_inputs(op, (("k", k), ("v", v), ("A", A), ("dA", dA), ("dw", dw), ("du", du)))
    C, B, HK, HV, T, segs = _wy_inputs(op, k, v, beta, A, g, chunk_size, cu_seqlens, chunk_indices)
    dk, dv = torch.zeros(k.shape), torch.zeros(v.shape)
    dbeta, dg = torch.zeros(beta.shape), torch.zeros(g.shape)
    for b, s, e in segs:
        L = e - s
        Ac, dAc = (m._pad_chunks(x[b, :, s:e].float(), C) for x in (A, dA))
        with torch.enable_grad():
            ke = m.expand_heads(k[b, :, s:e].float(), HV).requires_grad_()
            vs = v[b, :, s:e].detach().float().requires_grad_()
            bt = beta[b, :, s:e].detach().float().requires_grad_()
            gam = g[b, :, s:e].detach().float().requires_grad_()
            w = Ac @ m._pad_chunks(bt[..., None] * ke * torch.exp(gam)[..., None], C)
            u = Ac @ m._pad_chunks(bt[..., None] * vs, C)
            loss = (m.wy_lower(ke, bt, gam, C) * dAc).sum() + (m._unpad(w, L) * dw[b, :, s:e].float()).sum() \
                + (m._unpad(u, L) * du[b, :, s:e].float()).sum()
            gk, gv, gb, gg = torch.autograd.grad(loss, (ke, vs, bt, gam))
        dk[b, :, s:e], dv[b, :, s:e], dbeta[b, :, s:e], dg[b, :, s:e] = m.reduce_heads(gk, HK), gv, gb, gg
    return dk.to(k.dtype), dv.to(v.dtype), dbeta.to(beta.dtype), dg.to(g.dtype)


# ------------------------------------------------------------------------------------- KDA pipeline
def _kda_lower_bound(op, use_gate_in_kernel, safe_gate, lower_bound, A_log, dt_bias, HV, K):
    """The bound the kernel's gate really uses: the sigmoid form only with safe_gate (default -5), else the
    softplus form (lower_bound ignored). With the in-kernel gate: A_log float32 [HV] required, dt_bias float32
    [HV*K] (or [HV, K]) if given, and with safe_gate the bound in [-5, 0)."""
    if not use_gate_in_kernel:
        return None
    if A_log is None or A_log.dtype != torch.float32 or tuple(A_log.shape) != (HV,):
        raise RuntimeError(f"{op}: A_log must be float32 [HV] when use_gate_in_kernel=True, got "
                           f"{None if A_log is None else (A_log.dtype, list(A_log.shape))}.")
    if dt_bias is not None and (dt_bias.dtype != torch.float32 or tuple(dt_bias.shape) not in ((HV * K,), (HV, K))):
        raise RuntimeError(f"{op}: dt_bias must be float32 [HV*K], got {dt_bias.dtype} {list(dt_bias.shape)}.")
    if not safe_gate:
        return None
    bound = -5.0 if lower_bound is None else float(lower_bound)
    if not -5.0 <= bound < 0.0:
        raise RuntimeError(f"{op}: lower_bound must be in [-5, 0) for safe gate, got {bound}.")
    return bound


_KDA_SLOTS = ("gk", "Aqk", "Akk", "w", "u", "qg", "kg", "qg_scaled", "q_hat", "k_hat", "q_rstd", "k_rstd",
              "beta_eff")
_KDA_MODES = {
    "none": ("gk", "Aqk", "w", "u", "kg", "qg_scaled"),
    "forward": ("gk", "Aqk", "Akk", "w", "u", "kg", "qg_scaled"),
    "recompute": ("gk", "Aqk", "Akk", "w", "u", "kg", "qg_scaled", "q_hat", "k_hat", "q_rstd", "k_rstd",
                  "beta_eff"),
    "save": _KDA_SLOTS,
}


def chunk_kda_fwd_prepare(q, k, v, g, beta, scale, chunk_size=64, *, layout="BSND", cu_seqlens=None,
                          chunk_indices=None, safe_gate=False, lower_bound=None, use_gate_in_kernel=False,
                          A_log=None, dt_bias=None, epsilon=1e-6, use_qk_l2norm_in_kernel=False,
                          use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, use_exp2=True,
                          backward_mode="save"):
    """KDA prepare: gates, L2 norm, beta and the WY tensors. ``layout`` describes q, k, v (BSND/BNSD rank 4,
    TND/NTD rank 3 packed); g [B,T,HV,K] and beta [B,T,HV] are token-major ([T,HV,K]/[T,HV] packed).

    Returns thirteen head-major slots ``(gk, Aqk, Akk, w, u, qg, kg, qg_scaled, q_hat, k_hat, q_rstd, k_rstd,
    beta_eff)`` ([B,N,T,...] or [N,T,...] packed; gk fp32 log2 cumulative gate with use_exp2, q_rstd/k_rstd
    and beta_eff fp32, the rest in q's dtype); slots not selected by ``backward_mode`` are None."""
    op = "npu_chunk_kda_fwd_prepare"
    _record(op)
    mode = str(backward_mode).lower()
    if mode not in _KDA_MODES:
        raise RuntimeError(f"{op}: backward_mode must be none/forward/recompute/save.")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_dtype(op, name, x)
    _check_chunk(op, chunk_size)
    rank = q.dim()
    if layout in ("TND", "NTD") and rank != 3:
        raise RuntimeError(f"{op}: layout {layout} takes rank-3 tensors")
    C = int(chunk_size)
    qh, kh, vh = (_to_head_major(op, x, layout).float() for x in (q, k, v))
    B, H, T, K = qh.shape
    HV, V = vh.shape[1], vh.shape[3]
    _check_dims(op, K, V)
    if HV % H:
        raise RuntimeError(f"{op}: GVA requires HV % HK == 0, got HV={HV}, HK={H}")
    lower_bound = _kda_lower_bound(op, use_gate_in_kernel, safe_gate, lower_bound, A_log, dt_bias, HV, K)
    cu = _host_list(op, cu_seqlens)
    if rank == 3 and cu is None:
        raise RuntimeError(f"{op}: packed TND/NTD inputs require cu_seqlens")
    _check_indices(op, cu, chunk_indices, C, required=False)
    segs = _segments(op, B, T, cu)
    g_hm = (g.unsqueeze(0) if rank == 3 else g).float().transpose(1, 2)           # [B,HV,T,K]
    b_tok = (beta.unsqueeze(0) if rank == 3 else beta)
    q_rstd = k_rstd = None
    if use_qk_l2norm_in_kernel:
        qh, q_rstd = m.l2norm_with_rstd(qh)
        kh, k_rstd = m.l2norm_with_rstd(kh)
    if use_gate_in_kernel:
        g_hm = m.kda_gate(g_hm, A_log, dt_bias, lower_bound)
    beta_eff = m.beta_activation(b_tok, use_beta_sigmoid_in_kernel, allow_neg_eigval).transpose(1, 2).contiguous()
    out = {name: vh.new_zeros(B, HV, T, K) for name in ("gk", "w", "qg", "kg", "qg_scaled")}
    out.update(Aqk=vh.new_zeros(B, HV, T, C), Akk=vh.new_zeros(B, HV, T, C), u=vh.new_zeros(B, HV, T, V))
    for b, s, e in segs:
        gam = m.chunk_cumsum(g_hm[b, :, s:e], C)
        P = m.prepare(m.expand_heads(qh[b, :, s:e], HV), m.expand_heads(kh[b, :, s:e], HV), vh[b, :, s:e],
                      beta_eff[b, :, s:e], gam, float(scale), C)
        out["gk"][b, :, s:e] = gam / _units(use_exp2)
        for name in ("Aqk", "Akk", "w", "u", "qg", "kg"):
            out[name][b, :, s:e] = P[name]
        out["qg_scaled"][b, :, s:e] = float(scale) * P["qg"]
    out.update(q_hat=qh, k_hat=kh, q_rstd=q_rstd, k_rstd=k_rstd, beta_eff=beta_eff)
    selected = set(_KDA_MODES[mode])
    result = []
    for name in _KDA_SLOTS:
        x = out[name] if name in selected else None
        if x is not None:
            if name not in ("gk", "q_rstd", "k_rstd", "beta_eff"):
                x = x.to(q.dtype)
            if rank == 3:
                x = x.squeeze(0)
        result.append(x)
    return tuple(result)


def _fwd_h_inputs(op, k, w, u, g, gk, use_exp2, cu, C):
    """Normalize chunk_fwd_h / summary inputs to [B, N, T, D] and per-segment (kg, decay) makers."""
    if (g is None) == (gk is None):
        raise RuntimeError(f"{op}: exactly one of g and gk must be provided.")
    packed = k.dim() == 3
    k4, w4, u4 = ((x.unsqueeze(0) if packed else x).float() for x in (k, w, u))
    gate = g if g is not None else gk
    gate4 = (gate.unsqueeze(0) if packed else gate).float() * _units(use_exp2)
    if packed and cu is None:
        raise RuntimeError(f"{op}: packed (rank-3) inputs require cu_seqlens")
    return packed, k4, w4, u4, gate4


def _segment_kg_decay(k_seg, gate_seg, per_channel, HV, C):
    """(kg, decay) of one segment: scalar g gates k internally; per-channel gk means k is already kg."""
    if per_channel:
        gc = m._pad_chunks(gate_seg, C, edge=True)
        return m.expand_heads(k_seg, HV), torch.exp(gc[:, :, -1, :])
    gc = m._pad_chunks(gate_seg, C, edge=True)                                  # [HV, NT, C]
    kc = m._pad_chunks(m.expand_heads(k_seg, HV), C)
    kg = m._unpad(kc * torch.exp(gc[:, :, -1:] - gc)[..., None], k_seg.shape[1])
    K = k_seg.shape[-1]
    return kg, torch.exp(gc[:, :, -1])[..., None].expand(-1, -1, K)


def chunk_fwd_h(k, w, u, g=None, *, gk=None, initial_state=None, output_final_state=False, chunk_size=64,
                save_new_value=True, cu_seqlens=None, chunk_indices=None, use_exp2=False, state_v_first=False):
    """Chunk state pass (wraps npu_chunk_gated_delta_rule_fwd_h). Head-major k, w [B,N,T,K] (or [N,T,K] packed),
    u [B,HV,T,V]; scalar cumulative g [B,HV,T] (k is gated inside) or per-channel cumulative gk [B,HV,T,K]
    (k is the prepared kg); log2 units with use_exp2. k, w, u bfloat16 only ("k, w and u must all use
    bfloat16"). Returns ``(h, v_new, final_state)``: h in ``h_layout()`` (chunk-first [B,NT,HV,K,V] or
    head-first [B,HV,NT,K,V]; packed: B = 1, NT = all chunks), final_state [N,HV,K,V] fp32 (None unless
    output_final_state)."""
    op = "npu_chunk_gated_delta_rule_fwd_h"
    _record(op)
    if any(x is not None and x.dim() != 4 for x in (k, w, u, g, gk) if x is not g):
        raise RuntimeError(f"{op}: k, w, u (and gk) must be rank-4 [B,N,T,D] tensors, got ranks "
                           f"{[x.dim() for x in (k, w, u) if x is not None]}")
    if state_v_first:
        raise RuntimeError(f"{op}: the stand-in implements state_v_first=False only")
    for name, x in (("k", k), ("w", w), ("u", u)):
        _check_dtype(op, name, x, bf16_only=True)
    _check_chunk(op, chunk_size)
    C = int(chunk_size)
    cu = _host_list(op, cu_seqlens)
    packed, k4, w4, u4, gate4 = _fwd_h_inputs(op, k, w, u, g, gk, use_exp2, cu, C)
    B, HV, T, K = w4.shape
    V = u4.shape[-1]
    segs = _segments(op, B, T, cu)
    _check_indices(op, cu, chunk_indices, C, required=False)
    v_new = u4.new_zeros(B, HV, T, V)
    hs, finals = {}, []
    for n, (b, s, e) in enumerate(segs):
        kg, decay = _segment_kg_decay(k4[b, :, s:e], gate4[b, :, s:e], gk is not None, HV, C)
        h0 = None if initial_state is None else initial_state[n]
        h, vn, S = m.state_pass(w4[b, :, s:e], u4[b, :, s:e], kg, decay, C, h0)
        v_new[b, :, s:e] = vn
        hs.setdefault(b, []).append(h)
        finals.append(S)
    h_all = _h_out(torch.stack([torch.cat(hs[b], 1) for b in sorted(hs)], 0).to(k.dtype))
    v_new = v_new.squeeze(0) if packed else v_new
    return (h_all, v_new.to(u.dtype) if save_new_value else None,
            torch.stack(finals, 0) if output_final_state else None)


def _split_h(h, segs, T, C):
    """Per-segment chunk ranges of a [B, HV, NT, ...] chunk-state tensor."""
    ranges, offset, last_b = [], 0, None
    for b, s, e in segs:
        if b != last_b:
            offset, last_b = 0, b
        nt = m.num_chunks(e - s, C)
        ranges.append((b, offset, offset + nt))
        offset += nt
    return ranges


def chunk_kda_fwd_finalize(qg_scaled, aqk, v_new, h, *, output_layout="BSND", state_v_first=False,
                           cu_seqlens=None, chunk_indices=None):
    """KDA output: o = qg_scaled h_c + Aqk v_new per chunk. Inputs head-major ([B,HV,T,...] or packed
    [HV,T,...]), all bfloat16; h in ``h_layout()`` (rank 5, B = 1 when packed); the output is written in
    ``output_layout`` in qg_scaled's dtype."""
    op = "npu_chunk_kda_fwd_finalize"
    _record(op)
    if output_layout not in LAYOUTS:
        raise RuntimeError(f"{op}: output_layout must be one of {LAYOUTS}, got {output_layout!r}")
    for name, x in (("qg_scaled", qg_scaled), ("aqk", aqk), ("v_new", v_new), ("h", h)):
        _check_dtype(op, name, x, bf16_only=True)
    packed = qg_scaled.dim() == 3
    q4, a4, v4 = ((x.unsqueeze(0) if packed else x).float() for x in (qg_scaled, aqk, v_new))
    B, HV, T, _ = q4.shape
    C = a4.shape[-1]
    cu = _host_list(op, cu_seqlens)
    segs = _segments(op, B, T, cu)
    h = _h_in(op, "h", h, B, HV, _total_chunks(T, cu, C))
    o = v4.new_zeros(v4.shape)
    for (b, s, e), (_, c0, c1) in zip(segs, _split_h(h, segs, T, C)):
        o[b, :, s:e] = m.outputs(q4[b, :, s:e], a4[b, :, s:e], v4[b, :, s:e], h[b, :, c0:c1].float(), 1.0, C)
    return _from_head_major(o, output_layout, 3 if packed else 4).to(qg_scaled.dtype)


def chunk_kda_bwd_prepare(aqk, v_new, d_o, h, *, scale=None, chunk_size=64, state_v_first=False, layout="BNSD",
                          cu_seqlens=None, chunk_indices=None):
    """First KDA backward stage (op-def ChunkKdaBwdPrepare: Ascend 950 only, bf16 inputs). Head-major inputs
    (``layout`` BNSD, or NTD packed); h in ``h_layout()``. Returns three slots ``(d_aqk, dv, dq_raw)``: d_aqk =
    tril(d_o v_new^T) [.., T, 64] fp32 (gradient of Aqk), dv = Aqk^T d_o (intra-chunk part) in d_o's dtype and
    dq_raw = d_o h_c^T (gradient of qg_scaled) fp32."""
    op = "npu_chunk_kda_bwd_prepare"
    _record(op)
    if layout not in ("BNSD", "NTD"):
        raise RuntimeError(f"{op}: layout must be BNSD or NTD (head-major), got {layout!r}")
    for name, x in (("aqk", aqk), ("v_new", v_new), ("d_o", d_o), ("h", h)):
        _check_dtype(op, name, x, bf16_only=True)
    _check_chunk(op, chunk_size)
    packed = aqk.dim() == 3
    a4, v4, d4 = ((x.unsqueeze(0) if packed else x).float() for x in (aqk, v_new, d_o))
    B, HV, T, C = a4.shape
    cu = _host_list(op, cu_seqlens)
    segs = _segments(op, B, T, cu)
    h = _h_in(op, "h", h, B, HV, _total_chunks(T, cu, C))
    d_aqk, dv = torch.zeros_like(a4), torch.zeros_like(v4)
    dq_raw = v4.new_zeros(B, HV, T, h.shape[-2])
    causal = torch.tril(torch.ones(C, C, dtype=torch.bool))
    for (b, s, e), (_, c0, c1) in zip(segs, _split_h(h, segs, T, C)):
        L = e - s
        ac, vc, dc = (m._pad_chunks(x[b, :, s:e], C) for x in (a4, v4, d4))
        d_aqk[b, :, s:e] = m._unpad((dc @ vc.transpose(-1, -2)).masked_fill(~causal, 0.0), L)
        dv[b, :, s:e] = m._unpad(ac.transpose(-1, -2) @ dc, L)
        dq_raw[b, :, s:e] = m._unpad(dc @ h[b, :, c0:c1].float().transpose(-1, -2), L)
    squeeze = (lambda x: x.squeeze(0)) if packed else (lambda x: x)
    return squeeze(d_aqk), squeeze(dv).to(d_o.dtype), squeeze(dq_raw)


def chunk_gated_delta_rule_bwd_dhu(q, k, w, d_o, dv, scale, chunk_size, *, g=None, gK=None, h0=None, dht=None,
                                   cu_seqlens=None, chunk_indices=None, use_exp2=False,
                                   transpose_state_layout=False):
    """Reverse state pass. BNSD q, k, w [B,N,T,K], d_o, dv [B,HV,T,V]; scalar cumulative g [B,HV,T] (q, k
    ungated, gated inside) or per-channel gK [B,HV,T,K] (q = qg, k = kg prepared; requires use_exp2).
    Returns ``(dh, dh0, dv2)``: dh (``h_layout()``) with dh[c] = dL/d(state leaving chunk c), dh0 [N,HV,K,V] in
    q's dtype (None without h0; h0 itself only selects it and is taken in q's dtype family), dv2 = dv + kg dh[c].
    The pinned revision ignores ``dht`` (its examples append two dummy chunks instead); with cu_seqlens but no
    chunk_indices it sizes dh as ceil(T/64) chunks."""
    op = "npu_chunk_gated_delta_rule_bwd_dhu"
    _record(op)
    for name, x in (("q", q), ("k", k), ("w", w), ("d_o", d_o), ("dv", dv), ("h0", h0), ("dht", dht)):
        _check_dtype(op, name, x)
    if not _flag("FLA_NPU_STANDIN_DHU_USES_DHT"):
        dht = None
    if (g is None) == (gK is None):
        raise ValueError("Exactly one of g and gK must be provided.")
    if gK is not None and not use_exp2:
        raise ValueError("use_exp2 must be true when gK is provided.")
    if transpose_state_layout:
        raise RuntimeError(f"{op}: the stand-in implements transpose_state_layout=False only")
    C = int(chunk_size)
    cu = _host_list(op, cu_seqlens)
    _, k4, w4, dv4, gate4 = _fwd_h_inputs(op, k, w, dv, g, gK, use_exp2, cu, C)
    q4, do4 = q.float(), d_o.float()
    B, HV, T, K = w4.shape
    segs = _segments(op, B, T, cu)
    _check_indices(op, cu, chunk_indices, C, required=False)
    if cu is not None and chunk_indices is None and -(-T // C) != sum(m.num_chunks(e - s, C) for _, s, e in segs):
        raise RuntimeError(f"{op}: without chunk_indices dh has ceil(T/{C}) = {-(-T // C)} chunks, but "
                           f"cu_seqlens {cu} needs {sum(m.num_chunks(e - s, C) for _, s, e in segs)} "
                           "(the real op writes a wrongly sized dh)")
    dhs, dh0s = {}, []
    dv2 = torch.zeros_like(dv4)
    for n, (b, s, e) in enumerate(segs):
        kg, decay = _segment_kg_decay(k4[b, :, s:e], gate4[b, :, s:e], gK is not None, HV, C)
        qg = m.expand_heads(q4[b, :, s:e], HV)
        if gK is None:
            qg = qg * torch.exp(gate4[b, :, s:e])[..., None]
        dh, dS0, dv2_seg = m.state_backward(qg, kg, w4[b, :, s:e], do4[b, :, s:e], dv4[b, :, s:e], decay,
                                            float(scale), C, None if dht is None else dht[n])
        dhs.setdefault(b, []).append(dh)
        dh0s.append(dS0)
        dv2[b, :, s:e] = dv2_seg
    dh_all = _h_out(torch.stack([torch.cat(dhs[b], 1) for b in sorted(dhs)], 0).to(q.dtype))
    return dh_all, (torch.stack(dh0s, 0).to(q.dtype) if h0 is not None else None), dv2.to(dv.dtype)


def chunk_kda_bwd_finalize(q, k, v, gk, raw_g, beta, a_log, dt_bias, akk, v_new, h, dh, dv_scan, d_aqk, dq_raw, *,
                           q_rstd=None, k_rstd=None, scale=None, chunk_size=64, use_exp2=True,
                           use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                           allow_neg_eigval=False, safe_gate=False, lower_bound=None, output_layout="BNSD",
                           cu_seqlens=None, chunk_indices=None):
    """Last KDA backward stage: input gradients from the stage outputs (the fla-npu kernel's 19 inputs, 7 outputs).

    Head-major inputs: q, k = prepare's q_hat/k_hat [B,H,T,K]; v [B,HV,T,V]; gk the prepared cumulative gate;
    raw_g the caller's g [B,HV,T,K] (gate input with use_gate_in_kernel, else the log gate itself); beta =
    beta_eff [B,HV,T]; h, dh in ``h_layout()``; dv_scan (dhu's dv2), d_aqk, dq_raw from bwd_prepare. Op-def
    ChunkKdaBwdFinalize: Ascend 950 only; q, k, v, akk, v_new, h, dh, dv_scan bf16; gk, raw_g, d_aqk, dq_raw
    fp32 (the stand-in's ALLOW_FP32 widens the bf16 ones, never the fp32 ones). Returns seven
    slots ``(dq, dk, dv, dbeta, dg, da_log, ddt_bias)``: dq, dk (w.r.t. raw q/k with in-kernel L2 norm), dv in
    ``output_layout``; dbeta [B,HV,T] and dg [B,HV,T,K] head-major fp32 (w.r.t. raw beta with the in-kernel
    sigmoid, raw g); da_log [HV] and ddt_bias [HV*K] fp32 with the in-kernel gate, else None."""
    op = "npu_chunk_kda_bwd_finalize"
    _record(op)
    if output_layout not in LAYOUTS:
        raise RuntimeError(f"{op}: output_layout must be one of {LAYOUTS}, got {output_layout!r}")
    for name, x in (("q", q), ("k", k), ("v", v), ("akk", akk), ("v_new", v_new), ("h", h), ("dh", dh),
                    ("dv_scan", dv_scan)):
        _check_dtype(op, name, x, bf16_only=True)
    for name, x in (("gk", gk), ("raw_g", raw_g), ("d_aqk", d_aqk), ("dq_raw", dq_raw)):
        _check_strict_dtype(op, name, x, (torch.float32,))
    C = int(chunk_size)
    packed = q.dim() == 3
    up = (lambda x: x.unsqueeze(0)) if packed else (lambda x: x)
    lower_bound = _kda_lower_bound(op, use_gate_in_kernel, safe_gate, lower_bound, a_log, dt_bias, v.shape[-3],
                                   q.shape[-1])
    with torch.enable_grad():
        qh = up(q).detach().float().requires_grad_()
        kh = up(k).detach().float().requires_grad_()
        vh = up(v).detach().float().requires_grad_()
        g_in = up(raw_g).detach().float().requires_grad_()
        beta_e = up(beta).detach().float().requires_grad_()
        params = []
        A_log = dtb = None
        if use_gate_in_kernel:
            A_log = None if a_log is None else a_log.detach().float().requires_grad_()
            dtb = None if dt_bias is None else dt_bias.detach().float().requires_grad_()
            params = [p for p in (A_log, dtb) if p is not None]
        B, H, T, K = qh.shape
        HV = vh.shape[1]
        cu = _host_list(op, cu_seqlens)
        segs = _segments(op, B, T, cu)
        gate = m.kda_gate(g_in, A_log, dtb, lower_bound) if use_gate_in_kernel else g_in
        NT = _total_chunks(T, cu, C)
        h4, dh4 = _h_in(op, "h", h, B, HV, NT).float(), _h_in(op, "dh", dh, B, HV, NT).float()
        vn4, dvs4, daqk4, dqr4 = (up(x).float() for x in (v_new, dv_scan, d_aqk, dq_raw))
        loss = 0.0
        for (b, s, e), (_, c0, c1) in zip(segs, _split_h(h4, segs, T, C)):
            L = e - s
            gam = m.chunk_cumsum(gate[b, :, s:e], C)
            P = m.prepare(m.expand_heads(qh[b, :, s:e], HV), m.expand_heads(kh[b, :, s:e], HV), vh[b, :, s:e],
                          beta_e[b, :, s:e], gam, float(scale), C)
            hc, dhc = h4[b, :, c0:c1], dh4[b, :, c0:c1]
            dvs = m._pad_chunks(dvs4[b, :, s:e], C)
            d_w = m._unpad(-(dvs @ hc.transpose(-1, -2)), L)
            d_kg = m._unpad(m._pad_chunks(vn4[b, :, s:e], C) @ dhc.transpose(-1, -2), L)
            d_decay = (hc * dhc).sum(-1)
            loss = loss + (P["qg"] * float(scale) * dqr4[b, :, s:e]).sum() + (P["Aqk"] * daqk4[b, :, s:e]).sum() \
                + (P["u"] * dvs4[b, :, s:e]).sum() + (P["w"] * d_w).sum() + (P["kg"] * d_kg).sum() \
                + (P["decay"] * d_decay).sum()
        leaves = [qh, kh, vh, g_in, beta_e] + params
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    dq, dk, dv, dg, dbeta = (torch.zeros_like(x) if gr is None else gr for x, gr in zip(leaves[:5], grads[:5]))
    if use_qk_l2norm_in_kernel:
        dq = m.l2norm_backward(qh.detach(), up(q_rstd), dq)
        dk = m.l2norm_backward(kh.detach(), up(k_rstd), dk)
    if use_beta_sigmoid_in_kernel:
        dbeta = dbeta * _beta_derivative(beta_e.detach(), allow_neg_eigval)
    da_log = ddt = None
    if use_gate_in_kernel:
        rest = list(grads[5:])
        da_log = (rest.pop(0) if A_log is not None else None)
        ddt = (rest.pop(0) if dtb is not None else None)
        da_log = torch.zeros_like(A_log) if (A_log is not None and da_log is None) else da_log
        ddt = torch.zeros_like(dtb) if (dtb is not None and ddt is None) else ddt
    rank = 3 if packed else 4
    sq = (lambda x: x.squeeze(0)) if packed else (lambda x: x)
    return (_from_head_major(dq, output_layout, rank).to(q.dtype),
            _from_head_major(dk, output_layout, rank).to(k.dtype),
            _from_head_major(dv, output_layout, rank).to(v.dtype), sq(dbeta), sq(dg), da_log, ddt)


def chunk_kda_bwd(q, k, v, beta, gk, Aqk, Akk, w, qg, kg, v_new, h, d_o, scale, *, raw_g=None, A_log=None,
                  dt_bias=None, initial_state=None, dht=None, cu_seqlens=None, chunk_indices=None, chunk_size=64,
                  safe_gate=True, lower_bound=-5.0, use_gate_in_kernel=False, disable_recompute=True, use_exp2=True,
                  state_v_first=False):
    """The monolithic KDA backward ``npu_chunk_kda_bwd`` (op-def ChunkKdaBwd: Ascend 910B, 910_93 and 950).

    Contract of the undated ``_stable.py`` version that returns 8 slots, with the checks of the 7a8a59a3
    ``_aclnn_ctypes.py`` wrapper: head-major dense ``[B,H,T,D]`` or packed ``[H,T,D]`` with ``cu_seqlens`` (at most
    1024 sequences, canonical ``chunk_indices``); q and k of one shape and v of q's ``[B,H,T]`` prefix (no GVA);
    K = 128, V in {128, 256}; q/k/v one bf16/fp16 dtype; gk fp32 (log2 chunk-cumulative gate); beta fp32/bf16;
    h chunk-first ``[B,NT,H,K,V]`` (packed ``[NT,H,K,V]``); the forward's saved Aqk / Akk / w / qg / kg / v_new.
    Refuses ``initial_state`` / ``dht``, ``safe_gate=False``, ``disable_recompute=False``, ``use_exp2=False``,
    ``state_v_first=True``. Returns ``(dq, dk, dv, db, dg, dh0, dA, dbias)``: dq, dk, db, dg fp32, dv in v's
    dtype, all head-major; dg w.r.t. the per-token log gate (w.r.t. raw_g with the in-kernel gate); dh0 None;
    dA [H] / dbias [H,K] fp32 with the in-kernel gate, else None. Values: the kernel's stages
    (d_o -> intra dv / dAqk / dq, the reverse state pass from a zero terminal gradient, the WY / gate chain)."""
    op = "npu_chunk_kda_bwd"
    _record(op)
    if int(chunk_size) != 64:
        raise RuntimeError(f"{op}: chunk_size must be 64.")
    for flag, ok, what in ((disable_recompute, True, "disable_recompute=false"), (use_exp2, True, "use_exp2=false"),
                           (state_v_first, False, "state_v_first=true"), (safe_gate, True, "safe_gate=False")):
        if bool(flag) != ok:
            raise RuntimeError(f"{op}: {what} is reserved but not supported.")
    if initial_state is not None or dht is not None:
        raise RuntimeError(f"{op}: initial_state and dht are not supported by the current fused backward.")
    cu = _host_list(op, cu_seqlens)
    varlen = cu is not None
    rank = 3 if varlen else 4
    if any(x.dim() != rank for x in (q, k, v)):
        raise RuntimeError(f"{op}: dense inputs use [B,H,T,D]; varlen inputs use [H,T,D].")
    if q.shape != k.shape:
        raise RuntimeError(f"{op}: q and k must have identical shape.")
    if v.shape[:-1] != q.shape[:-1]:
        raise RuntimeError(f"{op}: v must share q's [B,H,T] or [H,T] prefix.")
    K, V = q.shape[-1], v.shape[-1]
    if K != 128 or V not in (128, 256):
        raise RuntimeError(f"{op}: current fused path requires K=128 and V in {{128,256}}.")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_dtype(op, name, x)
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise RuntimeError(f"{op}: q/k/v must use the same float16 or bfloat16 dtype.")
    key_shape, value_shape, matrix_shape = (*q.shape[:-1], K), (*q.shape[:-1], V), (*q.shape[:-1], 64)
    for name, x, want in (("gk", gk, key_shape), ("w", w, key_shape), ("qg", qg, key_shape), ("kg", kg, key_shape),
                          ("v_new", v_new, value_shape), ("d_o", d_o, value_shape), ("Aqk", Aqk, matrix_shape),
                          ("Akk", Akk, matrix_shape), ("beta", beta, q.shape[:-1])):
        if tuple(x.shape) != tuple(want):
            raise RuntimeError(f"{op}: {name} must have shape {tuple(want)}.")
    _check_strict_dtype(op, "gk", gk, (torch.float32,))
    _check_strict_dtype(op, "beta", beta, (torch.float32, torch.bfloat16))
    if varlen and len(cu) - 1 > 1024:
        raise RuntimeError(f"{op}: varlen supports at most 1024 sequences.")
    _check_indices(op, cu, chunk_indices, 64, required=False)
    up = (lambda x: None if x is None else x.unsqueeze(0)) if varlen else (lambda x: x)
    B, H, T = up(q).shape[:3]
    NT = _total_chunks(T, cu, 64)
    want_h = (B, NT, H, K, V)
    if tuple(up(h).shape) != want_h:
        raise RuntimeError(f"{op}: h must have shape {want_h[1:] if varlen else want_h}.")
    if use_gate_in_kernel:
        if raw_g is None or A_log is None:
            raise RuntimeError(f"{op}: raw_g and A_log are required when use_gate_in_kernel=True.")
        if tuple(raw_g.shape) != tuple(key_shape) or raw_g.dtype not in (torch.float32, torch.bfloat16):
            raise RuntimeError(f"{op}: raw_g must be BF16/FP32 with the same shape as gk.")
        if dt_bias is not None and (tuple(dt_bias.shape) != (H, K) or dt_bias.dtype != torch.float32):
            raise RuntimeError(f"{op}: dt_bias must be float32 [H,K].")
    elif any(x is not None for x in (raw_g, A_log, dt_bias)):
        raise RuntimeError(f"{op}: raw_g/A_log/dt_bias require use_gate_in_kernel=True.")
    q4, k4, v4, b4, gk4, aqk4, akk4, w4, qg4, kg4, vn4, do4 = (
        up(x) for x in (q, k, v, beta, gk, Aqk, Akk, w, qg, kg, v_new, d_o))
    h_b = _h_out(up(h).transpose(1, 2))                  # the internal stages read h in this build's layout
    if use_gate_in_kernel:
        g_raw = up(raw_g).float()
    else:  # the per-token log gate behind gk (natural log)
        g_raw = torch.zeros_like(gk4)
        for b, s, e in m.segments(B, T, cu):
            g_raw[b, :, s:e] = m.per_token_gate(gk4[b, :, s:e] * m.LN2, 64)
    _INSIDE.append(op)
    try:
        d_aqk, dv_local, dq_raw = _IMPL["chunk_kda_bwd_prepare"](aqk4, vn4, do4, h_b, scale=scale, layout="BNSD",
                                                                 cu_seqlens=cu)
        dh, _, dv2 = chunk_gated_delta_rule_bwd_dhu(qg4, kg4, w4, do4, dv_local, scale, 64, gK=gk4, cu_seqlens=cu,
                                                    chunk_indices=chunk_indices, use_exp2=True)
        dq, dk, dv, db, dg, da, dbias = _IMPL["chunk_kda_bwd_finalize"](
            q4, k4, v4, gk4, g_raw, b4, A_log, dt_bias, akk4, vn4, h_b, dh, dv2, d_aqk, dq_raw, scale=scale,
            use_exp2=True, use_gate_in_kernel=use_gate_in_kernel, safe_gate=True, lower_bound=lower_bound,
            output_layout="BNSD", cu_seqlens=cu)
    finally:
        _INSIDE.pop()
    sq = (lambda x: x.squeeze(0)) if varlen else (lambda x: x)
    return (sq(dq).float(), sq(dk).float(), sq(dv).to(v.dtype), sq(db).float(), sq(dg).float(), None, da, dbias)


# ------------------------------------------------------------------------------------------- CP ops
def _summary_inputs(op, k, w, u, g, gk, chunk_size):
    """The CP summary kernels' checks (chunk 64, B = 1, K = V = 128) and inputs: (C, k, w, u as [1, N, T, D] fp32,
    the base-2 gate)."""
    _check_chunk(op, chunk_size)
    C = int(chunk_size)
    _, k4, w4, u4, gate4 = _fwd_h_inputs(op, k, w, u, g, gk, True, None, C)
    B, _, _, K = w4.shape
    if B != 1:
        raise RuntimeError(f"{op}: batch must be 1, got {B}")
    _check_dims(op, K, u4.shape[-1])
    return C, k4, w4, u4, gate4


def pre_process_fwd_kernel_merged(k, w, u, g=None, *, gk=None, bg=None, v=None, cu_seqlens=None, chunk_size=64):
    """Forward affine summaries of token windows: hm [Nseq, HV, K, V+K] fp32 = [E | M] per window, with
    S_out = M S_in + E. BNSD inputs with B = 1 and K = V = 128; g (scalar, k ungated) or gk (per channel,
    k = kg) as base-2 chunk-local cumulative gates; cu_seqlens (required host list) may be a sub-interval.
    Windows must start at the chunk grid the inputs were prepared on. DPLR slots (bg, v) are rejected."""
    op = "npu_pre_process_fwd_kernel_merged"
    _record(op)
    if bg is not None or v is not None:
        raise RuntimeError(f"{op}: bg and v are DPLR-only and must be None")
    cu = _host_list(op, cu_seqlens)
    if cu is None:
        raise RuntimeError(f"{op}: cu_seqlens (host list) is required")
    _check_nonempty(op, cu)
    C, k4, w4, u4, gate4 = _summary_inputs(op, k, w, u, g, gk, chunk_size)
    _, HV, T, K = w4.shape
    V = u4.shape[-1]
    if cu[0] < 0 or cu[-1] > T:
        raise RuntimeError(f"{op}: cu_seqlens must lie in [0, {T}], got {cu}")
    hm = w4.new_zeros(len(cu) - 1, HV, K, V + K)
    for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        kg, decay = _segment_kg_decay(k4[0, :, s:e], gate4[0, :, s:e], gk is not None, HV, C)
        _, _, E = m.state_pass(w4[0, :, s:e], u4[0, :, s:e], kg, decay, C)
        hm[n, :, :, :V] = E
        hm[n, :, :, V:] = m.transition(w4[0, :, s:e], kg, decay, C)
    return hm


def chunk_delta_h_bwd_preprocess(q, k, w, d_o, dv, scale, chunk_size, *, g=None, gk=None, cu_seqlens=None):
    """Backward summary of one token window: dhm [HV, K, V+K] fp32 = [dS_loc | M^T], dS_loc the gradient of
    the window's outputs w.r.t. its initial state (zero terminal gradient) and M its transition. BNSD,
    B = 1; GDN passes raw q, k with scalar g, KDA passes qg, kg with gk (base-2 cumulative gates); dv is
    the intra-chunk dv (chunk_bwd_dv_local / chunk_kda_bwd_prepare); cu_seqlens = [start, end] (non-empty).
    Named ``pre_process_bwd_kernel_merged`` in later revisions. gk must be bfloat16/float16."""
    op = "npu_chunk_delta_h_bwd_preprocess"
    _record(op)
    _check_strict_dtype(op, "gk", gk, (torch.bfloat16, torch.float16))
    cu = _host_list(op, cu_seqlens)
    if cu is None or len(cu) != 2:
        raise RuntimeError(f"{op}: cu_seqlens must be one window [start, end], got {cu}")
    _check_nonempty(op, cu)
    C, k4, w4, dv4, gate4 = _summary_inputs(op, k, w, dv, g, gk, chunk_size)
    HV = w4.shape[1]
    s, e = cu
    kg, decay = _segment_kg_decay(k4[0, :, s:e], gate4[0, :, s:e], gk is not None, HV, C)
    qg = m.expand_heads(q.float()[0, :, s:e], HV)
    if gk is None:
        qg = qg * torch.exp(gate4[0, :, s:e])[..., None]
    _, dS, _ = m.state_backward(qg, kg, w4[0, :, s:e], d_o.float()[0, :, s:e], dv4[0, :, s:e], decay,
                                float(scale), C)
    M = m.transition(w4[0, :, s:e], kg, decay, C)
    return torch.cat([dS, M.transpose(-1, -2)], dim=-1)


def merge_fwd_bwd_kernel(h, ag_hm, pre_or_post_num_ranks, rank, *, forward=True, state_v_first=False):
    """Fold gathered summaries into ``h`` [HV, 128, 128] in place: forward, for j = rank - n .. rank - 1,
    h <- ag_hm[j, ..., V:] h + ag_hm[j, ..., :V]; backward, for j = rank + n down to rank + 1, the same with
    the backward summaries [dS_loc | M^T]. ag_hm [S, HV, 128, 256] fp32/bf16, S <= 1024, HV <= 256."""
    op = "npu_merge_fwd_bwd_kernel"
    _record(op)
    if state_v_first:
        raise RuntimeError(f"{op}: the stand-in implements state_v_first=False only")
    S, HV, K, W = ag_hm.shape
    V = W - K
    if K != 128 or V != 128 or tuple(h.shape) != (HV, K, V):
        raise RuntimeError(f"{op}: h must be [HV,128,128] and ag_hm [S,HV,128,256], got {list(h.shape)}, "
                           f"{list(ag_hm.shape)}")
    if S > 1024 or HV > 256:
        raise RuntimeError(f"{op}: supports S <= 1024 and HV <= 256, got S={S}, HV={HV}")
    if ag_hm.dtype not in (torch.float32, torch.bfloat16) or h.dtype != torch.float32:
        raise RuntimeError(f"{op}: ag_hm must be fp32/bf16 and h fp32")
    n, rank = int(pre_or_post_num_ranks), int(rank)
    if n <= 0:
        raise RuntimeError(f"{op}: pre_or_post_num_ranks must be positive, got {n}")
    order = range(rank - n, rank) if forward else range(rank + n, rank, -1)
    if n and (min(order) < 0 or max(order) >= S):
        raise RuntimeError(f"{op}: ranks {list(order)} outside [0, {S})")
    state = h.float()
    for j in order:
        hm = ag_hm[j].float()
        state = hm[..., V:] @ state + hm[..., :V]
    h.copy_(state)
    return None


# ------------------------------------------------------------------------------------- recurrent (decode)
MAX_RECURRENT_TOKENS = 8    # tokens per sequence of one recurrent call (MAX_MTP in the kernels)


def _check_types(op, tensors, allowed, strict=False):
    """TypeError, as the recurrent wrappers raise, when a tensor's dtype is not allowed (ALLOW_FP32 widens
    bf16-only inputs unless ``strict``)."""
    extra = () if strict or not ALLOW_FP32 else (torch.float32,)
    for name, x in tensors.items():
        if x is not None and x.dtype not in tuple(allowed) + extra:
            raise TypeError(f"{op}: {name} dtype must be one of {[str(d) for d in allowed]}, got {x.dtype}.")


def recurrent_gated_delta_rule(query, key, value, state, *, beta, scale=1.0, actual_seq_lengths,
                               ssm_state_indices, num_accepted_tokens=None, g=None, gk=None):
    """Recurrent GDN, updating ``state`` in place (the wrapper since fla-npu 8a63cf3e, 2026-08-13).

    query/key [T, Nk, Dk], value [T, Nv, Dv], beta [T, Nv] bfloat16; state V-first [blocks, Nv, Dv, Dk] bf16 or
    fp32; actual_seq_lengths int32 [B + 1] = (start offset, L_1, ..., L_B) with 1 <= L_i <= 8; ssm_state_indices
    int32 [T]: sequence i starts from state[ssm_state_indices[its first token]] and token t writes its state to
    state[ssm_state_indices[t]]; g fp32 [T, Nv] (decay e^g) and/or gk fp32 [T, Nv, Dk]. Dk = Dv = 128, Nk, Nv <=
    256, Nv % Nk == 0; scale a float. No in-kernel L2 norm, gate or sigmoid. Returns out [T, Nv, Dv] in value's
    dtype: per token S <- e^g S Diag(e^gk); S <- S + beta (v - S k) k^T; o = S (scale q)."""
    op = "npu_recurrent_gated_delta_rule"
    _record(op)
    if g is None and gk is None:
        raise RuntimeError(f"{op}: either g or gk must be provided.")
    if num_accepted_tokens is not None:
        raise RuntimeError(f"{op}: the stand-in implements num_accepted_tokens=None only")
    named = {"query": query, "key": key, "value": value, "state": state, "beta": beta,
             "actual_seq_lengths": actual_seq_lengths, "ssm_state_indices": ssm_state_indices}
    for name, x in named.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x)!r}.")
    _check_types(op, {"query": query, "key": key, "value": value, "beta": beta}, (torch.bfloat16,))
    _check_types(op, {"state": state}, (torch.bfloat16, torch.float32), strict=True)
    _check_types(op, {"actual_seq_lengths": actual_seq_lengths, "ssm_state_indices": ssm_state_indices},
                 (torch.int32,), strict=True)
    _check_types(op, {"g": g, "gk": gk}, (torch.float32,), strict=True)
    ranks = {"query": 3, "key": 3, "value": 3, "beta": 2, "state": 4, "actual_seq_lengths": 1,
             "ssm_state_indices": 1, "g": 2, "gk": 3}
    for name, rank in ranks.items():
        x = {**named, "g": g, "gk": gk}[name]
        if x is not None and x.dim() != rank:
            raise RuntimeError(f"{op}: {name} must be rank {rank}, got shape {tuple(x.shape)}.")
    if query.shape != key.shape:
        raise RuntimeError(f"{op}: key shape must equal query shape.")
    T, Nk, Dk = query.shape
    Nv, Dv = value.shape[1], value.shape[2]
    if value.shape[0] != T or tuple(beta.shape) != (T, Nv):
        raise RuntimeError(f"{op}: value/beta must be [T, Nv, Dv] / [T, Nv] with T={T}.")
    if tuple(state.shape[1:]) != (Nv, Dv, Dk):
        raise RuntimeError(f"{op}: state shape must be {(state.shape[0], Nv, Dv, Dk)}, got {tuple(state.shape)}.")
    if tuple(ssm_state_indices.shape) != (T,):
        raise RuntimeError(f"{op}: ssm_state_indices shape must be ({T},), got {tuple(ssm_state_indices.shape)}.")
    if g is not None and tuple(g.shape) != (T, Nv) or gk is not None and tuple(gk.shape) != (T, Nv, Dk):
        raise RuntimeError(f"{op}: g must be (T, Nv) and gk (T, Nv, Dk).")
    if Nk > 256 or Nv > 256 or Dk != 128 or Dv != 128:
        raise RuntimeError(f"{op}: Nk and Nv must be <= 256 and Dk and Dv must be exactly 128, got Nk={Nk}, "
                           f"Nv={Nv}, Dk={Dk}, Dv={Dv}.")
    if Nv % Nk:
        raise RuntimeError(f"{op}: Nv must be an integer multiple of Nk, got Nv={Nv}, Nk={Nk}.")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, float)):
        raise RuntimeError(f"{op}: scale must be a floating-point number, got {type(scale)!r}.")
    seqs = [int(x) for x in actual_seq_lengths.tolist()]
    if len(seqs) < 2:
        raise RuntimeError(f"{op}: actual_seq_lengths must contain the prefix entry and at least one sequence "
                           "length.")
    index = [int(x) for x in ssm_state_indices.tolist()]
    if any(not 0 <= i < state.shape[0] for i in index):
        raise RuntimeError(f"{op}: ssm_state_indices must lie in [0, {state.shape[0]}), got {index}")
    group = Nv // Nk
    qs = query.float().repeat_interleave(group, 1) * (1.0 if scale is None else scale)
    ks = key.float().repeat_interleave(group, 1)
    vs, bs = value.float(), beta.float()
    pool = state.float().clone()
    out = vs.new_zeros(T, Nv, Dv)
    start = seqs[0]
    for L in seqs[1:]:
        if not 1 <= L <= MAX_RECURRENT_TOKENS or start + L > T:
            raise RuntimeError(f"{op}: sequence lengths must be in [1, {MAX_RECURRENT_TOKENS}] within T={T}, "
                               f"got actual_seq_lengths {seqs}")
        S = pool[index[start]].clone()                                           # [Nv, Dv, Dk]
        for t in range(start, start + L):
            if g is not None:
                S = S * g[t].float().exp()[:, None, None]
            if gk is not None:
                S = S * gk[t].float().exp()[:, None, :]
            delta = (vs[t] - (S @ ks[t][..., None])[..., 0]) * bs[t][:, None]       # [Nv, Dv]
            S = S + delta[:, :, None] * ks[t][:, None, :]
            out[t] = (S @ qs[t][..., None])[..., 0]
            pool[index[t]] = S
        start += L
    state.copy_(pool.to(state.dtype))
    return out.to(value.dtype)


def recurrent_kda(q, k, v, g, beta, initial_state=None, *, cu_seqlens=None, ssm_state_indices=None, A_log=None,
                  dt_bias=None, num_accepted_tokens=None, layout="BSND", scale=None, output_final_state=False,
                  inplace_final_state=True, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                  use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False, lower_bound=None,
                  state_v_first=False):
    """Fused recurrent KDA (the wrapper at main 17e24fdd and docs/api.md). q/k [B,T,H,K] (BSND) or [T,H,K]
    (TND) bfloat16, v [.., HV, V] bfloat16, g [.., HV, K] and beta [.., HV] fp32/bf16/fp16; initial_state
    [N, HV, K, V] (``state_v_first=False``) or [N, HV, V, K], fp32/bf16, updated in place with
    ``inplace_final_state``; cu_seqlens a 1-D int32/int64 tensor on q's device (None: one sequence per row),
    every sequence <= 8 tokens; K = 128, V in (128, 256). In-kernel L2 norm, gate (softplus form, or with
    safe_gate lower_bound * sigmoid(...), A_log float32 [HV], dt_bias float32 [HV*K], lower_bound in [-5, 0))
    and beta sigmoid. Returns (out like v, final_state or None)."""
    op = "npu_recurrent_kda"
    _record(op)
    if layout not in ("BSND", "TND"):
        raise RuntimeError(f"{op}: layout must be BSND or TND.")
    if ssm_state_indices is not None or num_accepted_tokens is not None:
        raise RuntimeError(f"{op}: the stand-in implements ssm_state_indices=None, num_accepted_tokens=None only")
    tnd = layout == "TND"
    rank = 3 if tnd else 4
    if any(x.dim() != rank for x in (q, k, v, g)) or beta.dim() != rank - 1:
        raise RuntimeError(f"{op}: layout/rank mismatch.")
    if q.shape != k.shape:
        raise RuntimeError(f"{op}: q and k must have identical shape.")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_dtype(op, name, x, bf16_only=True)
    _check_strict_dtype(op, "g", g, (torch.float16, torch.bfloat16, torch.float32))
    _check_strict_dtype(op, "beta", beta, (torch.float16, torch.bfloat16, torch.float32))
    flat = (lambda x: x) if tnd else (lambda x: x.flatten(0, 1))
    q3, k3, v3, g3, b2 = (flat(x).float() for x in (q, k, v, g, beta))
    T, H, K = q3.shape
    HV, V = v3.shape[1], v3.shape[2]
    if tuple(g3.shape) != (T, HV, K) or tuple(b2.shape) != (T, HV):
        raise RuntimeError(f"{op}: v/g/beta shape mismatch.")
    if HV % H:
        raise RuntimeError(f"{op}: HV must be divisible by H.")
    if (K, V) not in ((128, 128), (128, 256)):
        raise RuntimeError(f"{op}: K/V currently support only K=128,V=128 or K=128,V=256.")
    if cu_seqlens is None:
        cu = list(range(0, T + 1, T if tnd else q.shape[1]))
    else:
        if (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2
                or cu_seqlens.dtype not in (torch.int32, torch.int64)):
            raise RuntimeError(f"{op}: cu_seqlens must be a 1D INT32 or INT64 tensor.")
        if cu_seqlens.device != q.device:
            raise RuntimeError(f"{op}: cu_seqlens must be on the same device as q.")
        cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != T or any(not 0 <= b - a <= MAX_RECURRENT_TOKENS for a, b in zip(cu, cu[1:])):
        raise RuntimeError(f"{op}: cu_seqlens must start at 0, end at {T} and step by 0..{MAX_RECURRENT_TOKENS}, "
                           f"got {cu}")
    N = len(cu) - 1
    tail = (HV, V, K) if state_v_first else (HV, K, V)
    if initial_state is None:
        if inplace_final_state:
            raise RuntimeError(f"{op}: inplace_final_state=True requires initial_state.")
        state = torch.zeros(N, *tail)
    else:
        _check_strict_dtype(op, "initial_state", initial_state, (torch.float32, torch.bfloat16))
        if tuple(initial_state.shape) != (N, *tail):
            raise RuntimeError(f"{op}: initial_state must be {'[N,HV,V,K]' if state_v_first else '[N,HV,K,V]'} "
                               f"= {[N, *tail]}, got {list(initial_state.shape)}.")
        state = initial_state
    if use_gate_in_kernel:
        bound = _kda_lower_bound(op, True, safe_gate, lower_bound, A_log, dt_bias, HV, K)
    elif safe_gate or A_log is not None or dt_bias is not None:
        raise RuntimeError(f"{op}: A_log, dt_bias and safe_gate require use_gate_in_kernel=True.")
    S_all = state.float().transpose(-1, -2) if state_v_first else state.float()      # [N, HV, K, V]
    S_all = S_all.clone()
    group = HV // H
    scale = K ** -0.5 if scale is None else float(scale)
    out = v3.new_zeros(T, HV, V)
    for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        S = S_all[n]
        for t in range(s, e):
            qt, kt = q3[t], k3[t]
            if use_qk_l2norm_in_kernel:
                qt, kt = m.l2norm_with_rstd(qt)[0], m.l2norm_with_rstd(kt)[0]
            qt, kt = qt.repeat_interleave(group, 0) * scale, kt.repeat_interleave(group, 0)   # [HV, K]
            gate = g3[t]
            if use_gate_in_kernel:
                gate = m.kda_gate(gate[:, None, :], A_log, dt_bias, bound)[:, 0]
            bt = m.beta_activation(b2[t], use_beta_sigmoid_in_kernel, allow_neg_eigval)
            S = gate.exp()[:, :, None] * S
            delta = bt[:, None] * (v3[t] - torch.einsum("hkv,hk->hv", S, kt))
            S = S + kt[:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", S, qt)
        S_all[n] = S
    final = S_all.transpose(-1, -2) if state_v_first else S_all
    if inplace_final_state:
        state.copy_(final.to(state.dtype))
    else:
        state = final.to(state.dtype)
    o = out.to(v.dtype)
    return (o if tnd else o.view(v.shape)), (state if output_final_state else None)


# The export table: every entry is exported as ``npu_<op>`` and as ``<op>``. The recurrent kernels are exported by
# every revision sampled; the KDA backward stages only by later ones (``FLA_NPU_STANDIN_KDA_BWD_EXPORTED=1``).
_ASCENDC_OPS = ("npu_chunk_gated_delta_rule_fwd", "npu_chunk_gated_delta_rule_bwd",
                "npu_chunk_gated_delta_rule_fwd_prepare", "npu_chunk_bwd_dv_local", "npu_chunk_kda_fwd_prepare",
                "npu_chunk_fwd_h", "npu_chunk_kda_fwd_finalize", "npu_chunk_gated_delta_rule_bwd_dhu",
                "npu_pre_process_fwd_kernel_merged", "npu_chunk_delta_h_bwd_preprocess", "npu_merge_fwd_bwd_kernel",
                "npu_recurrent_gated_delta_rule", "npu_recurrent_kda", "npu_recompute_w_u_fwd",
                "npu_chunk_local_cumsum", "npu_chunk_bwd_dqkwg", "npu_prepare_wy_repr_bwd_da",
                "npu_prepare_wy_repr_bwd_full")
if _flag("FLA_NPU_STANDIN_KDA_BWD_EXPORTED"):  # later revisions export the KDA backward stages
    _ASCENDC_OPS += ("npu_chunk_kda_bwd_prepare", "npu_chunk_kda_bwd_finalize")
if _flag("FLA_NPU_STANDIN_KDA_FUSED_BWD_EXPORTED"):  # 7a8a59a3 (PR #334), later _stable.py; not main 17e24fdd
    _ASCENDC_OPS += ("npu_chunk_kda_bwd",)
_IMPL = {n: globals()[n] for n in ("chunk_kda_bwd_prepare", "chunk_kda_bwd_finalize", "chunk_kda_bwd")}
for _n in _IMPL:
    del globals()[_n]
# name -> implementation, like fla-npu's ``_aclnn_ctypes.ASCENDC_CTYPES_OPS`` (imported into this module there too)
ASCENDC_CTYPES_OPS = {_name: globals().get(_name[4:]) or _IMPL[_name[4:]] for _name in _ASCENDC_OPS}


def _get_direct_op(name: str):
    return ASCENDC_CTYPES_OPS[name]


def _make_raw_wrapper(name: str):
    """What fla-npu's ``_make_raw_wrapper`` (04097f56, main 17e24fdd) exports: a wrapper carrying
    ``functools.wraps(_get_direct_op)``, so ``inspect.signature`` reports ``(name: str)`` for every operator."""
    @functools.wraps(_get_direct_op)
    def wrapper(*args, **kwargs):
        return _get_direct_op(name)(*args, **kwargs)
    wrapper.__name__ = wrapper.__qualname__ = name
    return wrapper


for _name in _ASCENDC_OPS:
    _export = _make_raw_wrapper(_name) if _flag("FLA_NPU_STANDIN_RAW_WRAPPER") else ASCENDC_CTYPES_OPS[_name]
    globals()[_name] = globals()[_name[4:]] = _export
__all__ = [*_ASCENDC_OPS, *(n[4:] for n in _ASCENDC_OPS)]
