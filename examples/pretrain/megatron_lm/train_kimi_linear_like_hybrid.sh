#!/usr/bin/env bash
# Kimi-Linear-like model as megatron-core's HybridModel, with Megatron-LM 0.19's pretrain_hybrid.py: KDA : MLA
# = 3 : 1 (MLA without RoPE), each followed by its MLP layer ('-'), 48 HybridModel layers. HybridModel has no KDA
# symbol: under kda_hybrid_stack_spec the 'G' slot is our KDA; '+' is our MLA (Megatron-LM's MLA dim flags).
#   MEGATRON_LM=~/Megatron-LM DATA=/data/my_text_document TOKENIZER=moonshotai/Kimi-Linear-48B-A3B-Instruct \
#     bash examples/pretrain/megatron_lm/train_kimi_linear_like_hybrid.sh
set -euo pipefail
source "$(dirname "$0")/common.sh"
torchrun --nproc-per-node "$GPUS" "$HERE/pretrain_hybrid_hp.py" "${COMMON_ARGS[@]}" \
  --spec hp_megatron.specs "kda_hybrid_stack$(suffix)_spec" \
  --hybrid-layer-pattern "$(printf 'G-G-G-+-%.0s' {1..6})" \
  --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 \
  --position-embedding-type none \
  --hp-linear-num-key-heads 16 --hp-linear-key-head-dim 128 --hp-linear-value-head-dim 128 \
  --hp-linear-conv-kernel-dim 4 \
  --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 \
  --hp-mla-rope-type none "$@"
