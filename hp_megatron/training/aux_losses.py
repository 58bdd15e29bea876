"""What a training loop logs beside the lm loss, from megatron-core's own bookkeeping (:class:`AuxLossLog`):

* the routers' load-balancing losses of the global batch, as Megatron-LM's ``training_log`` reports them:
  megatron-core's aux-loss tracker reduced by ``track_moe_metrics`` (mean over MoE layers and micro-batches,
  summed over the pipeline stages, averaged over the data-parallel ranks), under Megatron-LM's keys
  (``load_balancing_loss``, ``seq_load_balancing_loss``, ``global_load_balancing_loss``, ``z_loss``); like
  Megatron-LM, only the non-zero ones;
* ``expert bias update``: the step the routers' expert bias (aux-loss-free balancing,
  ``moe_router_enable_expert_bias``) took in the step's ``finalize_model_grads``, which megatron-core updates by
  ``sign(mean load - expert load) x moe_router_bias_update_rate`` from the loads all-reduced over TP x CP x DP:
  the mean |change| over the experts of every MoE layer of every pipeline stage (the rate when no expert got
  exactly the mean load);
* the multi-token-prediction loss per depth (``mtp_1 loss``, ...), as Megatron-LM logs it: megatron-core's
  ``MTPLossLoggingHelper.track_mtp_metrics`` (the token mean of each depth, averaged over micro-batches and
  data-parallel ranks; on the last pipeline stage, where the MTP block is);
* the DSA indexer loss (``indexer loss``, with ``dsa_indexer_loss_coeff`` > 0), as Megatron-LM logs it: megatron-core's
  ``DSAIndexerLossLoggingHelper.track_indexer_metrics`` (the coefficient-scaled KL summed over the layers and divided
  by their number, averaged over micro-batches and data-parallel ranks, summed over the pipeline stages).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# megatron-core's load-balancing types -> the names its routers track their losses under (Megatron-LM's log keys)
TRACK_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
               "global_aux_loss": "global_load_balancing_loss"}


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def track_names(config) -> list:
    """The tracker names of ``config``'s load-balancing types (and ``z_loss``), as Megatron-LM selects them."""
    types = config.moe_router_load_balancing_type
    names = [TRACK_NAMES[t] for t in ([types] if isinstance(types, str) else types) if t in TRACK_NAMES]
    return names + (["z_loss"] if config.moe_z_loss_coeff is not None else [])


class AuxLossLog:
    """The MoE and MTP entries of a training loop's iteration line. Build it on every rank after the model (it
    clears megatron-core's aux-loss and MTP trackers, which a previous run in this process may have left bound to
    destroyed groups); per iteration call :meth:`before_step` before the forward-backward step and
    :meth:`after_step` after it (both on every rank: they reduce over the pipeline and data-parallel groups)."""

    def __init__(self, model_chunks, config, num_microbatches: int):
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        get_moe_layer_wise_logging_tracker().clear()
        MTPLossLoggingHelper.tracker.clear()
        self.mtp = bool(getattr(config, "mtp_num_layers", None))
        self.config, self.num_microbatches = config, num_microbatches
        self.names = track_names(config) if getattr(config, "num_moe_experts", None) else []
        self.biases = [m.expert_bias for chunk in model_chunks for m in chunk.modules()
                       if getattr(m, "expert_bias", None) is not None]
        has_bias = torch.tensor([float(bool(self.biases))], device=_device())  # some stage may have no MoE layer
        dist.all_reduce(has_bias, group=parallel_state.get_pipeline_model_parallel_group())
        self.watch_bias = bool(has_bias.item())
        self._before = []
        self.indexer = bool(getattr(config, "dsa_indexer_loss_coeff", None))
        if self.indexer:   # every stage joins the tracker's reductions, also one without DSA layers
            from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper

            DSAIndexerLossLoggingHelper.tracker.clear()
            DSAIndexerLossLoggingHelper.tracker["values"] = torch.zeros(config.num_layers, device=_device())

    def before_step(self) -> None:
        if self.watch_bias:
            self._before = [b.detach().clone() for b in self.biases]

    def after_step(self) -> dict:
        """``{log key: value}``: the non-zero load-balancing losses, ``expert bias update``, then the MTP losses
        (on the last pipeline stage)."""
        out = {}
        if self.names:
            from megatron.core.transformer.moe.moe_utils import track_moe_metrics

            totals = {}
            track_moe_metrics(loss_scale=1.0 / self.num_microbatches, iteration=0, total_loss_dict=totals,
                              force_initialize=True, track_names=self.names, num_layers=self.config.num_layers,
                              moe_layer_freq=self.config.moe_layer_freq, mtp_num_layers=self.config.mtp_num_layers)
            out.update((name, float(value)) for name, value in totals.items() if value > 0)
        if self.watch_bias:
            from megatron.core import parallel_state

            total = torch.zeros(2, dtype=torch.float64, device=_device())  # sum of |change|, entries
            for bias, before in zip(self.biases, self._before):
                total[0] += (bias.detach() - before).abs().double().sum()
                total[1] += bias.numel()
            dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
            out["expert bias update"] = float(total[0] / total[1])
        if self.mtp:
            from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

            totals = {}
            MTPLossLoggingHelper.track_mtp_metrics(1.0 / self.num_microbatches, 0, None, total_loss_dict=totals)
            out.update((name, float(value)) for name, value in totals.items())
        if self.indexer:
            from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper

            totals = {}
            tracker = DSAIndexerLossLoggingHelper.tracker
            if "values" not in tracker:   # cleaned after the previous step's report
                tracker["values"] = torch.zeros(self.config.num_layers, device=_device())
            DSAIndexerLossLoggingHelper.track_indexer_metrics(1.0 / self.num_microbatches, 0, None,
                                                              total_loss_dict=totals)
            out.update((name, float(value)) for name, value in totals.items())
        return out
