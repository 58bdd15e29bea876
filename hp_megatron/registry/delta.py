"""The ``self_attention`` spec of the GDN/KDA mixers (``layers.mixers.delta``), shared by their registrations."""
from __future__ import annotations

from hp_megatron.registry.entries import resolve
from hp_megatron.registry.support import MixerSupport
from layers.base.choices import BACKENDS, CP_METHOD_CHOICES

# GDN / KDA (layers.mixers.delta): every CP method of --hp-cp-method (layers/cp), packed documents (cu_seqlens into
# the chunked kernels and the short convolution), a recurrent decode step with the conv and state caches
# (layers/mixers/delta/decode.py), every kernel backend; no MTP (their spec has no attention mask type)
DELTA_SUPPORT = MixerSupport(cp_methods=CP_METHOD_CHOICES, thd=True, decode=True, mtp=False, backends=BACKENDS)


def delta_mixer_spec(module: str, provider, cp_layout):
    """``ModuleSpec`` of the delta-rule mixer class ``module`` (``"package.module:Class"``) with the provider's
    linears, gated norm and kernel backend; ``cp_layout`` written into its params unless None."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from layers.mixers.delta.mixer import DeltaMixerSubmodules

    params = {"backend": provider.mixer_backend}
    if cp_layout is not None:
        params["cp_layout"] = cp_layout
    return ModuleSpec(
        module=resolve(module),
        params=params,
        submodules=DeltaMixerSubmodules(
            in_proj=provider.column_parallel_linear(),
            out_norm=provider.gated_norm(),
            out_proj=provider.row_parallel_linear(),
        ),
    )
