"""What a training loop logs of its MoE layers, from megatron-core's own bookkeeping:

  :func:`load_balancing_losses`  the routers' auxiliary losses of the last global batch, as Megatron-LM's
                                 ``training_log`` reports them (megatron-core's aux-loss tracker reduced by
                                 ``track_moe_metrics``: mean over MoE layers and micro-batches, over the
                                 pipeline stages and the data-parallel ranks)
  :class:`ExpertBiasChange`      the step the routers' expert bias (aux-loss-free balancing,
                                 ``moe_router_enable_expert_bias``) took at the last optimizer step: megatron-core
                                 updates it in ``finalize_model_grads`` by ``sign(mean load - expert load) x
                                 moe_router_bias_update_rate``; the mean |change| over experts and MoE layers of
                                 every pipeline stage (0 when every expert got exactly the mean load)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# megatron-core's load-balancing types -> the names its routers track their losses under (Megatron-LM's log keys)
TRACK_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
               "global_aux_loss": "global_load_balancing_loss"}


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _balancing_types(config) -> list:
    types = config.moe_router_load_balancing_type
    return [types] if isinstance(types, str) else list(types)


def load_balancing_losses(config, num_microbatches: int) -> dict:
    """``{Megatron-LM log key: value}`` of the last global batch's non-zero load-balancing (and z-) losses, then
    the tracker is cleared; ``{}`` for a model without experts. Call it on every rank after the forward-backward step (it
    reduces over the pipeline and data-parallel groups)."""
    if not getattr(config, "num_moe_experts", None):
        return {}
    from megatron.core.transformer.moe.moe_utils import track_moe_metrics

    names = [TRACK_NAMES[t] for t in _balancing_types(config) if t in TRACK_NAMES]
    if config.moe_z_loss_coeff is not None:
        names.append("z_loss")
    if not names:
        return {}
    totals = {}
    track_moe_metrics(loss_scale=1.0 / num_microbatches, iteration=0, total_loss_dict=totals, force_initialize=True,
                      track_names=names, num_layers=config.num_layers, moe_layer_freq=config.moe_layer_freq,
                      mtp_num_layers=config.mtp_num_layers)
    return {name: float(value) for name, value in totals.items() if value > 0}  # Megatron-LM logs the non-zero


class ExpertBiasChange:
    """Measure the expert-bias update of one training step: :meth:`before_step` (before the forward-backward
    step, whose ``finalize_model_grads`` updates the bias) snapshots the biases of this rank's routers,
    :meth:`after_step` returns the mean |change| over the MoE layers of all pipeline stages (None when the model
    has no expert bias). Both on every rank."""

    def __init__(self, model_chunks):
        self.biases = [m.expert_bias for chunk in model_chunks for m in chunk.modules()
                       if getattr(m, "expert_bias", None) is not None]
        self.enabled = bool(self.biases) or self._any_rank_has_bias()
        self._before = None

    def _any_rank_has_bias(self) -> bool:
        from megatron.core import parallel_state

        flag = torch.tensor([float(bool(self.biases))], device=_device())
        dist.all_reduce(flag, group=parallel_state.get_pipeline_model_parallel_group())
        return bool(flag.item())

    def before_step(self) -> None:
        if self.enabled:
            self._before = [b.detach().clone() for b in self.biases]

    def after_step(self):
        if not self.enabled:
            return None
        from megatron.core import parallel_state

        total = torch.zeros(2, dtype=torch.float64, device=_device())  # sum |change|, entries
        for bias, before in zip(self.biases, self._before):
            total[0] += (bias.detach() - before).abs().double().sum()
            total[1] += bias.numel()
        dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
        return float(total[0] / total[1])
