"""Megatron-LM 0.19's ``pretrain_hybrid.py`` (megatron-core's ``HybridModel``) with hp_megatron's flags and config.

Needs Megatron-LM 0.19's training code on PYTHONPATH. The model is megatron-core's ``HybridModel`` as Megatron-LM
builds it (``hybrid_config_from_args`` -> ``HybridModelBuilder``): the layer order from ``--hybrid-layer-pattern``,
the layers from the stack spec of ``--spec``, e.g. ``--spec hp_megatron.specs hybrid_stack_spec`` (``G`` our GDN,
``*`` attention, ``+`` our MLA, ``-`` MLP, ``E`` MoE) or ``kda_hybrid_stack_spec`` (our KDA in the ``G`` slot);
``hp_megatron.specs.hybrid_stack_specs``. Added, as in ``pretrain_gpt_hp.py`` (``hp_launch.pretrain_from_container``):

* the ``--hp-*`` flags (``hp_megatron.arguments.add_hp_arguments``);
* the model's ``TransformerConfig`` is our declared ``HybridTransformerConfig`` with those fields
  (``hp_megatron.arguments.apply_hp_config``), passed to Megatron-LM's ``hybrid_config_from_args``;
* our CP sub-groups are registered on every rank before the model is wrapped (a ``pre_wrap_hooks`` entry);
* multi-token prediction (``/`` parts in ``--hybrid-layer-pattern``): the model is our ``MTPHybridModel`` over the
  spec with its MTP block (``hp_hybrid_model``), as the example's ``--model-class hybrid`` builds it, and
  Megatron-LM logs ``mtp_1 loss`` ... as for its own models.

MLA layers (``+``): Megatron-LM turns on ``--multi-latent-attention`` for a pattern with ``+``, so their dims come
from Megatron-LM's MLA flags (``--q-lora-rank --kv-lora-rank --qk-head-dim --qk-pos-emb-head-dim --v-head-dim``),
as for its own MLA layers; ``--hp-mla-*`` dims would be ignored and are refused. Their rotary embedding is
Megatron-LM's ``--rope-type`` (``rope | yarn``; MLA's default ``yarn``) or ``--hp-mla-rope-type`` (``rope | yarn |
none``; ``none`` = NoPE, as Kimi Linear's MLA, which ``--rope-type`` cannot say); not both.

Data, batches (zigzag CP shards), schedules, optimizer, checkpoints and logging are Megatron-LM's.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from hp_launch import (exit_refusing_unsupported, import_megatron_lm, pretrain_from_container,  # noqa: E402
                       uses_config_container)


_HP_MLA_DIMS = {"--hp-mla-q-lora-rank": "--q-lora-rank", "--hp-mla-kv-lora-rank": "--kv-lora-rank",
                "--hp-mla-qk-head-dim": "--qk-head-dim", "--hp-mla-qk-pos-emb-head-dim": "--qk-pos-emb-head-dim",
                "--hp-mla-v-head-dim": "--v-head-dim"}


def _given(flag: str, argv) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in argv)


def _mla_rope_type(args, config, argv):
    """The MLA layers' settings (module docstring): ``config`` with ``--hp-mla-rope-type``'s value when given."""
    if not getattr(args, "multi_latent_attention", False):
        return config
    for ours, megatron in _HP_MLA_DIMS.items():
        if getattr(args, ours[2:].replace("-", "_")) is not None:
            raise ValueError(f"{ours}: MLA layers ('+' in --hybrid-layer-pattern) take Megatron-LM's MLA flags "
                             f"(Megatron-LM sets --multi-latent-attention for them); use {megatron}")
    if _given("--hp-mla-rope-type", argv):
        if _given("--rope-type", argv):
            raise ValueError("--rope-type and --hp-mla-rope-type both set the MLA layers' rotary embedding; give one")
        config.rope_type = args.hp_mla_rope_type
    return config


def _model_config(args, config):
    """Megatron-LM's ``HybridModelConfig`` from the args, with our ``config``; a spec is required."""
    from megatron.training.argument_utils import hybrid_config_from_args

    if getattr(args, "hp_preset", None) is not None:
        raise ValueError(f"--hp-hf-config {args.hp_hf_config}: pretrain_hybrid_hp.py builds HybridModel from --spec "
                         "and --hybrid-layer-pattern; train an HF architecture with pretrain_gpt_hp.py --hp-hf-config "
                         "or examples/pretrain/pretrain_hybrid.py --hp-hf-config --model-class hybrid")
    if args.spec is None:
        raise ValueError("pretrain_hybrid_hp.py needs --spec MODULE NAME, a HybridModel stack spec, e.g. --spec "
                         "hp_megatron.specs hybrid_stack_spec (hp_megatron.specs.STACK_SPECS)")
    config = _mla_rope_type(args, config, sys.argv[1:])
    if "/" not in (args.hybrid_layer_pattern or "") or args.spec[0] != "hp_megatron.specs":
        return hybrid_config_from_args(args, config=config)
    from hp_hybrid_model import HybridStackModelConfig, with_mtp_block

    model_config = hybrid_config_from_args(args, config=config, model_config_cls=HybridStackModelConfig)
    model_config.hybrid_stack_spec = with_mtp_block(args.spec[-1])
    return model_config


def main():
    pretrain_hybrid, ModelType, pretrain = import_megatron_lm("pretrain_hybrid")
    if not uses_config_container(pretrain):
        raise RuntimeError("pretrain_hybrid_hp.py is for Megatron-LM 0.19's pretrain_hybrid.py (pretrain with a "
                           "config container); this checkout's pretrain is older")
    pretrain_from_container(pretrain_hybrid, ModelType, pretrain, _model_config)


if __name__ == "__main__":
    sys.exit(exit_refusing_unsupported(main))
