"""CPU stand-ins for the Transformer Engine modules of megatron-core's own GatedDeltaNet specs (tests only).

megatron-core builds its GDN layers only from Transformer Engine specs (``hybrid_stack_spec``; the GPTModel path
``get_transformer_layer_with_experimental_attention_variant_spec``), and TE needs CUDA. The stand-ins have TE's
parameter and checkpoint names and TE's math, on megatron-core's local modules:

* :class:`LayerNormColumnParallelLinear` for ``TELayerNormColumnParallelLinear``: an RMSNorm fused in front of a
  column-parallel linear, its weight ``layer_norm_weight`` (zero-centred with ``config.layernorm_zero_centered_gamma``)
  saved replicated next to the TP-sharded ``weight``, as TE's wrapper saves it;
* ``TENorm`` -> ``layers.shared.norm.RMSNorm`` (same weight name and zero-centring); ``TEColumnParallelLinear`` /
  ``TERowParallelLinear`` -> megatron's ``ColumnParallelLinear`` / ``RowParallelLinear``; ``TEDotProductAttention``
  -> megatron's ``DotProductAttention``.

:class:`StandInTEProvider` is a ``BackendSpecProvider`` answering as megatron's ``TESpecProvider`` does (fused
norms), :func:`substitute` swaps the TE classes of a ready spec tree (``hybrid_stack_spec``), and
:func:`hybrid_final_norm` patches the one TE class ``HybridStack`` builds without a spec (its final norm).
"""
from __future__ import annotations

import contextlib
import dataclasses
from functools import partial

import torch
from megatron.core.models.backends import BackendSpecProvider
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from layers.shared.norm import RMSNorm


class LayerNormColumnParallelLinear(ColumnParallelLinear):
    """``TELayerNormColumnParallelLinear`` on CPU: ``linear(rmsnorm(x) * layer_norm_weight)``."""

    def __init__(self, input_size, output_size, *, config, name=None, **kwargs):
        if config.normalization != "RMSNorm":
            raise ValueError(f"the stand-in fuses an RMSNorm; config.normalization={config.normalization!r}")
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.zero_centered = bool(config.layernorm_zero_centered_gamma)
        init = torch.zeros if self.zero_centered else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(init(input_size, dtype=config.params_dtype))
        self.eps = config.layernorm_epsilon
        self.layer_norm_weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x, *args, **kwargs):
        weight = self.layer_norm_weight + 1 if self.zero_centered else self.layer_norm_weight
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return super().forward((normed * weight.float()).to(x.dtype), *args, **kwargs)


class StandInTEProvider(BackendSpecProvider):
    """megatron's ``TESpecProvider`` answers (fused input norms) with the stand-ins."""

    def column_parallel_linear(self):
        return ColumnParallelLinear

    def row_parallel_linear(self):
        return RowParallelLinear

    def fuse_layernorm_and_linear(self):
        return True

    def column_parallel_layer_norm_linear(self):
        return LayerNormColumnParallelLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False):
        return RMSNorm

    def core_attention(self):
        return DotProductAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm, *args):
        from megatron.core.transformer.moe.experts import SequentialMLP

        return partial(SequentialMLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                               linear_fc2=RowParallelLinear))

    def activation_func(self):
        return None


def te_classes() -> dict:
    """megatron-core's TE names (placeholders without TE) -> their stand-ins."""
    import megatron.core.extensions.transformer_engine as te

    return {te.TELayerNormColumnParallelLinear: LayerNormColumnParallelLinear, te.TENorm: RMSNorm,
            te.TEColumnParallelLinear: ColumnParallelLinear, te.TERowParallelLinear: RowParallelLinear,
            te.TEDotProductAttention: DotProductAttention}


def substitute(spec, table=None):
    """A copy of the spec tree ``spec`` with every class of ``table`` (default :func:`te_classes`) replaced."""
    table = te_classes() if table is None else table

    def swap(value):
        if isinstance(value, ModuleSpec):
            return dataclasses.replace(value, module=swap(value.module), submodules=swap(value.submodules))
        if isinstance(value, partial):
            return partial(swap(value.func), *map(swap, value.args), **{k: swap(v) for k, v in value.keywords.items()})
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.replace(value, **{f.name: swap(getattr(value, f.name))
                                                 for f in dataclasses.fields(value) if f.init})
        try:
            return table.get(value, value)
        except TypeError:   # unhashable
            return value

    return swap(spec)


@contextlib.contextmanager
def hybrid_final_norm():
    """``HybridStack`` builds its final norm as ``TENorm(...)`` directly: the stand-in norm meanwhile."""
    import megatron.core.models.hybrid.hybrid_block as block

    original = block.TENorm
    block.TENorm = RMSNorm
    try:
        yield
    finally:
        block.TENorm = original
