"""What the Megatron-LM launchers (``pretrain_gpt_hp.py``, ``pretrain_hybrid_hp.py``) share.

* :func:`import_megatron_lm`: Megatron-LM's modules, or a RuntimeError naming the checkout or the missing package;
  its training loop then finalizes gradients with ``layers.shared.tp_replicated_grads.finalize_model_grads``
  (megatron-core's, then our TP-replicated gradients summed once per step instead of once per micro-batch);
* :func:`with_hp_config`: a wrapper of Megatron-LM's ``core_transformer_config_from_args`` whose config is the
  declared ``hp_megatron.config`` class with the ``--hp-*`` fields (``hp_megatron.arguments.apply_hp_config``),
  after :func:`check_args`;
* :func:`uses_config_container`: whether Megatron-LM's ``pretrain`` is 0.19's (a ``PretrainConfigContainer`` with
  the model's ``ModelConfig``, built from the args before ``pretrain``) or 0.16's (a model provider);
* :func:`exit_refusing_unsupported`: a launcher's ``main`` with a combination a mixer declares it does not support
  (``hp_megatron.registry.UnsupportedByMixer``, found by :func:`check_args` before the model is built) reported as
  one line and exit status 2, as the example and ``python -m hp_megatron.generate`` do;
* :func:`add_hp_arguments_from_hf_config`: Megatron-LM's ``extra_args_provider``: the ``--hp-*`` flags, and with
  ``--hp-hf-config HF_DIR`` the model flags of that config applied between parsing and Megatron-LM's validation;
* :func:`pretrain_from_container`: 0.19's ``__main__`` of ``pretrain_gpt.py`` / ``pretrain_hybrid.py`` with the
  ``--hp-*`` flags, our config in the model config, and the CP sub-groups registered before the model is wrapped.

Nothing heavy is imported at module level: megatron-core's checkpoint writer starts a ``spawn`` process, which
re-runs the launcher's top level.
"""
import functools
import inspect
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

_PIP_NAMES = {"yaml": "pyyaml", "sentencepiece": "sentencepiece", "tiktoken": "tiktoken"}


def import_error_message(err: ImportError, checkout_modules) -> str:
    """Name the missing module and how to get it: the checkout itself (one of ``checkout_modules``), or a
    package it imports."""
    missing = err.name or str(err)
    if any(missing == m or missing.startswith(m + ".") for m in checkout_modules):
        return (f"this launcher needs a Megatron-LM checkout on PYTHONPATH (module {missing!r} not found): "
                "git clone https://github.com/NVIDIA/Megatron-LM at the tag of your megatron-core and set "
                "MEGATRON_LM (the launch scripts put it on PYTHONPATH); pip's megatron-core holds only megatron.core")
    package = _PIP_NAMES.get(missing.split(".")[0], missing.split(".")[0])
    return (f"Megatron-LM imports {missing!r}, which is not installed: pip install {package} "
            "(pip install -e '.[test]' installs what the CPU tests of this path need)")


def import_megatron_lm(entry: str):
    """``(entry module, ModelType, pretrain)`` for Megatron-LM's ``entry`` script (``pretrain_gpt`` or
    ``pretrain_hybrid``); a missing module raises RuntimeError naming it."""
    import importlib

    modules = (entry, entry.replace("pretrain_", "") + "_builders", "model_provider", "megatron.training")
    try:
        module = importlib.import_module(entry)
        from megatron.core.enums import ModelType
        from megatron.training import pretrain
    except ImportError as err:
        raise RuntimeError(import_error_message(err, modules)) from err
    use_hp_finalize_model_grads()
    return module, ModelType, pretrain


def use_hp_finalize_model_grads(training=None):
    """Megatron-LM's ``train`` sets ``config.finalize_model_grads_func`` to its module's ``finalize_model_grads``
    (0.16 always, 0.19 when unset): that name of ``training`` (default: ``megatron.training.training``) becomes ours,
    which runs megatron-core's and then sums the GDN / KDA output-norm gradients over TP once per step
    (``layers.shared.tp_replicated_grads``; without it they are summed per micro-batch)."""
    if training is None:
        import megatron.training.training as training

    from layers.shared.tp_replicated_grads import finalize_model_grads

    training.finalize_model_grads = finalize_model_grads


def uses_config_container(pretrain) -> bool:
    """Megatron-LM 0.19's ``pretrain(cfg_container, ...)`` (the model from ``cfg_container.model``), not 0.16's
    ``pretrain(datasets_provider, model_provider, ...)``."""
    return next(iter(inspect.signature(pretrain).parameters)) == "cfg_container"


def check_args(args):
    """Refuse combinations Megatron-LM's own data path would silently get wrong (its inter-document masking, a CP
    layout other than its zigzag; packed documents only as our THD rows on one pipeline stage), and those a mixer of
    ``--hp-layer-pattern`` declares it does not support (``hp_megatron.arguments.check_mixer_support``: CP, MTP,
    backend, the mixer's own ``check_args``; THD with ``--reset-attention-mask``)."""
    from hp_megatron.arguments import check_mixer_support

    if getattr(args, "dataloader_inter_document_masking", False):
        raise ValueError("--dataloader-inter-document-masking: Megatron-LM 0.19 splits such rows zigzag over CP as a "
                         "whole, a layout our layers do not take; pack documents with --reset-position-ids "
                         "--reset-attention-mask (our THD rows: hp_packed.py)")
    packed = bool(getattr(args, "reset_attention_mask", False))
    if packed:
        if not getattr(args, "reset_position_ids", False):
            raise ValueError("--reset-attention-mask needs --reset-position-ids here (documents are cut where the "
                             "positions restart)")
        if args.pipeline_model_parallel_size > 1:
            raise ValueError(f"--reset-attention-mask with --pipeline-model-parallel-size "
                             f"{args.pipeline_model_parallel_size}: packed rows vary in length per micro-batch and "
                             "Megatron-LM's pipeline buffers have a fixed shape; use one pipeline stage")
    check_mixer_support(args, thd=packed)
    if args.hp_cp_layout != "zigzag":
        raise ValueError(f"--hp-cp-layout {args.hp_cp_layout}: Megatron-LM's get_batch hands every CP rank a zigzag "
                         "shard; use --hp-cp-layout zigzag here (contiguous works with examples/pretrain/"
                         "pretrain_hybrid.py, whose data path follows the flag)")
    spec = getattr(args, "spec", None)
    if spec and spec[0] == "hp_megatron.specs":
        name = spec[-1]
        spec_backend = "triton" if "_triton" in name else "ascendc" if "_ascendc" in name else "eager"
        if spec_backend != args.hp_backend:
            base = name.replace("_triton", "").replace("_ascendc", "").replace("_spec", "")
            wanted = f"{base}{'' if args.hp_backend == 'eager' else '_' + args.hp_backend}_spec"
            raise ValueError(f"--spec hp_megatron.specs {name} fixes the {spec_backend} kernels, but --hp-backend "
                             f"is {args.hp_backend}; use --spec hp_megatron.specs {wanted}")


def exit_refusing_unsupported(main) -> int:
    """``main()``'s exit status: 0, or 2 with one ``error: ...`` line on stderr (rank 0 only under torchrun) for
    ``hp_megatron.registry.UnsupportedByMixer``; any other error propagates as Megatron-LM reports it."""
    from hp_megatron.registry import UnsupportedByMixer

    try:
        main()
    except UnsupportedByMixer as err:
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"error: {err}\n")
            sys.stderr.flush()
        return 2
    return 0


def with_hp_config(build_config):
    """``build_config(args, ...)`` (Megatron-LM's ``core_transformer_config_from_args``) returning our declared
    config class with the ``--hp-*`` fields."""
    @functools.wraps(build_config)
    def wrapper(args, *a, **kw):
        from hp_megatron.arguments import apply_hp_config
        from hp_megatron.config import split_recompute_modules

        check_args(args)
        split_recompute_modules(args)   # our --recompute-modules names, before megatron-core checks its own
        return apply_hp_config(build_config(args, *a, **kw), args)
    return wrapper


def add_hp_arguments_from_hf_config(parser):
    """Megatron-LM's ``extra_args_provider``: ``parser`` with the ``--hp-*`` flags
    (``hp_megatron.arguments.add_hp_arguments``) whose ``parse_args`` then applies ``--hp-hf-config``
    (``hp_megatron.models.args.apply_hf_preset``: the architecture's model flags, ``args.hp_preset``; a model flag
    given with another value is refused), before Megatron-LM validates the args and derives the rest from them."""
    from hp_megatron.arguments import add_hp_arguments
    from hp_megatron.models.args import apply_hf_preset

    parser = add_hp_arguments(parser)
    parse = parser.parse_args

    @functools.wraps(parse)
    def parse_args(argv=None, namespace=None):
        args = parse(argv, namespace)
        args.hp_preset = apply_hf_preset(args, sys.argv[1:] if argv is None else argv)
        return args
    parser.parse_args = parse_args
    return parser


def register_cp_subgroups_hook(models):
    """A ``ModelConfig.pre_wrap_hooks`` entry: our CP sub-groups, registered on every rank at the same point (after
    the model stages are built, before DDP wraps them and before any forward); returns ``models`` unchanged."""
    from megatron.training import get_args

    from hp_megatron.training.cp_subgroup_registration import register_cp_subgroups_from_args

    register_cp_subgroups_from_args(get_args())
    return models


def pretrain_from_container(entry, model_type, pretrain, model_config, **pretrain_kwargs):
    """Megatron-LM 0.19's ``__main__`` of ``entry`` (its ``pretrain_gpt`` / ``pretrain_hybrid`` module) with the
    ``--hp-*`` flags: ``model_config(args, config)`` builds the ``ModelConfig`` from the args and our
    ``TransformerConfig`` (:func:`with_hp_config`); ``pretrain_kwargs`` go to ``pretrain`` (e.g.
    ``get_embedding_ranks``)."""
    from megatron.training import inprocess_restart
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args

    args = parse_and_validate_args(extra_args_provider=add_hp_arguments_from_hf_config,
                                   args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    if getattr(args, "yaml_cfg", None):
        raise ValueError("--yaml-cfg is not supported by the hp_megatron launchers (they build the model's config "
                         "from the command-line flags)")
    model_cfg = model_config(args, with_hp_config(core_transformer_config_from_args)(args))
    model_cfg.pre_wrap_hooks.append(register_cp_subgroups_hook)
    if args.reset_attention_mask:   # packed documents as our THD rows (checked by check_args)
        from hp_packed import packed_get_batch

        entry.get_batch = packed_get_batch(entry)
        if not hasattr(entry, "args"):
            # core_v0.19.0's pretrain_hybrid.forward_step reads an undefined name `args` on its packed path
            # (`tokens_per_sample=args.seq_length`, a NameError): the module's `args` are Megatron-LM's global args
            entry.args = args
    entry.train_valid_test_datasets_provider.is_distributed = True
    pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    pretrain(pretrain_cfg_container_from_args(args, model_cfg), entry.train_valid_test_datasets_provider,
             model_type.encoder_or_decoder, entry.forward_step, store=store, **pretrain_kwargs)
