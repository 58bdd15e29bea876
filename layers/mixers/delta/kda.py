"""Kimi Delta Attention (Kimi Linear) as a megatron-core ``self_attention`` submodule.

Math (as ``KimiLinearDeltaAttention`` in transformers and FLA's ``KimiDeltaAttention``)::

    q, k, v = SiLU(causal_conv1d(in_proj(x)[q, k, v]));  beta = sigmoid(in_proj(x)[beta])
    f       = forget_gate_up_proj(gate_down_proj(x)[forget])                    low-rank, [HV, K] per token
    g       = -exp(A_log)[h] * softplus(f + dt_bias)     (or lower_bound * sigmoid(exp(A_log) (f + dt_bias)))
    S_t     = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,  o_t = S_t^T q_t / sqrt(K)
    y       = out_proj(rmsnorm(o) * out_norm.weight * sigmoid(output_gate_up_proj(gate_down_proj(x)[output])))

With ``full_rank_gates`` (Ling 3.0) the forget and output gates are parts of in_proj instead:
``f = in_proj(x)[forget]`` ``[HV*K]``, ``sigmoid(in_proj(x)[output])`` ``[HV*V]``: one GEMM (and, under sequence
parallelism, one all-gather) with q, k, v, beta, and no gate_down_proj / up-projections.

Parameters (global shapes, r = gate_low_rank_dim, default V): ``in_proj.weight [2*H*K + HV*V + HV, h]``
(parts query, key, value, beta; + forget ``[HV*K]``, output ``[HV*V]`` with ``full_rank_gates``);
``conv1d.weight [2*H*K + HV*V, 1, W]``; ``gate_down_proj.weight [2r, h]``
(parts forget, output; replicated over TP); ``forget_gate_up_proj.weight [HV*K, r]``;
``output_gate_up_proj.weight [HV*V, r]`` (+ ``bias`` with ``output_gate_bias``); ``A_log [HV]``;
``dt_bias [HV*K]``; ``out_norm.weight [V]``; ``out_proj.weight [h, HV*V]``.
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.spec_utils import build_module
from torch import nn

from layers.mixers.delta.mixer import DeltaMixer
from layers.mixers.delta.options import COMMON_OPTIONS, KDA_DEFAULTS, KDA_ROWS, options_of, positive_int
from layers.mixers.delta.params import (ParamLayout, Part, ReplicatedLinear, constant_init, inverse_softplus_dt_init,
                                        log_uniform_init, megatron_init, skip_init)

KDA_OPTIONS = {**COMMON_OPTIONS, **options_of(KDA_ROWS, KDA_DEFAULTS)}


class KimiDeltaAttention(DeltaMixer):
    """KDA mixer: ``KimiDeltaAttention(config, submodules, layer_number=None, pg_collection=None, ...)``.

    Options: those of :class:`layers.GatedDeltaNet` plus ``gate_low_rank_dim``, ``lower_bound`` (negative;
    switches the gate to ``lower_bound * sigmoid(...)``), ``safe_gate`` (needs lower_bound in [-5, 0)),
    ``output_gate_bias`` and ``full_rank_gates``; config attributes ``kda_*`` of the same names.
    """

    kind = "kda"
    gate_activation = "sigmoid"
    OPTIONS = KDA_OPTIONS

    def _in_proj_parts(self):
        parts = [("query", self.key_dim), ("key", self.key_dim), ("value", self.value_dim),
                 ("beta", self.num_value_heads)]
        if self.options["full_rank_gates"]:
            parts += [("forget", self.num_value_heads * self.key_head_dim), ("output", self.value_dim)]
        return parts

    def _build_extra(self, submodules, device, dtype):
        name, opts = type(self).__name__, self.options
        self.full_rank_gates = opts["full_rank_gates"]
        if not isinstance(self.full_rank_gates, bool):
            raise TypeError(f"{name}: full_rank_gates must be a bool, got {self.full_rank_gates!r}")
        if self.full_rank_gates and (opts["gate_low_rank_dim"] is not None or opts["output_gate_bias"]):
            raise ValueError(f"{name}: full_rank_gates=True has no low-rank gate projections: gate_low_rank_dim must "
                             f"be None and output_gate_bias False, got {opts['gate_low_rank_dim']!r}, "
                             f"{opts['output_gate_bias']!r}")
        self.gate_low_rank_dim = positive_int(name, "gate_low_rank_dim",
                                               opts["gate_low_rank_dim"] or self.value_head_dim)
        self.lower_bound = opts["lower_bound"]
        self.safe_gate = bool(opts["safe_gate"])
        self.output_gate_bias = bool(opts["output_gate_bias"])
        lb = self.lower_bound
        if lb is not None and (isinstance(lb, bool) or not isinstance(lb, (int, float)) or lb >= 0):
            raise ValueError(f"{name}: lower_bound must be a negative number or None, got {lb!r}")
        if self.safe_gate and (lb is None or not -5 <= lb < 0):
            raise ValueError(f"{name}: safe_gate=True requires lower_bound in [-5, 0), got {lb!r}")
        if not self.full_rank_gates:
            r = self.gate_low_rank_dim
            self.gate_down_proj = ReplicatedLinear(self.hidden_size, 2 * r, self.config, device, dtype)
            up = submodules.in_proj   # the gate up-projections are column parallel, as in_proj
            common = dict(config=self.config, init_method=skip_init, gather_output=False, skip_bias_add=False,
                          is_expert=False, tp_comm_buffer_name=None, tp_group=self.tp_group)
            self.forget_gate_up_proj = build_module(up, r, self.num_value_heads * self.key_head_dim, bias=False,
                                                    **common)
            self.output_gate_up_proj = build_module(up, r, self.value_dim, bias=self.output_gate_bias, **common)
        hv = self.value_heads_local
        self.A_log = nn.Parameter(torch.empty(hv, device=device, dtype=dtype))
        self.dt_bias = nn.Parameter(torch.empty(hv * self.key_head_dim, device=device, dtype=dtype))
        for p in (self.A_log, self.dt_bias):
            set_tensor_model_parallel_attributes(p, True, 0, 1)

    def _extra_layouts(self):
        HV, K, V, r, h = self.num_value_heads, self.key_head_dim, self.value_head_dim, self.gate_low_rank_dim, \
            self.hidden_size
        init = megatron_init(self.config.init_method)
        a_init = constant_init(0.0) if self.safe_gate else log_uniform_init(*self.A_init_range)
        layouts = [] if self.full_rank_gates else [
            ParamLayout("gate_down_proj.weight", None, (Part("forget", (r, h), init), Part("output", (r, h), init))),
            ParamLayout("forget_gate_up_proj.weight", 0, (Part(None, (HV * K, r), init),)),
            ParamLayout("output_gate_up_proj.weight", 0, (Part(None, (HV * V, r), init),)),
        ]
        layouts += [ParamLayout("A_log", 0, (Part(None, (HV,), a_init),)),
                    ParamLayout("dt_bias", 0, (Part(None, (HV * K,), inverse_softplus_dt_init()),))]
        if self.output_gate_bias:
            layouts.append(ParamLayout("output_gate_up_proj.bias", 0, (Part(None, (HV * V,), constant_init(0.0)),)))
        return layouts

    def gates(self, parts, hidden_states):
        batch, seq = parts["beta"].shape[:2]
        if self.full_rank_gates:   # in_proj's own parts, [b, s, HV_local * K] and [b, s, HV_local * V]
            forget, gate = parts["forget"], parts["output"]
        else:
            forget_low, output_low = self.gate_down_proj(hidden_states).chunk(2, dim=-1)  # [s(/tp), b, r] each
            forget, _ = self.forget_gate_up_proj(forget_low.contiguous())  # [s, b, HV_local * K]
            gate, _ = self.output_gate_up_proj(output_low.contiguous())  # [s, b, HV_local * V]
            forget, gate = forget.transpose(0, 1), gate.transpose(0, 1)
        forget = forget.reshape(batch, seq, self.value_heads_local, self.key_head_dim)
        gate = gate.reshape(batch, seq, self.value_heads_local, self.value_head_dim)
        return (forget, parts["beta"].contiguous(), gate,
                dict(A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=self.lower_bound, safe_gate=self.safe_gate))
