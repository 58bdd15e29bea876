"""A third-party mixer, registered from outside the library: no file of ``layers`` or ``hp_megatron`` names it.

``T`` (``toy_ema``): a causal exponential moving average over the tokens between a column-parallel input
projection and a row-parallel output projection::

    u = x W_in                  (per TP rank: its columns, [s, b, h / tp])
    y_t = d y_(t-1) + (1 - d) u_t,  y_(-1) = 0      (per channel, along the sequence, d = decay)
    out = y W_out               (row-parallel: summed over TP ranks)

Its one option ``decay`` is read from the keyword, else the config field ``toy_ema_decay``
(flag ``--hp-toy-ema-decay``, declared by its flag-table row), else 0.9. It has no context-parallel, packed
(THD) or inference path and refuses them with a one-line ValueError. Importing this module registers it;
``--hp-mixer-module tests.support.toy_mixer`` does that in every entry point.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from hp_megatron.registry import MixerEntry, register_mixer
from layers.base.options import OptionRow

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
        cp = getattr(config, "context_parallel_size", 1) or 1
        if cp > 1:
            raise ValueError(f"ToyEMAMixer has no context-parallel implementation; got context_parallel_size={cp}")
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
        if packed_seq_params is not None or inference_context is not None or kwargs.get("inference_params"):
            raise ValueError("ToyEMAMixer has no packed-sequence (THD) or inference path")
        u, _ = self.in_proj(hidden_states)                                    # [s, b, h / tp]
        w = ema_weights(u.shape[0], self.decay, u.dtype, u.device)
        y = torch.einsum("ts,sbh->tbh", w, u)
        return self.out_proj(y)


def toy_spec(provider, *, qk_layernorm=False, cp_layout=None) -> ModuleSpec:
    """The ``self_attention`` spec: the provider's column-parallel in and row-parallel out projections."""
    return ModuleSpec(module=ToyEMAMixer, submodules=ToyEMASubmodules(in_proj=provider.column_parallel_linear(),
                                                                      out_proj=provider.row_parallel_linear()))


TOY = register_mixer(MixerEntry(
    symbol="T", name="toy_ema", title="toy EMA", spec=toy_spec, module="tests.support.toy_mixer:ToyEMAMixer",
    family="toy", options=(OptionRow("--hp-toy-ema-decay", "toy_ema_decay", keyword="decay", type=float, model=True,
                                     default=DEFAULT_DECAY, check="positive",
                                     help="decay d of the toy EMA mixer: y_t = d y_(t-1) + (1 - d) u_t"),)))
