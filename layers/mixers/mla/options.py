"""The MLA rows of the flag table (``layers.base.options.OptionRow``): the CP strategy, the dimensions (megatron-core's
``MLATransformerConfig`` names) and the rotary type. A leaf of the package: read without importing the layer."""
from __future__ import annotations

from layers.base.choices import MLA_CP_STRATEGY_CHOICES, ROPE_TYPES
from layers.base.options import OptionRow

MLA_ROWS = (
    OptionRow("--hp-mla-cp-strategy", "mla_cp_strategy", "cp_strategy", str, default="latent",
              choices=MLA_CP_STRATEGY_CHOICES, preset=True,
              help="context-parallel strategy of the MLA layers (auto: from the calibrated cost model)"),
    OptionRow("--hp-mla-q-lora-rank", "q_lora_rank", None, int, model=True, check="positive", preset=True,
              help="MLA query LoRA rank (None: no q down-proj)"),
    OptionRow("--hp-mla-kv-lora-rank", "kv_lora_rank", None, int, model=True, check="positive", preset=True,
              help="MLA KV latent rank (default max(hidden/2, 16))"),
    OptionRow("--hp-mla-qk-head-dim", "qk_head_dim", None, int, model=True, check="positive", preset=True,
              help="MLA no-rope q/k head dim"),
    OptionRow("--hp-mla-qk-pos-emb-head-dim", "qk_pos_emb_head_dim", None, int, model=True, check="positive",
              preset=True, help="MLA rope q/k head dim"),
    OptionRow("--hp-mla-v-head-dim", "v_head_dim", None, int, model=True, check="positive", preset=True,
              help="MLA value head dim"),
    OptionRow("--hp-mla-output-gate", "mla_output_gate", "output_gate", bool, model=True, optional=False, preset=True,
              help="MLA head-wise sigmoid output gate: o_h * sigmoid(linear_gate_proj(x))_h before linear_proj "
                   "(Ling 3.0's g_proj; one column-parallel [heads, hidden] projection)"),
    OptionRow("--hp-mla-rope-type", "rope_type", None, str, model=True, default="rope", choices=ROPE_TYPES,
              optional=False, preset=True, help="MLA rotary embedding (none = NoPE, as Kimi Linear's MLA layers)"),
)
