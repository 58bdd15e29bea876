"""The model to generate from: a ``GPTModel`` from an HF config (``hp_megatron.models``' presets), or from the
model arguments the example's checkpoints store (``hp_megatron.training.model_args``, as Megatron-LM's
``--use-checkpoint-args``), with a megatron-core ``torch_dist`` checkpoint loaded into it (a converted one, or one
the example or Megatron-LM saved), on the current megatron parallel state (:func:`model_source` chooses)."""
from __future__ import annotations

import os

import torch

from hp_megatron.training.model_args import MODEL_ARGS_KEY


def load_weights(model, load: str) -> str:
    """Load the checkpoint at ``load`` (its tracker file's iteration, or the directory itself) into ``model``
    with megatron-core's ``dist_checkpointing`` (the model part only); returns the directory read. ValueError
    naming the checkpoint when it does not fit the model."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    from hp_megatron.checkpoint import checkpoint_directory, verify_checkpoint_files

    path = checkpoint_directory(load)
    verify_checkpoint_files(path)
    try:
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
    except (Exception, CheckpointException) as exc:
        if isinstance(exc, CheckpointException):  # (exception, traceback) per failing rank
            exc = next(iter(exc.failures.values()))[0]
        raise ValueError(f"checkpoint {path} does not load into the model: {type(exc).__name__}: {exc}") from None
    model.load_state_dict(state["model"])
    return path


def build_model(hf_config: dict, *, tensor_model_parallel_size: int = 1, load: str | None = None,
                params_dtype: torch.dtype = torch.float32):
    """The ``GPTModel`` of ``hf_config`` (``HybridModel`` when ``load`` is a HybridModel checkpoint) on this rank
    (weights from ``load`` when given, else random), in eval mode, on CUDA when megatron-core's device is a GPU."""
    from hp_megatron.models import architecture_of

    architecture = architecture_of(hf_config).for_model_class(checkpoint_model_class(load))
    model = architecture.build_model(hf_config, tensor_model_parallel_size=tensor_model_parallel_size,
                                     params_dtype=params_dtype)
    if torch.cuda.is_available():
        model.cuda()
    if load is not None:
        load_weights(model, load)
    return model.eval()


def hf_directory(hf_config: str | None) -> str | None:
    """The directory of ``--hp-hf-config`` (where an HF tokenizer would be), or None."""
    if hf_config is None:
        return None
    return hf_config if os.path.isdir(hf_config) else os.path.dirname(os.path.abspath(hf_config))


class ModelSource:
    """What the command builds: ``kind`` ``"hf"`` (``description``: an HF config.json dict, a preset's model) or
    ``"args"`` (``description``: the example's stored flags, ``hp_megatron.training.model_args``); ``vocab_size``
    (the ids sampling may return), ``max_positions`` and ``tokenizer`` (the default tokenizer path, or None)."""

    def __init__(self, kind: str, description: dict, vocab_size: int, max_positions: int, tokenizer: str | None):
        self.kind, self.description = kind, description
        self.vocab_size, self.max_positions, self.tokenizer = vocab_size, max_positions, tokenizer

    def build(self, *, tensor_model_parallel_size: int = 1, load: str | None = None):
        """The ``GPTModel`` on this rank (weights from ``load``), in eval mode."""
        if self.kind == "hf":
            return build_model(self.description, tensor_model_parallel_size=tensor_model_parallel_size, load=load)
        return build_model_from_args(self.description, tensor_model_parallel_size=tensor_model_parallel_size,
                                     load=load)


def model_source(hf_config: str | None, load: str | None, use_checkpoint_args: bool = False) -> ModelSource:
    """The model of the command: ``--hp-hf-config``; else what ``--load``'s common state stores, its HF config
    (a converted checkpoint, the example's ``--hp-hf-config`` runs) or the example's model flags (those first
    with ``use_checkpoint_args``, Megatron-LM's ``--use-checkpoint-args``). ValueError (one line) when the
    checkpoint stores neither."""
    from hp_megatron.convert.safetensors_io import load_hf_config
    from hp_megatron.generate.tokenizer import has_tokenizer

    if use_checkpoint_args and (load is None or hf_config is not None):
        raise ValueError("--use-checkpoint-args takes the model from --load's stored arguments: give --load "
                         "and no --hp-hf-config")
    if hf_config is not None:
        config, directory = load_hf_config(hf_config), hf_directory(hf_config)
        tokenizer = directory if has_tokenizer(directory) else None
    elif load is None:
        raise ValueError("--hp-hf-config is required without --load (the model's HF config.json)")
    else:
        path, common = _common_state(load)
        stored = common.get(MODEL_ARGS_KEY)
        if stored is not None and (use_checkpoint_args or common.get("hf_config") is None):
            check_stored_model(stored, path)
            return ModelSource("args", stored, int(stored["vocab_size"]), int(stored["seq_length"]),
                               stored.get("tokenizer"))
        if use_checkpoint_args:
            raise ValueError(f"--use-checkpoint-args: checkpoint {path} stores no model arguments "
                             f"({MODEL_ARGS_KEY}, which the example's checkpoints store)")
        if common.get("hf_config") is None:
            raise ValueError(f"checkpoint {path} stores neither an HF config nor the example's model arguments; "
                             "pass --hp-hf-config")
        config, tokenizer = common["hf_config"], None
    text = config.get("text_config", config)   # a VL checkpoint's language model (Qwen3.5)
    return ModelSource("hf", config, int(text["vocab_size"]), int(text.get("max_position_embeddings") or 4096),
                       tokenizer)


def check_stored_model(stored: dict, path: str) -> None:
    """Refuse, before anything is built, a stored model this command cannot generate from: a stored
    ``--hp-mixer-module`` that does not import here (ValueError naming it and the checkpoint), or a mixer of its
    pattern that declares no decode path (``MixerSupport.decode``; ``hp_megatron.registry.UnsupportedByMixer``)."""
    from hp_megatron.arguments import check_mixer_support
    from hp_megatron.training.model_args import args_from_stored

    try:
        args = args_from_stored(stored)
    except ImportError as err:
        raise ValueError(f"checkpoint {path} was trained with a mixer module that cannot be imported here: {err}; "
                         "put it on PYTHONPATH") from None
    args.context_parallel_size = 1
    check_mixer_support(args, decode=True)


def checkpoint_model_class(load: str | None) -> str:
    """``gpt`` or ``hybrid``: the model class of the checkpoint ``load`` (its common state's ``model_class``, else its
    keys: ``hp_megatron.convert.engine.stored_model_class``); ``gpt`` without ``load``."""
    from hp_megatron.convert.engine import stored_model_class

    if load is None:
        return "gpt"
    _, common = _common_state(load)
    return common.get("model_class") or stored_model_class(load)


def _common_state(load: str) -> tuple[str, dict]:
    """(checkpoint directory, its common state) of ``load`` (tracker or iteration directory), read with
    megatron-core's ``dist_checkpointing.load_common_state_dict``; ValueError naming a missing file."""
    from megatron.core import dist_checkpointing

    from hp_megatron.checkpoint import checkpoint_directory, verify_checkpoint_files

    path = checkpoint_directory(load)
    verify_checkpoint_files(path)
    return path, dist_checkpointing.load_common_state_dict(path)


def build_model_from_args(stored: dict, *, tensor_model_parallel_size: int = 1, load: str | None = None,
                          params_dtype: torch.dtype = torch.float32):
    """The example's ``GPTModel`` (``HybridModel`` for a HybridModel checkpoint ``load``) of the stored flags
    ``stored`` (``hp_megatron.training.model_args``) at ``tensor_model_parallel_size`` on this rank, without the MTP
    layers (generation reads the main head only), weights from ``load``, in eval mode."""
    from hp_megatron.arguments import validate_hp_args
    from hp_megatron.platform import CPU_SAFE_CONFIG
    from hp_megatron.training.model_args import args_from_stored, hybrid_config_from_args, hybrid_model_from_args

    args = args_from_stored(stored)
    args.model_class = checkpoint_model_class(load)
    # the pattern the run gave (--hybrid-layer-pattern, stored beside the flags; one pipeline stage here), else
    # derived from the flags
    pattern = _common_state(load)[1].get("hybrid_layer_pattern") if load is not None else None
    args.hybrid_layer_pattern = pattern.replace("|", "") if pattern else None
    vocab, tp = int(stored["padded_vocab_size"]), tensor_model_parallel_size
    if vocab % tp:
        raise ValueError(f"the checkpoint's padded vocabulary {vocab} is not divisible by "
                         f"--tensor-model-parallel-size {tp}")
    args.tensor_model_parallel_size, args.context_parallel_size = tp, 1
    validate_hp_args(args)  # the GDN/KDA heads against TP, named by their flags
    config = hybrid_config_from_args(args, tensor_model_parallel_size=tp, params_dtype=params_dtype,
                                     pipeline_dtype=params_dtype, **CPU_SAFE_CONFIG)
    model = hybrid_model_from_args(args, config, vocab_size=vocab)
    if torch.cuda.is_available():
        model.cuda()
    if load is not None:
        load_weights(model, load)
    return model.eval()
