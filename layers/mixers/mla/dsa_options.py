"""The DSA rows of the flag table (``layers.base.options.OptionRow``): the indexer's shape, its top-k and sharing
schedule and its loss, each setting megatron-core 0.19's own ``TransformerConfig`` field of the same name
(``dsa_indexer_*``; the flags are those fields' Megatron-LM flags with our ``--hp-`` prefix, as the MLA rows). The MLA
rows (``layers.mixers.mla.options``) set the attention's dimensions. A leaf: read without importing the layer."""
from __future__ import annotations

from layers.base.options import OptionRow

DSA_ROWS = (
    OptionRow("--hp-dsa-indexer-n-heads", "dsa_indexer_n_heads", None, int, model=True, check="positive", preset=True,
              megatron_field=True, help="DSA indexer heads (DeepSeek-V3.2: 64, GLM-5: 32)"),
    OptionRow("--hp-dsa-indexer-head-dim", "dsa_indexer_head_dim", None, int, model=True, check="positive",
              preset=True, help="DSA indexer head dim (RoPE on its first qk_pos_emb_head_dim channels)",
              megatron_field=True),
    OptionRow("--hp-dsa-indexer-topk", "dsa_indexer_topk", None, int, model=True, check="positive", preset=True,
              megatron_field=True, help="tokens each query attends to (DeepSeek-V3.2 / GLM-5: 2048)"),
    OptionRow("--hp-dsa-indexer-topk-freq", "dsa_indexer_topk_freq", None, int, model=True, default=1,
              check="positive", optional=False, preset=True,
              help="1: every DSA layer runs its indexer; N > 1: one in N does, the others reuse its top-k (GLM-5)",
              megatron_field=True),
    OptionRow("--hp-dsa-indexer-skip-topk-offset", "dsa_indexer_skip_topk_offset", None, int, model=True, default=0,
              check="non_negative", optional=False, preset=True,
              help="layers before the top-k sharing schedule starts (megatron-core's rule)", megatron_field=True),
    OptionRow("--hp-dsa-indexer-rope-interleaved", "dsa_indexer_rope_interleaved", None, bool, model=True,
              preset=True, help="indexer RoPE on interleaved pairs (GLM-5); default half-split (DeepSeek-V3.2)",
              megatron_field=True),
    OptionRow("--hp-dsa-indexer-k-norm-epsilon", "dsa_indexer_k_norm_epsilon", None, float, model=True,
              check="positive", preset=True, help="eps of the indexer key LayerNorm (None: --norm-epsilon)",
              megatron_field=True),
    OptionRow("--hp-dsa-indexer-loss-coeff", "dsa_indexer_loss_coeff", None, float, check="non_negative",
              help="weight of the indexer KL loss (None/0: the indexer gets no gradient)", megatron_field=True),
    OptionRow("--hp-dsa-indexer-use-sparse-loss", "dsa_indexer_use_sparse_loss", None, bool,
              help="indexer loss over the selected tokens (the sparse stage); default: over every visible token "
                   "(the dense warm-up)", megatron_field=True),
)
