"""Independent fp64 per-token references for the gated delta rule (GDN) and Kimi delta attention (KDA).

Written from the math (DESIGN.md section 3, research/fla_and_cp.md sections 1 and 5), never from the code
under test. Per value head, state ``S`` is ``K x V``; value head ``i`` reads q/k head ``i // (HV // H)``:

- GDN: ``S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``  (g ``[B,T,HV]``)
- KDA: ``S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T``  (g ``[B,T,HV,K]``)
- output ``o_t = scale * S_t^T q_t``.

Everything runs in float64 with one Python step per token (tests only), so autograd through it gives
reference gradients for every input, including the in-kernel gate parameters and the initial state.

``make_problem`` builds well-conditioned random problems for the tests: keys are l2-normalised (in the op
or here) so that ``b ||k||^2 <= 1`` keeps the recurrence stable; ``forget`` picks the decay regime:
"strong" (about -5 per step), "very_strong" (about -16), "weak" (about -0.01), "mixed" (about -0.15).
"""
from __future__ import annotations

import math

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative L2 error ||a - e|| / max(||e||, tiny), computed in float64."""
    a, e = actual.detach().double(), expected.detach().double()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """FLA's l2norm: ``x / sqrt(sum(x^2) + 1e-6)`` over the last dimension (not F.normalize)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """Exact ``log(1 + exp(x))`` (no threshold linearisation)."""
    return torch.logaddexp(x, torch.zeros_like(x))


def gdn_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """``-exp(A_log[h]) * softplus(g + dt_bias[h])`` for g ``[B,T,HV]``."""
    x = g if dt_bias is None else g + dt_bias
    return -torch.exp(A_log) * softplus(x)


def kda_gate(g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
             lower_bound: float | None) -> torch.Tensor:
    """KDA in-kernel gate for g ``[B,T,HV,K]`` (A_log ``[HV]``, dt_bias ``[HV*K]``).

    Without lower_bound: ``-exp(A_log[h]) * softplus(g + dt_bias)``; with it:
    ``lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias))`` (A_log omitted -> factor 1).
    """
    HV, K = g.shape[-2], g.shape[-1]
    x = g if dt_bias is None else g + dt_bias.reshape(HV, K)
    if lower_bound is None:
        return -torch.exp(A_log)[:, None] * softplus(x)
    if A_log is not None:
        x = torch.exp(A_log)[:, None] * x
    return lower_bound * torch.sigmoid(x)


def _recur(kind: str, q, k, v, g, beta, scale: float, state):
    """One sequence, all heads at once. q,k ``[T,HV,K]``, v ``[T,HV,V]``, g ``[T,HV]`` or ``[T,HV,K]``,
    beta ``[T,HV]``, state ``[HV,K,V]``. Returns ``(o [T,HV,V], final_state [HV,K,V])``."""
    outs = []
    for t in range(q.shape[0]):
        decay = torch.exp(g[t])
        if kind == "gdn":
            state = decay[:, None, None] * state
        else:
            state = decay[:, :, None] * state
        kt, vt, bt = k[t], v[t], beta[t]
        pred = torch.einsum("hk,hkv->hv", kt, state)  # k_t^T (decayed) S
        state = state + bt[:, None, None] * kt[:, :, None] * (vt - pred)[:, None, :]
        outs.append(scale * torch.einsum("hk,hkv->hv", q[t], state))
    if outs:
        return torch.stack(outs, 0), state
    return q.new_zeros(0, *state.shape[::2]), state


def recurrent_delta_rule(kind: str, q, k, v, g, beta, scale=None, initial_state=None,
                         output_final_state=True, use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                         use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None,
                         cu_seqlens=None):
    """Reference for ``chunk_gated_delta_rule`` (kind="gdn") / ``chunk_kda`` (kind="kda").

    Inputs are cast to float64 (differentiably, so ``.grad`` lands on the caller's leaves).
    Returns ``(o [B,T,HV,V], final_state [N,HV,K,V])`` in float64; the final state is always returned
    (``output_final_state`` is accepted only so calls can mirror the op's).
    """
    assert kind in ("gdn", "kda")
    f64 = torch.float64
    q, k, v, g, beta = (x.to(f64) for x in (q, k, v, g, beta))
    A_log = None if A_log is None else A_log.to(f64)
    dt_bias = None if dt_bias is None else dt_bias.to(f64)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    group = HV // H
    scale = K ** -0.5 if scale is None else float(scale)

    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q.repeat_interleave(group, dim=2)
    k = k.repeat_interleave(group, dim=2)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta)
    if use_gate_in_kernel:
        g = gdn_gate(g, A_log, dt_bias) if kind == "gdn" else kda_gate(g, A_log, dt_bias, lower_bound)

    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        bounds = [int(x) for x in cu_seqlens]
        spans = [(0, s, e) for s, e in zip(bounds[:-1], bounds[1:])]

    outs, finals = [], []
    for n, (b, s, e) in enumerate(spans):
        if initial_state is None:
            state = q.new_zeros(HV, K, V)
        else:
            state = initial_state[n].to(f64)
        o, state = _recur(kind, q[b, s:e], k[b, s:e], v[b, s:e], g[b, s:e], beta[b, s:e], scale, state)
        outs.append(o)
        finals.append(state)
    if cu_seqlens is None:
        o = torch.stack(outs, 0)
    else:
        o = torch.cat(outs, 0)[None]
    return o, torch.stack(finals, 0)


def recurrent_gated_delta_rule(q, k, v, g, beta, **kw):
    """GDN reference; keywords as :func:`recurrent_delta_rule`."""
    return recurrent_delta_rule("gdn", q, k, v, g, beta, **kw)


def recurrent_kda(q, k, v, g, beta, **kw):
    """KDA reference; keywords as :func:`recurrent_delta_rule`."""
    return recurrent_delta_rule("kda", q, k, v, g, beta, **kw)


def transition_product(kind: str, k, g, beta, **kw):
    """Reference segment transition ``M = A_T ... A_1`` per sequence, ``[N,HV,K,K]`` fp64.

    Runs the recurrence with zero values and initial state ``I`` (state columns evolve independently, so
    the end state is ``M``). ``kw``: use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, use_gate_in_kernel,
    A_log, dt_bias, lower_bound, cu_seqlens.
    """
    B, T, H, K = k.shape
    HV = beta.shape[2]
    cu = kw.get("cu_seqlens")
    N = B if cu is None else len(cu) - 1
    eye = torch.eye(K, dtype=torch.float64).expand(N, HV, K, K).clone()
    zeros_v = torch.zeros(B, T, HV, K, dtype=torch.float64)
    _, M = recurrent_delta_rule(kind, k.detach(), k, zeros_v, g, beta, initial_state=eye, **kw)
    return M


# ---- problem builders shared by the delta-rule tests ----
def make_problem(kind, *, B=1, T=16, H=1, HV=1, K=8, V=8, cu_seqlens=None, forget="mixed",
                 initial_state=False, l2norm_in_kernel=False, beta_sigmoid=False, gate_in_kernel=False,
                 dt_bias=True, A_log=True, lower_bound=None, scale=None, dtype=torch.float32, seed=0):
    """Return ``(tensors, flags)``: tensors is a dict of leaf inputs (q, k, v, g, beta and optionally
    initial_state, A_log, dt_bias) in ``dtype`` (states fp32); flags are the op keywords besides them."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, dtype=torch.float64)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    gshape = (B, T, HV) if kind == "gdn" else (B, T, HV, K)
    q = randn(B, T, H, K)
    k = randn(B, T, H, K)
    if not l2norm_in_kernel:
        k = l2norm(k)
    v = randn(B, T, HV, V)
    beta = randn(B, T, HV) if beta_sigmoid else 0.05 + 0.9 * rand(B, T, HV)
    t = {}
    if gate_in_kernel:
        g = randn(*gshape)
        strong = forget in ("strong", "very_strong")
        if A_log:
            # strong: exp(A_log) ~ 3.5 times softplus(g + ~1) ~ 1.4 gives g about -5 per step;
            # weak: 0.08 times softplus(g - 2) ~ 0.15 gives about -0.01; otherwise about -0.15
            base, spread = {"strong": (math.log(3.5), 0.2), "very_strong": (math.log(12.0), 0.2),
                            "weak": (math.log(0.08), 0.2)}.get(forget, (0.0, 0.5))
            t["A_log"] = base + spread * randn(HV) if lower_bound is None else 0.5 * randn(HV)
        if dt_bias:
            t["dt_bias"] = (1.0 if strong else -2.0) + 0.5 * randn(HV if kind == "gdn" else HV * K)
    elif forget == "strong":
        g = -(5.0 + 0.5 * rand(*gshape))
    elif forget == "very_strong":
        g = -(15.0 + 2.0 * rand(*gshape))
    elif forget == "weak":
        g = -0.01 * (0.5 + rand(*gshape))
    else:
        g = torch.nn.functional.logsigmoid(2.0 + randn(*gshape))
    t.update(q=q, k=k, v=v, g=g, beta=beta)
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    if initial_state:
        t["initial_state"] = randn(N, HV, K, V)
    tensors = {}
    for name, x in t.items():
        target = torch.float32 if name in ("initial_state", "A_log", "dt_bias") else dtype
        tensors[name] = x.to(target).requires_grad_()
    flags = dict(scale=scale, use_qk_l2norm_in_kernel=l2norm_in_kernel,
                 use_beta_sigmoid_in_kernel=beta_sigmoid, use_gate_in_kernel=gate_in_kernel)
    if kind == "kda":
        flags["lower_bound"] = lower_bound
    if cu_seqlens is not None:
        flags["cu_seqlens"] = torch.tensor(cu_seqlens, dtype=torch.int64)
    return tensors, flags


def as_f64_leaves(tensors):
    """Independent float64 leaf copies (for the reference's autograd)."""
    return {n: x.detach().double().requires_grad_() for n, x in tensors.items()}
