"""The one builder of a hybrid megatron-core ``GPTModel``: the example's model, the Megatron-LM launcher's and a
preset's (``hp_megatron.models.preset_gpt_model``) all come from :func:`hybrid_gpt_model`.

Given a layer spec, megatron-core's ``TransformerBlock`` repeats it and takes the block's final norm from its
module-level ``LayerNormImpl`` (Transformer Engine's, Apex's, or ``WrappedTorchNorm``, which refuses sequence
parallelism). The builder passes a block spec instead: the layer spec once per layer of this pipeline stage and
``layers.shared.norm.RMSNorm`` as the final norm, the norm every layer of the hybrid specs uses (zero-centred when
``config.layernorm_zero_centered_gamma``), so nothing of megatron-core is patched and the final norm is the same
on every install.

With ``config.mtp_num_layers`` (``--mtp-num-layers``) the model gets the multi-token-prediction block of
``hp_megatron.specs.get_mtp_block_spec`` (on the last pipeline stage) and is ``hp_megatron.decoder.mtp.MTPGPTModel``,
whose MTP token shift and loss work under any CP layout and with packed documents.
"""
from __future__ import annotations


def hybrid_block_spec(layer_spec, config, vp_stage=None):
    """``TransformerBlockSubmodules``: ``layer_spec`` (a layer ``ModuleSpec``, e.g. ``get_hybrid_layer_spec``'s)
    for each layer this pipeline stage (and virtual stage ``vp_stage``) builds, ``RMSNorm`` as the final norm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from layers.shared.norm import RMSNorm

    return TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config, vp_stage),
                                      layer_norm=RMSNorm)


def hybrid_gpt_model(config, layer_spec, *, vocab_size: int, max_sequence_length: int, pre_process: bool = True,
                     post_process: bool = True, vp_stage=None, backend="eager", **gpt_kwargs):
    """megatron-core ``GPTModel`` of this pipeline stage over :func:`hybrid_block_spec`; ``gpt_kwargs`` are
    ``GPTModel``'s other keywords (``position_embedding_type``, ``rotary_base``, tied embeddings...). With
    ``config.mtp_num_layers`` it is a ``MTPGPTModel`` with the MTP block of ``layer_spec``'s MTP kind;
    ``backend`` (the layer spec's backend name or spec provider) builds the MTP layers' norms and projection, whose
    linears are the layer spec's (``get_hybrid_layer_spec(..., linear=)``, ``--hp-linear``)."""
    from megatron.core.models.gpt import GPTModel

    from hp_megatron.gpt.mtp_model import MTPGPTModel
    from hp_megatron.specs.mtp_specs import get_mtp_block_spec

    mtp_block_spec = get_mtp_block_spec(config, layer_spec, backend, vp_stage=vp_stage)
    cls = MTPGPTModel if getattr(config, "mtp_num_layers", None) else GPTModel
    return cls(config=config, transformer_layer_spec=hybrid_block_spec(layer_spec, config, vp_stage),
               vocab_size=vocab_size, max_sequence_length=max_sequence_length, pre_process=pre_process,
               post_process=post_process, vp_stage=vp_stage, mtp_block_spec=mtp_block_spec, **gpt_kwargs)
