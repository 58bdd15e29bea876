"""Megatron-LM's ``pretrain_gpt.py`` with hp_megatron's flags (``extra_args_provider``) and config fields.

Needs a Megatron-LM checkout on PYTHONPATH (``pretrain_gpt.py``, ``megatron/training``); the model comes from
``--spec hp_megatron.specs NAME`` exactly as with the unmodified script. Two things are added:

* ``extra_args_provider=hp_megatron.arguments.add_hp_arguments`` (``--hp-*`` flags), and
* the ``TransformerConfig`` that Megatron-LM builds from its args (``core_transformer_config_from_args``) gets
  our fields through ``hp_megatron.arguments.apply_hp_config`` before the model is built.

Everything else (data, schedules, optimizer, checkpoints, logging) is Megatron-LM's.
"""
import functools
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

try:
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
except ImportError as err:
    raise RuntimeError("this launcher needs a Megatron-LM checkout on PYTHONPATH (pretrain_gpt.py and "
                       "megatron/training); pip's megatron-core holds only megatron.core") from err

from hp_megatron.arguments import add_hp_arguments, apply_hp_config


def _check_args(args):
    """Refuse combinations Megatron-LM's own data path would silently get wrong."""
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


def _with_hp_config(build_config):
    @functools.wraps(build_config)
    def wrapper(args, *a, **kw):
        _check_args(args)
        return apply_hp_config(build_config(args, *a, **kw), args)
    return wrapper


def _patch_config_builders():
    """Megatron-LM 0.14 builds the config in pretrain_gpt.model_provider, 0.15+ in gpt_builders.gpt_builder."""
    modules = [pretrain_gpt]
    try:
        import gpt_builders
        modules.append(gpt_builders)
    except ImportError:
        pass
    patched = False
    for module in modules:
        if hasattr(module, "core_transformer_config_from_args"):
            module.core_transformer_config_from_args = _with_hp_config(module.core_transformer_config_from_args)
            patched = True
    if not patched:
        raise RuntimeError("found no core_transformer_config_from_args in pretrain_gpt/gpt_builders; "
                           "this Megatron-LM version is not supported by the launcher")


def _model_provider():
    if hasattr(pretrain_gpt, "gpt_builder"):  # 0.15+: model_provider(model_builder, pre_process, ...)
        return functools.partial(pretrain_gpt.model_provider, pretrain_gpt.gpt_builder)
    return pretrain_gpt.model_provider


if __name__ == "__main__":
    _patch_config_builders()
    pretrain_gpt.train_valid_test_datasets_provider.is_distributed = True
    pretrain(pretrain_gpt.train_valid_test_datasets_provider, _model_provider(), ModelType.encoder_or_decoder,
             pretrain_gpt.forward_step, args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
             extra_args_provider=add_hp_arguments)
