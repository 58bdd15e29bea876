"""Per-iteration numbers of Megatron-LM's training loop at full precision (test infrastructure).

Megatron-LM prints the gradient norm with three decimals; the tests compare it at 1e-5 relative. With
``HP_MEGATRON_LM_RECORD_DIR`` set, :func:`install` wraps ``megatron.training.training.training_log`` (called
once per iteration on every rank) so that the last rank, the one that prints the log line, appends
``{"iteration": i, "lm loss": ..., "grad_norm": ...}`` to ``$HP_MEGATRON_LM_RECORD_DIR/train.jsonl``.
"""
from __future__ import annotations

import functools
import json
import os

from import_hook import run_after

RECORD_FILE = "train.jsonl"


def _wrap_training_log(module) -> None:
    import torch.distributed as dist

    training_log = module.training_log
    path = os.path.join(os.environ["HP_MEGATRON_LM_RECORD_DIR"], RECORD_FILE)

    @functools.wraps(training_log)
    def recorded_training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                              report_memory_flag, skipped_iter, grad_norm, *args, **kwargs):
        if dist.get_rank() == dist.get_world_size() - 1:
            entry = {"iteration": int(iteration), "grad_norm": None if grad_norm is None else float(grad_norm)}
            entry.update({key: float(value) for key, value in loss_dict.items()})
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
        return training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                            report_memory_flag, skipped_iter, grad_norm, *args, **kwargs)

    module.training_log = recorded_training_log


def install() -> None:
    """Arm the recorder when ``HP_MEGATRON_LM_RECORD_DIR`` is set."""
    if os.environ.get("HP_MEGATRON_LM_RECORD_DIR"):
        run_after("megatron.training.training", _wrap_training_log)
