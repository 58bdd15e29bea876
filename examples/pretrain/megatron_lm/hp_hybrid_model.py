"""Megatron-LM 0.19's model config of ``--spec hp_megatron.specs NAME`` for ``pretrain_hybrid.py`` when the
``--hybrid-layer-pattern`` has multi-token-prediction parts (``/``; imported by ``pretrain_hybrid_hp.py`` then).

The module-level stack specs set no ``mtp_block_spec``, so megatron-core's ``HybridModel`` refuses ``/`` patterns
with them (its ``roll_tensor`` MTP losses need CUDA under CP and normalise per CP rank). :class:`HybridStackModelConfig`
is ``HybridModelConfig`` (the same fields, from ``hybrid_config_from_args``) whose builder,
:class:`HybridStackModelBuilder`, builds ``hp_megatron.hybrid_model.model.MTPHybridModel`` over the same stack spec
with the MTP block (``get_hybrid_stack_spec(..., mtp=True)``: megatron-core's MTP block of our
``GlobalShiftMTPLayer``): the model and MTP losses of the example's ``--model-class hybrid``. Everything else of the
builder (pre-wrap hooks, DDP, mixed precision) is Megatron-LM's.
"""
from typing import ClassVar

from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage
from megatron.training.models.hybrid import HybridModelBuilder, HybridModelConfig
from megatron.training.vocab_utils import calculate_padded_vocab_size


def with_mtp_block(spec_name: str):
    """The stack spec ``spec_name`` of ``hp_megatron.specs.STACK_SPECS`` with its ``mtp_block_spec``."""
    from hp_megatron.specs.hybrid_stack_specs import STACK_SPECS, get_hybrid_stack_spec

    if spec_name not in STACK_SPECS:
        raise ValueError(f"--spec hp_megatron.specs {spec_name}: multi-token prediction ('/' in "
                         f"--hybrid-layer-pattern) takes one of {sorted(STACK_SPECS)}")
    backend, g_mixer = STACK_SPECS[spec_name]
    return get_hybrid_stack_spec(backend, g_mixer=g_mixer, mtp=True)


class HybridStackModelConfig(HybridModelConfig):
    """``HybridModelConfig`` built by :class:`HybridStackModelBuilder`; ``hybrid_stack_spec`` holds the MTP block."""

    builder: ClassVar[str] = f"{__name__}.HybridStackModelBuilder"


class HybridStackModelBuilder(HybridModelBuilder):
    """``HybridModelBuilder`` whose model is ``MTPHybridModel`` (module docstring), with upstream's keywords."""

    def build_model(self, pg_collection, pre_process=None, post_process=None, vp_stage=None):
        from hp_megatron.hybrid_model.model import MTPHybridModel

        cfg = self._model_config
        if cfg.vocab_size is None:
            raise ValueError("HybridStackModelConfig.vocab_size is not set (hybrid_config_from_args sets it from "
                             "the tokenizer)")
        vocab_size = cfg.vocab_size
        if cfg.should_pad_vocab:
            vocab_size = calculate_padded_vocab_size(vocab_size, cfg.make_vocab_size_divisible_by,
                                                     cfg.transformer.tensor_model_parallel_size)
        return MTPHybridModel(
            config=cfg.transformer, hybrid_stack_spec=cfg.hybrid_stack_spec, vocab_size=vocab_size,
            max_sequence_length=cfg.seq_length, hybrid_layer_pattern=cfg.hybrid_layer_pattern,
            fp16_lm_cross_entropy=cfg.fp16_lm_cross_entropy, parallel_output=cfg.parallel_output,
            share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
            position_embedding_type=cfg.position_embedding_type, rotary_percent=cfg.rotary_percent,
            rotary_base=cfg.rotary_base, seq_len_interpolation_factor=cfg.seq_len_interpolation_factor,
            pre_process=is_pp_first_stage(pg_collection.pp) if pre_process is None else pre_process,
            post_process=is_pp_last_stage(pg_collection.pp) if post_process is None else post_process,
            pg_collection=pg_collection, vp_stage=vp_stage)
