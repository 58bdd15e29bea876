"""Checkpoints of the example in Megatron-LM's conventions: ``<dir>/iter_XXXXXXX`` in megatron-core's
``dist_checkpointing`` format plus the ``latest_checkpointed_iteration.txt`` tracker (the layout:
``hp_megatron.checkpoint``).

* ``--load DIR`` loads when DIR holds a checkpoint and starts from scratch (saying so) when it does not,
  so ``--save X --load X`` works on the first run as in Megatron-LM.
* A checkpoint the tracker points to is checked before the collective load: a missing directory,
  metadata file or shard, or a shard shorter than its metadata says, is named in a ValueError raised
  on every rank (all ranks read the same small metadata file).
* The LR schedule on resume follows Megatron-LM: ``--override-opt_param-scheduler`` takes the flags',
  ``--use-checkpoint-opt_param-scheduler`` the checkpoint's; with neither, the checkpoint's is kept and
  rank 0 warns when the flags differ.
"""
from __future__ import annotations

import os

import torch.distributed as dist

from hp_megatron.checkpoint import (RELEASE, TRACKER, find_checkpoint, iteration_directory, verify_checkpoint_files,
                                    write_tracker)

CHECKPOINT_VERSION = 1
# OptimizerParamScheduler.state_dict() entries that the flags determine (num_steps is progress)
SCHEDULE_KEYS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "start_wd", "end_wd",
                 "wd_incr_steps", "wd_incr_style")


def _model_sharded_state_dict(model):
    """The DDP-wrapped model's sharded state dict; the metadata names the data x context parallel group, which
    megatron-core reads where a stage holds a tied copy of a tensor (the MTP stage's word embedding)."""
    from megatron.core import parallel_state

    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    return model.module.sharded_state_dict(metadata=metadata)


def _make_dir_on_rank0(path):
    """Rank 0 creates ``path``; every rank raises (OSError naming it) if that failed, instead of waiting."""
    import torch

    error = None
    if dist.get_rank() == 0:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            error = exc
    failed = torch.tensor([0 if error is None else 1],
                          device=f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(failed)
    if int(failed):
        raise OSError(f"cannot create the checkpoint directory {path}"
                      + (f": {error}" if error is not None else " (see rank 0)"))


def save_checkpoint(root, iteration, consumed, model, optimizer, scheduler, model_description=None):
    """Write ``<root>/iter_XXXXXXX`` and the tracker; returns the checkpoint directory. ``model_description``
    (a plain dict: ``{"hp_model_args": ...}`` or ``{"hf_config": ...}``) goes into the common state, as
    Megatron-LM stores its ``args``: what rebuilds the model (``python -m hp_megatron.generate``); loading for
    training does not read it, so checkpoints without it load alike."""
    from megatron.core import dist_checkpointing

    path = iteration_directory(root, iteration)
    _make_dir_on_rank0(path)
    model_sd = _model_sharded_state_dict(model)
    state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=False),
             "opt_param_scheduler": scheduler.state_dict(), "iteration": iteration,
             "consumed_samples": consumed, "checkpoint_version": CHECKPOINT_VERSION, **(model_description or {})}
    dist_checkpointing.save(state, path)
    dist.barrier()
    if dist.get_rank() == 0:
        write_tracker(root, iteration)
        print(f"saved checkpoint at iteration {iteration} to {path}", flush=True)
    dist.barrier()
    return path


def schedule_differences(checkpoint_schedule: dict, flags_schedule: dict) -> dict:
    """``{key: (checkpoint value, flags value)}`` for the schedule entries that differ (the weight-decay
    ramp length only when the weight decay changes over it)."""
    keys = [k for k in SCHEDULE_KEYS if k != "wd_incr_steps" or flags_schedule["start_wd"] != flags_schedule["end_wd"]]
    return {k: (checkpoint_schedule.get(k), flags_schedule[k]) for k in keys
            if k in flags_schedule and checkpoint_schedule.get(k) != flags_schedule[k]}


def load_checkpoint(path, model, optimizer, scheduler, warn_schedule=True):
    """Load ``path`` (``hp_megatron.checkpoint.find_checkpoint``) into model, optimizer and scheduler.

    Returns ``(iteration, consumed samples)``. ``scheduler`` (megatron-core's ``OptimizerParamScheduler``)
    was built with Megatron-LM's ``override_opt_param_scheduler`` choice, which decides whose schedule
    wins; ``warn_schedule``: rank 0 warns when the checkpoint's schedule is kept and differs from the flags.
    """
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    verify_checkpoint_files(path)
    model_sd = _model_sharded_state_dict(model)
    release = os.path.basename(os.path.normpath(path)) == RELEASE  # weights only: training starts at 0
    template = {"model": model_sd}
    if not release:
        template["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True)
    try:
        state = dist_checkpointing.load(template, path)
    except (Exception, CheckpointException) as exc:
        if isinstance(exc, CheckpointException):  # (exception, traceback) per failing rank
            exc = next(iter(exc.failures.values()))[0]
        raise ValueError(f"checkpoint {path} could not be loaded: {type(exc).__name__}: {exc}") from None
    model.module.load_state_dict(state["model"])
    if release:
        if dist.get_rank() == 0:
            print(f"loaded release checkpoint {path} (weights only, iteration 0)", flush=True)
        return 0, 0
    optimizer.load_state_dict(state["optimizer"])
    saved_schedule = state["opt_param_scheduler"]
    differences = schedule_differences(saved_schedule, scheduler.state_dict())
    scheduler.load_state_dict(saved_schedule)
    if dist.get_rank() == 0:
        print(f"loaded checkpoint {path} (iteration {state['iteration']}, {state['consumed_samples']} samples)",
              flush=True)
        if differences and warn_schedule and not scheduler.override_opt_param_scheduler:
            text = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in differences.items())
            print(f"WARNING: the flags' LR schedule differs from the checkpoint's ({text}); keeping the "
                  "checkpoint's. Pass --override-opt_param-scheduler to use the flags' schedule or "
                  "--use-checkpoint-opt_param-scheduler to keep the checkpoint's silently.", flush=True)
    return state["iteration"], state["consumed_samples"]


def resume(args, model, optimizer, scheduler):
    """``--load``: ``(iteration, consumed samples)`` of the checkpoint loaded into model, optimizer and scheduler;
    ``(0, 0)`` without ``--load`` or, saying so, when the directory holds no checkpoint yet."""
    found = find_checkpoint(args.load) if args.load else None
    if found is None:
        if args.load and dist.get_rank() == 0:
            print(f"no checkpoint in {args.load} (no {TRACKER}); training from scratch", flush=True)
        return 0, 0
    return load_checkpoint(found, model, optimizer, scheduler,
                           warn_schedule=not args.use_checkpoint_opt_param_scheduler)
