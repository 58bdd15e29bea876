"""Backend spec providers in the shape of megatron-core's ``BackendSpecProvider``.

A provider answers "which class builds this submodule": column/row-parallel linears, norms, the core
attention of standard attention layers, plus ``mixer_backend`` — the kernel backend name our GDN/KDA
mixers dispatch to (``layers.ops``) — and ``attention_backend`` for softmax attention.

=================  ==================================  ==========  =================
provider           linears                             mixers      softmax attention
=================  ==================================  ==========  =================
EagerSpecProvider  megatron-core Column/RowParallel    eager       eager (torch SDPA)
TritonSpecProvider same, or TE linears (linear="te")   triton      eager (torch SDPA)
AscendCSpecProvider megatron-core Column/RowParallel   ascendc     npu (fused attention)
=================  ==================================  ==========  =================

Norms are ``layers.shared.norm.RMSNorm`` everywhere (megatron's ``WrappedTorchNorm`` refuses sequence
parallelism). Nothing falls back silently: asking for TE linears without Transformer Engine raises.
"""
from __future__ import annotations

from typing import Optional

from megatron.core.models.backends import BackendSpecProvider
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules

from layers.mixers.attention.context_parallel import ContextParallelDotProductAttention
from layers.base.choices import BACKENDS
from layers.base.megatron_compat import experts_builder

LINEAR_IMPLS = ("local", "te")


def _te_linears():
    try:
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear
        import transformer_engine  # noqa: F401
    except ImportError as err:
        raise RuntimeError("Transformer Engine linears were requested (linear='te') but the package "
                           "'transformer_engine' is not installed (pip install transformer_engine[pytorch])"
                           ) from err
    return TEColumnParallelLinear, TERowParallelLinear


class _HPSpecProvider(BackendSpecProvider):
    """Shared implementation; subclasses set ``mixer_backend`` and ``attention_backend``."""

    mixer_backend = "eager"
    attention_backend = "eager"

    def __init__(self, linear: str = "local"):
        if linear not in LINEAR_IMPLS:
            raise ValueError(f"linear must be one of {LINEAR_IMPLS}, got {linear!r}")
        self.linear_impl = linear
        self._linears = _te_linears() if linear == "te" else (ColumnParallelLinear, RowParallelLinear)

    def __repr__(self):
        return f"{type(self).__name__}(linear={self.linear_impl!r})"

    # --- megatron-core BackendSpecProvider protocol ---
    def column_parallel_linear(self) -> type:
        return self._linears[0]

    def row_parallel_linear(self) -> type:
        return self._linears[1]

    def fuse_layernorm_and_linear(self) -> bool:
        return False

    def column_parallel_layer_norm_linear(self) -> Optional[type]:
        return None

    def layer_norm(self, rms_norm: bool = True, for_qk: bool = False) -> type:
        if not rms_norm:
            raise ValueError("hp_megatron specs use RMSNorm; rms_norm=False (LayerNorm) is not provided")
        from layers.shared.norm import RMSNorm

        return RMSNorm

    def core_attention(self) -> type:
        """Core attention of standard attention layers (megatron ``SelfAttention``'s interface)."""
        return ContextParallelDotProductAttention

    def latent_core_attention(self) -> type:
        """Core attention of ``layers.MultiLatentAttention`` (unequal q/k and v head dims)."""
        from layers.mixers.attention import CoreAttention, NPUCoreAttention

        return NPUCoreAttention if self.attention_backend == "npu" else CoreAttention

    def gated_norm(self) -> type:
        """Output norm of the GDN/KDA mixers (RMSNorm times the activated gate)."""
        from layers.shared.norm import GatedRMSNorm

        return GatedRMSNorm

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, *legacy_grouped_gemm):
        """``SequentialMLP`` experts with this provider's linears (megatron-core 0.16 passes a second flag,
        ``moe_use_legacy_grouped_gemm``, which changes nothing here)."""
        from megatron.core.transformer.moe.experts import SequentialMLP

        if moe_use_grouped_gemm:
            raise ValueError("grouped-GEMM experts need Transformer Engine specs; use moe_use_grouped_gemm=False")
        return experts_builder(SequentialMLP, MLPSubmodules(linear_fc1=self.column_parallel_linear(),
                                                            linear_fc2=self.row_parallel_linear(),
                                                            activation_func=self.activation_func()))

    def activation_func(self) -> type:
        return None


class EagerSpecProvider(_HPSpecProvider):
    """Pure PyTorch everywhere: the reference backend, runs on CPU, GPU and NPU."""

    mixer_backend = "eager"
    attention_backend = "eager"


class TritonSpecProvider(_HPSpecProvider):
    """flash-linear-attention Triton kernels for the mixers (NVIDIA GPU); TE linears with ``linear="te"``."""

    mixer_backend = "triton"
    attention_backend = "eager"


class AscendCSpecProvider(_HPSpecProvider):
    """fla-npu Ascend C kernels for the mixers and ``torch_npu`` fused attention (Ascend NPU)."""

    mixer_backend = "ascendc"
    attention_backend = "npu"


_PROVIDERS = {"eager": EagerSpecProvider, "triton": TritonSpecProvider, "ascendc": AscendCSpecProvider}


def get_spec_provider(backend="eager", linear: Optional[str] = None):
    """A provider instance from a backend name (``eager | triton | ascendc``) with ``linear`` linears (``local`` or
    ``te``; None: ``local``), or a provider, returned as is: a ``linear`` other than the provider's own is refused
    (ValueError naming both; a provider's linears are fixed when it is made)."""
    if isinstance(backend, _HPSpecProvider):
        if linear is not None and linear != backend.linear_impl:
            raise ValueError(f"linear={linear!r} conflicts with the spec provider {backend!r}; make the provider with "
                             f"{type(backend).__name__}(linear={linear!r}) or pass the backend's name")
        return backend
    if backend not in _PROVIDERS:
        raise ValueError(f"backend must be one of {BACKENDS} or a spec provider, got {backend!r}")
    return _PROVIDERS[backend](linear="local" if linear is None else linear)
