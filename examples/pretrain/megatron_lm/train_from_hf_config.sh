#!/usr/bin/env bash
# A Hugging Face architecture (Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid, Ling 3.0, Qwen3-Next, Kimi Linear, DeepSeek-V3...:
# hp_megatron.models.ARCHITECTURES) with Megatron-LM 0.19's pretrain_gpt.py: the model and its dims from HF_CONFIG's
# config.json (--hp-hf-config), its weights from a checkpoint converted by hp_megatron.convert (CKPT).
#   python -m hp_megatron.convert hf-to-mcore --load /models/Qwen3.5-35B-A3B --save /ckpt/qwen3_5_moe --drop-unmodeled
#   MEGATRON_LM=~/Megatron-LM DATA=/data/my_text_document TOKENIZER=/models/Qwen3.5-35B-A3B \
#     HF_CONFIG=/models/Qwen3.5-35B-A3B CKPT=/ckpt/qwen3_5_moe \
#     bash examples/pretrain/megatron_lm/train_from_hf_config.sh
# Add the layout's flags (--expert-model-parallel-size ...) after the script's name; a model flag given there with
# another value than the config's is refused.
set -euo pipefail
source "$(dirname "$0")/common.sh"
HF_CONFIG=${HF_CONFIG:?set HF_CONFIG to the Hugging Face model directory (its config.json)}
torchrun --nproc-per-node "$GPUS" "$HERE/pretrain_gpt_hp.py" "${COMMON_ARGS[@]}" \
  --hp-hf-config "$HF_CONFIG" "$@"
