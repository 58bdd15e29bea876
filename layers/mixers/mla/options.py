"""The MLA rows of the flag table (``layers.base.options.OptionRow``): the CP strategy, the dimensions (megatron-core's
``MLATransformerConfig`` names) and the rotary type. A leaf of the package: read without importing the layer."""
from __future__ import annotations

from layers.base.choices import MLA_CP_STRATEGY_CHOICES, ROPE_TYPES
from layers.base.options import CommTypeRule, OptionRow

# The default when neither our option nor a cp_comm_type the user chose decides: latent works for every head count
# (the Ulysses strategies need heads % (TP x CP) == 0) and moves the compressed latent, not per-head K/V; auto would
# time candidates at the first forward. megatron's cp_comm_type -> our strategy: all_gather and p2p (a ring of
# per-head K/V, which we do not run) and a2a+p2p -> latent, a2a (heads all-to-all) -> expanded_ulysses.
DEFAULT_MLA_CP_STRATEGY = "latent"
MLA_CP_RULE = CommTypeRule((("p2p", "latent"), ("all_gather", "latent"), ("a2a", "expanded_ulysses"),
                            ("a2a+p2p", "latent")), DEFAULT_MLA_CP_STRATEGY)

MLA_ROWS = (
    OptionRow("--hp-mla-cp-strategy", "mla_cp_strategy", "cp_strategy", str, comm_type=MLA_CP_RULE,
              choices=MLA_CP_STRATEGY_CHOICES,
              help="context-parallel strategy of the MLA layers (not given: from a --cp-comm-type you give, a2a -> "
                   f"expanded_ulysses, p2p / all_gather / a2a+p2p -> latent; else {DEFAULT_MLA_CP_STRATEGY}; auto: "
                   "from the calibrated cost model)"),
    OptionRow("--hp-mla-q-lora-rank", "q_lora_rank", None, int, model=True, check="positive", preset=True,
              megatron_field=True, help="MLA query LoRA rank (None: no q down-proj)"),
    OptionRow("--hp-mla-kv-lora-rank", "kv_lora_rank", None, int, model=True, check="positive", preset=True,
              megatron_field=True, help="MLA KV latent rank (default max(hidden/2, 16))"),
    OptionRow("--hp-mla-qk-head-dim", "qk_head_dim", None, int, model=True, check="positive", preset=True,
              megatron_field=True, help="MLA no-rope q/k head dim"),
    OptionRow("--hp-mla-qk-pos-emb-head-dim", "qk_pos_emb_head_dim", None, int, model=True, check="positive",
              preset=True, megatron_field=True, help="MLA rope q/k head dim"),
    OptionRow("--hp-mla-v-head-dim", "v_head_dim", None, int, model=True, check="positive", preset=True,
              megatron_field=True, help="MLA value head dim"),
    OptionRow("--hp-mla-output-gate", "mla_output_gate", "output_gate", bool, model=True, optional=False, preset=True,
              help="MLA head-wise sigmoid output gate: o_h * sigmoid(linear_gate_proj(x))_h before linear_proj "
                   "(Ling 3.0's g_proj; one column-parallel [heads, hidden] projection)"),
    OptionRow("--hp-mla-rope-type", "rope_type", None, str, model=True, default="rope", choices=ROPE_TYPES,
              optional=False, preset=True, megatron_field=True,
              help="MLA rotary embedding (none = NoPE, as Kimi Linear's MLA layers)"),
)
