"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) as a megatron-core ``self_attention`` submodule.

Math (per value head, as ``Qwen3NextGatedDeltaNet`` in transformers and megatron-core's GatedDeltaNet)::

    q, k, v = SiLU(causal_conv1d(in_proj(x)[q, k, v]))           short conv over the q/k/v channels
    beta    = sigmoid(in_proj(x)[beta])   (2 sigmoid(...) with allow_neg_eigval: OLMo-Hybrid)
    g       = -exp(A_log) * softplus(in_proj(x)[alpha] + dt_bias)
    S_t     = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,  o_t = S_t^T q_t / sqrt(K)
              (q, k l2-normalized; value head i reads query/key head i // (HV/H))
    y       = out_proj(rmsnorm(o) * out_norm.weight * SiLU(in_proj(x)[z]))

Parameters (global shapes; TP slices heads): ``in_proj.weight [2*H*K + 2*HV*V + 2*HV, h]`` with logical parts
query, key, value, z, beta, alpha; ``conv1d.weight [2*H*K + HV*V, 1, W]`` (parts query, key, value);
``A_log [HV]``; ``dt_bias [HV]``; ``out_norm.weight [V]``; ``out_proj.weight [h, HV*V]``.
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from torch import nn

from layers.mixers.delta.mixer import DeltaMixer
from layers.mixers.delta.options import COMMON_OPTIONS, GDN_DEFAULTS, GDN_ROWS, options_of
from layers.mixers.delta.params import ParamLayout, Part, constant_init, log_uniform_init


class GatedDeltaNet(DeltaMixer):
    """GDN mixer: ``GatedDeltaNet(config, submodules, layer_number=None, pg_collection=None, ...)``.

    Options (``ModuleSpec.params`` or config attributes, see ``layers.mixers.delta.options.COMMON_OPTIONS``):
    heads and head dims (megatron-core 0.16's ``linear_*`` config fields), ``conv_kernel_dim``, ``backend``
    (``eager | triton | ascendc``), ``cp_method``, ``cp_layout``, ``cp_group_size``, ``cp_ulysses_degree``,
    ``init_seed``, ``allow_neg_eigval`` (beta = 2 sigmoid(b), config ``gdn_allow_neg_eigval``).
    """

    kind = "gdn"
    gate_activation = "silu"
    OPTIONS = {**COMMON_OPTIONS, **options_of(GDN_ROWS, GDN_DEFAULTS)}

    @property
    def beta_sigmoid_in_kernel(self) -> bool:
        """With ``allow_neg_eigval`` :meth:`gates` returns beta activated (2 sigmoid(b)): every backend's op and CP
        engine takes beta as given, so the option is a change before the op, not a kernel of its own."""
        return not self.allow_neg_eigval

    def _in_proj_parts(self):
        return [("query", self.key_dim), ("key", self.key_dim), ("value", self.value_dim),
                ("z", self.value_dim), ("beta", self.num_value_heads), ("alpha", self.num_value_heads)]

    def _build_extra(self, submodules, device, dtype):
        self.allow_neg_eigval = self.options["allow_neg_eigval"]
        if not isinstance(self.allow_neg_eigval, bool):
            raise TypeError(f"{type(self).__name__}: allow_neg_eigval must be a bool, got {self.allow_neg_eigval!r}")
        hv = self.value_heads_local
        self.A_log = nn.Parameter(torch.empty(hv, device=device, dtype=dtype))
        self.dt_bias = nn.Parameter(torch.empty(hv, device=device, dtype=dtype))
        for p in (self.A_log, self.dt_bias):
            set_tensor_model_parallel_attributes(p, True, 0, 1)

    def _extra_layouts(self):
        HV = self.num_value_heads
        return [ParamLayout("A_log", 0, (Part(None, (HV,), log_uniform_init(*self.A_init_range)),)),
                ParamLayout("dt_bias", 0, (Part(None, (HV,), constant_init(1.0)),))]

    def gates(self, parts, hidden_states):
        batch, seq = parts["z"].shape[:2]
        z = parts["z"].reshape(batch, seq, self.value_heads_local, self.value_head_dim)
        beta = parts["beta"].contiguous()
        if self.allow_neg_eigval:   # FLA's GatedDeltaNet: sigmoid(b) * 2, in the activations' dtype
            beta = beta.sigmoid() * 2.0
        return (parts["alpha"].contiguous(), beta, z,
                dict(A_log=self.A_log, dt_bias=self.dt_bias))
