"""The optimizer of a megatron-core training loop on any device.

megatron-core's ``get_megatron_optimizer`` allocates its gradient scaler and buffers on CUDA; on a CPU run
:func:`get_optimizer` returns :class:`TorchOptimizer` instead: ``torch.optim.AdamW`` with megatron's optimizer
interface and gradient-norm clipping semantics, driven by the same ``OptimizerConfig``.
"""
from __future__ import annotations

from itertools import chain

import torch
import torch.distributed as dist


def get_optimizer(config, model_chunks):
    """megatron-core's optimizer for ``config`` (``megatron.core.optimizer.OptimizerConfig``, ``optimizer="adam"``)
    over megatron DDP ``model_chunks`` on GPU; :class:`TorchOptimizer` with the same learning rate, weight decay,
    betas, eps and clipping on CPU. Both: ``step() -> (ok, grad norm, _)``, ``param_groups``, sharded state."""
    if config.optimizer != "adam":
        raise ValueError(f"get_optimizer supports optimizer='adam' (AdamW), got {config.optimizer!r}")
    if torch.cuda.is_available():
        from megatron.core.optimizer import get_megatron_optimizer

        return get_megatron_optimizer(config, list(model_chunks))
    return TorchOptimizer(model_chunks, lr=config.lr, weight_decay=config.weight_decay,
                          betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps, clip_grad=config.clip_grad)


class TorchOptimizer:
    """``torch.optim.AdamW`` over megatron DDP's ``main_grad`` buffers with megatron's optimizer interface
    (``step() -> (ok, grad_norm, None)``, ``param_groups``, ``sharded_state_dict``), for CPU runs.

    Gradient norm, as megatron-core's optimizers for dense and expert parameters together: L2 over parameters
    that are not tensor-parallel duplicates, the squares of dense parameters summed over the model-parallel group
    (TP x PP), those of expert parameters (``allreduce=False``, split over expert parallelism) over the expert
    group (expert TP x EP x PP); clipping scales all gradients by ``clip / (norm + 1e-6)`` when < 1.
    """

    def __init__(self, model_chunks, lr, weight_decay, betas, eps, clip_grad):
        decay, no_decay = [], []
        for chunk in model_chunks:
            for name, param in chunk.named_parameters():
                if param.requires_grad:
                    (no_decay if param.dim() == 1 or name.endswith(".bias") else decay).append(param)
        groups = [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
        self.clip_grad = clip_grad

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def _params(self):
        return list(chain.from_iterable(g["params"] for g in self.optimizer.param_groups))

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def grad_norm(self):
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        squares = {True: torch.zeros((), dtype=torch.float64), False: torch.zeros((), dtype=torch.float64)}
        expert_tp = parallel_state.get_expert_tensor_parallel_group()
        for p in self._params():
            expert = not getattr(p, "allreduce", True)
            if p.grad is None or not param_is_not_shared(p) or not param_is_not_tensor_parallel_duplicate(
                    p, expert_tp if expert else None):
                continue
            squares[expert] += p.grad.detach().double().pow(2).sum().cpu()
        dist.all_reduce(squares[False], group=parallel_state.get_model_parallel_group())
        dist.all_reduce(squares[True], group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
        return float((squares[False] + squares[True]).sqrt())

    def step(self):
        for p in self._params():
            p.grad = p.main_grad.to(p.dtype) if getattr(p, "main_grad", None) is not None else p.grad
        norm = self.grad_norm()
        if not torch.isfinite(torch.tensor(norm)):
            return False, norm, None
        if self.clip_grad and self.clip_grad > 0:
            coef = self.clip_grad / (norm + 1e-6)
            if coef < 1.0:
                for p in self._params():
                    if p.grad is not None:
                        p.grad.mul_(coef)
        self.optimizer.step()
        return True, norm, None

    def sharded_state_dict(self, model_sharded_state_dict, is_loading=False):
        from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                                optim_state_to_sharding_state)

        if is_loading:  # materialize Adam state so the template has every tensor to load into
            for p in self._params():
                state = self.optimizer.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state = self.optimizer.state_dict()
        steps = {float(s["step"]) for s in state["state"].values() if "step" in s}
        if len(steps) > 1:
            raise ValueError(f"parameters have different Adam step counts {sorted(steps)}")
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, self._params())
        optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
        state["common_step"] = steps.pop() if steps else 0.0
        return state

    def load_state_dict(self, state):
        step = state.pop("common_step")
        for param_state in state["state"].values():
            param_state["step"] = torch.tensor(float(step))
        self.optimizer.load_state_dict(state)
