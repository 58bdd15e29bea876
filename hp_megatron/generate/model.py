"""The model to generate from: a ``GPTModel`` from an HF config (``hp_megatron.models``' presets) with a
megatron-core ``torch_dist`` checkpoint loaded into it (a converted one, or one the example or Megatron-LM
saved), on the current megatron parallel state."""
from __future__ import annotations

import os

import torch


def model_hf_config(hf_config: str | None, load: str | None) -> dict:
    """The HF config.json (dict) of the model: ``hf_config`` (a directory or file), else the one a converted
    checkpoint stores (``hp_megatron.convert``); ValueError when neither is there."""
    from hp_megatron.convert.engine import stored_hf_config
    from hp_megatron.convert.safetensors_io import load_hf_config

    if hf_config is not None:
        return load_hf_config(hf_config)
    if load is None:
        raise ValueError("--hp-hf-config is required without --load (the model's HF config.json)")
    return stored_hf_config(load)


def load_weights(model, load: str) -> str:
    """Load the checkpoint at ``load`` (its tracker file's iteration, or the directory itself) into ``model``
    with megatron-core's ``dist_checkpointing`` (the model part only); returns the directory read. ValueError
    naming the checkpoint when it does not fit the model."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    from hp_megatron.checkpoint_dirs import verify_checkpoint_files
    from hp_megatron.convert.engine import checkpoint_directory

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
    """The ``GPTModel`` of ``hf_config`` on this rank (weights from ``load`` when given, else random), in eval
    mode, on CUDA when megatron-core's device is a GPU."""
    from hp_megatron.models import architecture_of

    model = architecture_of(hf_config).build_model(hf_config, tensor_model_parallel_size=tensor_model_parallel_size,
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
