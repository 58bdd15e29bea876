#!/usr/bin/env bash
# Qwen3-Next-like model as megatron-core's HybridModel, with Megatron-LM 0.19's pretrain_hybrid.py: GDN : attention
# = 3 : 1, each followed by its MLP layer ('-'), 48 HybridModel layers (24 mixers); our GDN in the 'G' slot.
#   MEGATRON_LM=~/Megatron-LM DATA=/data/my_text_document TOKENIZER=Qwen/Qwen3-Next-80B-A3B-Instruct \
#     bash examples/pretrain/megatron_lm/train_qwen3_next_like_hybrid.sh
set -euo pipefail
source "$(dirname "$0")/common.sh"
torchrun --nproc-per-node "$GPUS" "$HERE/pretrain_hybrid_hp.py" "${COMMON_ARGS[@]}" \
  --spec hp_megatron.specs "hybrid_stack$(suffix)_spec" \
  --hybrid-layer-pattern "$(printf 'G-G-G-*-%.0s' {1..6})" \
  --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 \
  --group-query-attention --num-query-groups 2 --kv-channels 256 \
  --position-embedding-type rope --rotary-base 10000000 \
  --hp-linear-num-key-heads 16 --hp-linear-num-value-heads 32 --hp-linear-key-head-dim 128 \
  --hp-linear-value-head-dim 128 --hp-linear-conv-kernel-dim 4 "$@"
