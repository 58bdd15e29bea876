#!/usr/bin/env bash
# Kimi-Linear-like model (KDA : MLA = 3 : 1, MLA without RoPE) with Megatron-LM's pretrain_gpt.py.
#   MEGATRON_LM=~/Megatron-LM DATA=/data/my_text_document TOKENIZER=moonshotai/Kimi-Linear-48B-A3B-Instruct \
#     bash examples/pretrain/megatron_lm/train_kimi_linear_like.sh
set -euo pipefail
source "$(dirname "$0")/common.sh"
torchrun --nproc-per-node "$GPUS" "$HERE/pretrain_gpt_hp.py" "${COMMON_ARGS[@]}" \
  --spec hp_megatron.specs "kimi_linear$(suffix)_spec" \
  --num-layers 24 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 \
  --position-embedding-type none \
  --hp-linear-num-key-heads 16 --hp-linear-key-head-dim 128 --hp-linear-value-head-dim 128 \
  --hp-linear-conv-kernel-dim 4 \
  --hp-mla-kv-lora-rank 512 --hp-mla-qk-head-dim 128 --hp-mla-qk-pos-emb-head-dim 64 \
  --hp-mla-v-head-dim 128 --hp-mla-rope-type none "$@"
