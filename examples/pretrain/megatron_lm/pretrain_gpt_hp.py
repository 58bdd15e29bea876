"""Megatron-LM's ``pretrain_gpt.py`` with hp_megatron's flags (``extra_args_provider``) and config fields.

Needs a Megatron-LM checkout on PYTHONPATH (``pretrain_gpt.py``, ``megatron/training``); the model comes from
``--spec hp_megatron.specs NAME`` as with the unmodified script, or (Megatron-LM 0.19) from ``--hp-hf-config HF_DIR``:
that Hugging Face config's architecture and dims (``hp_megatron.models.args.apply_hf_preset``, applied between
Megatron-LM's parsing and its validation; a model flag given with another value is refused), the model the
converted checkpoint of that config loads into (``--load``). Four things are added:

* ``extra_args_provider=hp_megatron.arguments.add_hp_arguments`` (``--hp-*`` flags),
* the ``TransformerConfig`` that Megatron-LM builds from its args (``core_transformer_config_from_args``) becomes
  the declared ``hp_megatron.config.HybridTransformerConfig`` (``HybridMLATransformerConfig`` with
  ``--multi-latent-attention``) holding our fields, through ``hp_megatron.arguments.apply_hp_config``, before
  the model is built, and
* the model provider first registers the CP sub-groups of the ``--hp-*`` CP flags on every rank
  (``hp_megatron.training.cp_subgroup_registration.register_cp_subgroups_from_args``), then builds the model with
  Megatron-LM's ``GPTModel`` keywords through ``hp_megatron.model_builders.hybrid_gpt_model`` (the block-final norm is
  our RMSNorm, as in the layers, on every install; megatron-core's module-level ``LayerNormImpl`` is not patched;
  with ``--mtp-num-layers`` the multi-token-prediction block of the spec's declared MTP kind, in place of
  Megatron-LM's ``mtp_block_spec``, and Megatron-LM logs ``mtp_1 loss`` ... as for its own models), and
* Megatron-LM's training loop finalizes gradients with ``layers.shared.tp_replicated_grads.finalize_model_grads``
  (megatron-core's, then the GDN / KDA output-norm gradients summed over TP once per step; ``hp_launch``).

On Megatron-LM 0.19 (``pretrain(cfg_container, ...)``: the model comes from a ``ModelConfig``'s builder, not from a
model provider) the same four things happen in ``pretrain_gpt.py``'s 0.19 ``__main__``
(``hp_launch.pretrain_from_container``): the args are parsed with our flags, the model config is
``hp_gpt_model.HybridGPTModelConfig`` holding our ``TransformerConfig`` (its builder calls ``hybrid_gpt_model``), and
the CP sub-groups are registered in a ``pre_wrap_hooks`` entry (every rank, before DDP wraps the model).

Everything else (data, schedules, optimizer, checkpoints, logging) is Megatron-LM's. Megatron and our package
are imported in :func:`main` only: megatron-core's checkpoint writer starts a ``spawn`` process, which re-runs
this file's top level.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from hp_launch import (exit_refusing_unsupported, import_megatron_lm, pretrain_from_container,  # noqa: E402
                       uses_config_container, with_hp_config)


def _patch_config_builders(pretrain_gpt):
    """Megatron-LM 0.16 builds the config with ``core_transformer_config_from_args`` in ``gpt_builders.gpt_builder``
    (and ``pretrain_gpt``'s own helpers): both names get our fields."""
    import gpt_builders

    for module in (pretrain_gpt, gpt_builders):
        module.core_transformer_config_from_args = with_hp_config(module.core_transformer_config_from_args)


def _is_hp_spec(args) -> bool:
    spec = getattr(args, "spec", None)
    return bool(spec) and spec[0] == "hp_megatron.specs"


def _hybrid_gpt_builder(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
    """Megatron-LM's ``gpt_builder`` for ``--spec hp_megatron.specs NAME``: the same ``GPTModel`` keywords from the
    args, the model from ``hp_megatron.model_builders.hybrid_gpt_model`` (the block-final norm is our RMSNorm,
    as in every layer, instead of megatron's module-level ``LayerNormImpl``)."""
    from megatron.core.transformer.spec_utils import import_module
    from megatron.training.arguments import core_transformer_config_from_args

    from hp_megatron.model_builders import hybrid_gpt_model

    for flag in ("--use-legacy-models", "--yaml-cfg"):
        if getattr(args, flag[2:].replace("-", "_"), None):
            raise ValueError(f"{flag} is not supported with --spec hp_megatron.specs (the launcher builds the hybrid "
                             "megatron-core GPTModel from the command-line flags)")
    if config is None:
        config = with_hp_config(core_transformer_config_from_args)(args)
    return hybrid_gpt_model(
        config, import_module(args.spec), vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        vp_stage=vp_stage, backend=args.hp_backend, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling, pg_collection=pg_collection)


def _model_provider(pretrain_gpt):
    """Megatron-LM's model provider; with ``--spec hp_megatron.specs NAME`` its builder is
    :func:`_hybrid_gpt_builder`, otherwise Megatron-LM's own."""
    def with_cp_subgroups(*args, **kwargs):
        """Every rank runs the model provider at the same point (once per virtual pipeline stage; the repeats
        create nothing): where our CP sub-groups are registered, collectively over the world."""
        from megatron.training import get_args

        from hp_megatron.training.cp_subgroup_registration import register_cp_subgroups_from_args

        megatron_args = get_args()
        register_cp_subgroups_from_args(megatron_args)
        builder = _hybrid_gpt_builder if _is_hp_spec(megatron_args) else pretrain_gpt.gpt_builder
        return pretrain_gpt.model_provider(builder, *args, **kwargs)   # model_provider(model_builder, pre_process, ...)
    return with_cp_subgroups


def _model_config(args, config):
    """Megatron-LM 0.19: the ``ModelConfig`` of ``pretrain_gpt.py``'s ``__main__`` with our ``config``; for
    ``--spec hp_megatron.specs NAME`` or ``--hp-hf-config HF_DIR`` built by ``hp_gpt_model.HybridGPTModelBuilder``
    (with the HF config: that architecture's model, its embedding rows the config's ``vocab_size``)."""
    from megatron.training.argument_utils import gpt_config_from_args

    preset = getattr(args, "hp_preset", None)
    if preset is None and not _is_hp_spec(args):
        return gpt_config_from_args(args, config=config)
    from hp_gpt_model import HybridGPTModelConfig

    if preset is None:
        return gpt_config_from_args(args, config=config, model_config_cls=HybridGPTModelConfig)
    from megatron.training import get_tokenizer

    from hp_megatron.models.args import preset_vocab_size

    source = f"--hp-hf-config {args.hp_hf_config}"
    if args.spec is not None:
        raise ValueError(f"--spec {' '.join(args.spec)} conflicts with {source}, whose architecture decides the "
                         "layers: drop --spec")
    args.padded_vocab_size = preset_vocab_size(preset, get_tokenizer().vocab_size, args.tensor_model_parallel_size,
                                               source)
    model_config = gpt_config_from_args(args, config=config, model_config_cls=HybridGPTModelConfig)
    model_config.hp_preset = preset
    model_config.hp_layer_spec_kwargs = {"linear": args.hp_linear, "cp_layout": args.hp_cp_layout}
    return model_config


def main():
    pretrain_gpt, ModelType, pretrain = import_megatron_lm("pretrain_gpt")
    if uses_config_container(pretrain):  # Megatron-LM 0.19
        pretrain_from_container(pretrain_gpt, ModelType, pretrain, _model_config,
                                get_embedding_ranks=pretrain_gpt.get_embedding_ranks)
        return
    from hp_megatron.arguments import add_hp_arguments

    if "--reset-attention-mask" in sys.argv:
        raise ValueError("--reset-attention-mask with pretrain_gpt_hp.py needs Megatron-LM 0.19 (packed documents "
                         "as our THD rows: hp_packed.py); use examples/pretrain/pretrain_hybrid.py on this checkout")
    if "--hp-hf-config" in sys.argv or any(arg.startswith("--hp-hf-config=") for arg in sys.argv):
        raise ValueError("--hp-hf-config with pretrain_gpt_hp.py needs Megatron-LM 0.19 (this checkout's pretrain "
                         "is older): give the model flags, or use examples/pretrain/pretrain_hybrid.py --hp-hf-config")
    _patch_config_builders(pretrain_gpt)
    pretrain_gpt.train_valid_test_datasets_provider.is_distributed = True
    pretrain(pretrain_gpt.train_valid_test_datasets_provider, _model_provider(pretrain_gpt),
             ModelType.encoder_or_decoder, pretrain_gpt.forward_step,
             args_defaults={"tokenizer_type": "GPT2BPETokenizer"}, extra_args_provider=add_hp_arguments)


if __name__ == "__main__":
    sys.exit(exit_refusing_unsupported(main))
