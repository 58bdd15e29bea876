"""Megatron-LM 0.19's model config of ``--spec hp_megatron.specs NAME`` for ``pretrain_gpt.py`` (imported by
``pretrain_gpt_hp.py`` on 0.19 only: ``megatron.training.models`` is 0.19's).

Megatron-LM 0.19 builds the model from a ``ModelConfig`` whose ``builder`` names a ``ModelBuilder`` class.
:class:`HybridGPTModelConfig` is ``GPTModelConfig`` (the same fields, from ``gpt_config_from_args``) whose builder
is :class:`HybridGPTModelBuilder`: ``GPTModelBuilder`` whose ``build_model`` passes the same ``GPTModel`` keywords
to ``hp_megatron.model_builders.hybrid_gpt_model``, as the launcher's ``gpt_builder`` does on 0.16 (the
block-final norm is our RMSNorm; with ``--mtp-num-layers`` the MTP block of the spec's MTP kind). Everything else
of the builder (virtual pipeline stages, pre-wrap hooks, DDP, mixed precision) is Megatron-LM's.

With ``--hp-hf-config HF_DIR`` the config also holds that architecture's preset (``hp_preset``) and the model is
``hp_megatron.models.preset_gpt_model`` of it: exactly the model the conversion rules of that config target (its
layer spec, ``GPTModel`` keywords and position-id check), as the example builds it.
"""
import dataclasses
from typing import Any, ClassVar

from megatron.core.pipeline_parallel.utils import (is_pp_first_stage, is_pp_last_stage, is_vp_first_stage,
                                                   is_vp_last_stage)
from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig
from megatron.training.vocab_utils import calculate_padded_vocab_size


@dataclasses.dataclass
class HybridGPTModelConfig(GPTModelConfig):
    """``GPTModelConfig`` built by :class:`HybridGPTModelBuilder`; ``transformer_layer_spec`` is the ``--spec``, or
    with ``hp_preset`` (an ``hp_megatron.models.common.ModelPreset``) the preset's spec with
    ``hp_layer_spec_kwargs`` (``linear``, ``cp_layout``)."""

    builder: ClassVar[str] = f"{__name__}.HybridGPTModelBuilder"
    hp_preset: Any = None
    hp_layer_spec_kwargs: dict = dataclasses.field(default_factory=dict)


class HybridGPTModelBuilder(GPTModelBuilder):
    """``GPTModelBuilder`` whose model is ``hybrid_gpt_model`` of the layer spec (module docstring)."""

    def build_model(self, pg_collection, pre_process=None, post_process=None, vp_stage=None):
        from hp_megatron.model_builders import hybrid_gpt_model

        cfg = self._model_config
        vocab_size = cfg.vocab_size
        if vocab_size is None:
            raise ValueError("HybridGPTModelConfig.vocab_size is not set (gpt_config_from_args sets it from the "
                             "tokenizer)")
        if cfg.should_pad_vocab:
            vocab_size = calculate_padded_vocab_size(vocab_size, cfg.make_vocab_size_divisible_by,
                                                     cfg.transformer.tensor_model_parallel_size)
        vp_size = cfg.transformer.virtual_pipeline_model_parallel_size
        if pre_process is None:
            pre_process = is_vp_first_stage(vp_stage=vp_stage, vp_size=vp_size) and is_pp_first_stage(pg_collection.pp)
        if post_process is None:
            post_process = is_vp_last_stage(vp_stage=vp_stage, vp_size=vp_size) and is_pp_last_stage(pg_collection.pp)
        if cfg.hp_preset is not None:
            from hp_megatron.models import preset_gpt_model

            return preset_gpt_model(cfg.hp_preset, cfg.transformer, cfg.transformer.hp_backend,
                                    max_sequence_length=cfg.seq_length, pre_process=pre_process,
                                    post_process=post_process, vp_stage=vp_stage, pg_collection=pg_collection,
                                    **cfg.hp_layer_spec_kwargs)
        return hybrid_gpt_model(
            cfg.transformer, cfg.transformer_layer_spec, vocab_size=vocab_size, max_sequence_length=cfg.seq_length,
            pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
            backend=cfg.transformer.hp_backend, fp16_lm_cross_entropy=cfg.fp16_lm_cross_entropy,
            parallel_output=cfg.parallel_output,
            share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
            position_embedding_type=cfg.position_embedding_type, rotary_percent=cfg.rotary_percent,
            rotary_base=cfg.rotary_base, rope_scaling=cfg.rope_scaling, rope_scaling_factor=cfg.rope_scaling_factor,
            seq_len_interpolation_factor=cfg.seq_len_interpolation_factor,
            scatter_embedding_sequence_parallel=cfg.scatter_embedding_sequence_parallel,
            pg_collection=pg_collection)
