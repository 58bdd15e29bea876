"""Weights of a running model in its Hugging Face checkpoint's names and layouts, for rollout engines: the
architecture of config.json's ``model_type`` (``ARCHITECTURES``), with the multi-token-prediction layers the model
is built with, handed to ``hp_megatron.convert.export``."""
from __future__ import annotations

from hp_megatron.convert.export import HFWeightExporter
from hp_megatron.convert.safetensors_io import load_hf_config
from hp_megatron.models.architectures import architecture_of


def _mtp_depth(model) -> int:
    """The multi-token-prediction depth ``model`` (a ``GPTModel``, or a DDP / Float16Module wrapper) is built with:
    its config's ``mtp_num_layers`` (None: 0)."""
    return getattr(model.config, "mtp_num_layers", None) or 0


def _model_class(model) -> str:
    """``hybrid`` for a megatron-core ``HybridModel`` (or a wrapper of one: ``.module`` chains), else ``gpt``."""
    while hasattr(model, "module"):
        model = model.module
    try:
        from megatron.core.models.hybrid.hybrid_model import HybridModel
    except ImportError:  # megatron-core before 0.19
        return "gpt"
    return "hybrid" if isinstance(model, HybridModel) else "gpt"


def hf_weight_exporter(model, hf_config, *, mtp_num_layers: int | None = None, **kwargs) -> HFWeightExporter:
    """:class:`~hp_megatron.convert.export.HFWeightExporter` of ``model`` built from ``hf_config`` (a dict, a
    config.json or an HF directory) by the listed architecture of its ``model_type`` (``GPTModel`` or ``HybridModel``:
    the rules in that class's numbering), with the model's MTP layers
    (its config's ``mtp_num_layers``; ``mtp_num_layers``, when given, must equal it: ValueError otherwise).
    ``kwargs``: ``metadata``, ``group``. Collective."""
    hf = load_hf_config(hf_config)
    depth = _mtp_depth(model)
    if mtp_num_layers is not None and mtp_num_layers != depth:
        raise ValueError(f"export: mtp_num_layers={mtp_num_layers!r}, but the model is built with "
                         f"mtp_num_layers={depth}")
    architecture = architecture_of(hf).with_mtp(depth).for_model_class(_model_class(model))
    return HFWeightExporter(model, architecture, hf, **kwargs)


def export_hf_weights(model, hf_config, *, dst: int | None = 0, **kwargs):
    """``(hf_name, tensor)`` for every tensor of the HF checkpoint of ``model``, its MTP layers included (see
    :func:`hf_weight_exporter`; ``dst``: the rank that receives them, None: every rank). Every rank iterates it to
    the end."""
    return hf_weight_exporter(model, hf_config, **kwargs)(dst)
