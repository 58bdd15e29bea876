"""Weights of a running model in its Hugging Face checkpoint's names and layouts, for rollout engines: the
architecture of config.json's ``model_type`` (``ARCHITECTURES``) handed to ``hp_megatron.convert.export``."""
from __future__ import annotations

from hp_megatron.convert.export import HFWeightExporter
from hp_megatron.convert.safetensors_io import load_hf_config
from hp_megatron.models.architectures import architecture_of


def hf_weight_exporter(model, hf_config, **kwargs) -> HFWeightExporter:
    """:class:`~hp_megatron.convert.export.HFWeightExporter` of ``model`` built from ``hf_config`` (a dict, a
    config.json or an HF directory) by the listed architecture of its ``model_type``; ``kwargs``: ``metadata``,
    ``group``. Collective."""
    hf = load_hf_config(hf_config)
    return HFWeightExporter(model, architecture_of(hf), hf, **kwargs)


def export_hf_weights(model, hf_config, *, dst: int | None = 0, **kwargs):
    """``(hf_name, tensor)`` for every tensor of the HF checkpoint of ``model`` (see :func:`hf_weight_exporter`;
    ``dst``: the rank that receives them, None: every rank). Every rank iterates it to the end."""
    return hf_weight_exporter(model, hf_config, **kwargs)(dst)
