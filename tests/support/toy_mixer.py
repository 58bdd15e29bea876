"""A third-party mixer, registered from outside the library: no file of ``layers`` or ``hp_megatron`` names it.

``T`` (``toy_ema``): a causal exponential moving average over the tokens between a column-parallel input
projection and a row-parallel output projection::

    u = x W_in                  (per TP rank: its columns, [s, b, h / tp])
    y_t = d y_(t-1) + (1 - d) u_t,  y_(-1) = 0      (per channel, along the sequence, d = decay)
    out = y W_out               (row-parallel: summed over TP ranks)

Its one option ``decay`` is read from the keyword, else the config field ``toy_ema_decay``
(flag ``--hp-toy-ema-decay``, declared by its flag-table row; its argument-time check ``check_toy_args`` refuses a
decay outside (0, 1) before anything is built), else 0.9.

What it declares (``MixerSupport``; docs/architecture.md, "What each entry point asks of your mixer"): no
context parallelism (every entry point refuses ``--context-parallel-size`` > 1 before building it) and no packed
(THD) sequences; generation with a state cache (``decode``: megatron-core's ``StaticInferenceContext`` through
``layers.shared.inference``, the cache holding ``y_(t-1)`` per sequence and channel, fp32); multi-token prediction
(``mtp``: its spec's params carry the causal ``attn_mask_type`` megatron-core's MTP layer reads); the eager backend.
Importing this module registers it; ``--hp-mixer-module tests.support.toy_mixer`` does that in every entry point.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from hp_megatron.registry import MixerEntry, MixerSupport, register_mixer
from layers.base.options import OptionRow
from layers.shared.inference import inference_window, layer_cache, static_context

DEFAULT_DECAY = 0.9


@dataclass
class ToyEMASubmodules:
    in_proj: object = None
    out_proj: object = None


def ema_weights(seq: int, decay: float, dtype, device) -> torch.Tensor:
    """``[s, s]`` lower-triangular: ``y = W u`` is the causal EMA along the sequence (``W[t, j] = (1-d) d^(t-j)``)."""
    t = torch.arange(seq, device=device)
    lag = (t[:, None] - t[None, :]).to(dtype)
    w = (1 - decay) * torch.pow(torch.tensor(decay, dtype=dtype, device=device), lag.clamp(min=0))
    return torch.where(lag >= 0, w, torch.zeros((), dtype=dtype, device=device))


class ToyEMAMixer(MegatronModule):
    """``hidden_states [s, b, h]`` -> ``(out [s, b, h], bias or None)``; see the module docstring."""

    def __init__(self, config, submodules: ToyEMASubmodules, layer_number=None, pg_collection=None,
                 cp_comm_type=None, attn_mask_type=None, decay=None, **kwargs):
        super().__init__(config=config)
        decay = decay if decay is not None else getattr(config, "toy_ema_decay", None)
        self.decay = float(DEFAULT_DECAY if decay is None else decay)
        if not 0 < self.decay < 1:
            raise ValueError(f"ToyEMAMixer: decay must be in (0, 1), got {self.decay}")
        self.layer_number = layer_number
        hidden = config.hidden_size
        self.in_proj = build_module(submodules.in_proj, hidden, hidden, config=config, init_method=config.init_method,
                                    gather_output=False, bias=False, skip_bias_add=False, is_expert=False)
        self.out_proj = build_module(submodules.out_proj, hidden, hidden, config=config,
                                     init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
                                     skip_bias_add=True, is_expert=False)

    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, **kwargs):
        if packed_seq_params is not None:   # declared (thd=False) and refused by the entry points; never mis-read
            raise ValueError("ToyEMAMixer has no packed-sequence (THD) path (MixerSupport.thd is False)")
        context = static_context("ToyEMAMixer", self, inference_context, kwargs.get("inference_params"),
                                 cp_size=getattr(self.config, "context_parallel_size", 1) or 1,
                                 sequence_parallel=self.config.sequence_parallel, packed_seq_params=packed_seq_params)
        u, _ = self.in_proj(hidden_states)                                    # [s, b, h / tp]
        if context is None:
            w = ema_weights(u.shape[0], self.decay, u.dtype, u.device)
            return self.out_proj(torch.einsum("ts,sbh->tbh", w, u))
        return self.out_proj(self._cached(u, context, attention_mask).to(u.dtype))

    def _cached(self, u, context, attention_mask):
        """``y [s, b, h / tp]`` of this forward under a static inference context, in fp32: the cached ``y_(t-1)``
        (zero at prefill, ``sequence_len_offset == 0``) carried in as ``d^(t+1) y_(-1)``, then the new last ``y``
        written back to this batch's cache rows. One token (a decode step) is the recurrence's one step."""
        rows, offset, seq, _ = inference_window("ToyEMAMixer", context, u, attention_mask)
        (state,) = layer_cache("ToyEMAMixer", context, self.layer_number,
                               [((context.max_batch_size, u.shape[-1]), torch.float32, u.device)])
        u = u.float()
        y = torch.einsum("ts,sbh->tbh", ema_weights(seq, self.decay, torch.float32, u.device), u)
        if offset > 0:
            carry = torch.pow(torch.tensor(self.decay, dtype=torch.float32, device=u.device),
                              torch.arange(1, seq + 1, device=u.device, dtype=torch.float32))
            y = y + carry[:, None, None] * state[rows][None]
        state[rows] = y[-1].detach()
        return y


def toy_spec(provider, *, qk_layernorm=False, cp_layout=None) -> ModuleSpec:
    """The ``self_attention`` spec: the provider's column-parallel in and row-parallel out projections."""
    return ModuleSpec(module=ToyEMAMixer, params={"attn_mask_type": AttnMaskType.causal},   # read by megatron's MTP
                      submodules=ToyEMASubmodules(in_proj=provider.column_parallel_linear(),
                                                  out_proj=provider.row_parallel_linear()))


def check_toy_args(args) -> None:
    """The toy's own argument-time check (``MixerEntry.check_args``): its decay in (0, 1), which the flag row's
    ``positive`` check alone does not say."""
    decay = getattr(args, "hp_toy_ema_decay", None)
    if decay is not None and not 0 < decay < 1:
        raise ValueError(f"--hp-toy-ema-decay {decay} must be in (0, 1) (y_t = d y_(t-1) + (1 - d) u_t)")


TOY = register_mixer(MixerEntry(
    symbol="T", name="toy_ema", title="toy EMA", spec=toy_spec, module="tests.support.toy_mixer:ToyEMAMixer",
    family="toy", supports=MixerSupport(cp_methods=(), thd=False, decode=True, mtp=True, backends=("eager",)),
    check_args=check_toy_args,
    options=(OptionRow("--hp-toy-ema-decay", "toy_ema_decay", keyword="decay", type=float, model=True,
                       default=DEFAULT_DECAY, check="positive",
                       help="decay d of the toy EMA mixer: y_t = d y_(t-1) + (1 - d) u_t"),)))
