# Shared settings of the Megatron-LM launch scripts (sourced). Override any variable from the environment.
: "${MEGATRON_LM:=${MEGATRON_LM_PATH:-}}"
: "${MEGATRON_LM:?set MEGATRON_LM (or MEGATRON_LM_PATH) to a Megatron-LM checkout (git clone https://github.com/NVIDIA/Megatron-LM)}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
export PYTHONPATH="$MEGATRON_LM:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1
GPUS=${GPUS:-8}
TP=${TP:-2}
CP=${CP:-4}
PP=${PP:-1}
BACKEND=${BACKEND:-triton}            # eager | triton | ascendc (spec NAME suffix follows it)
# allgather | p2p | grouped_allgather_p2p | recursive_doubling | ulysses | auto; unset: a --cp-comm-type you add
# decides, else the mixers' default (allgather; docs/cp.md, "Which CP method a layer runs")
CP_METHOD=${CP_METHOD:-}
CP_METHOD_ARGS=()
if [ -n "$CP_METHOD" ]; then CP_METHOD_ARGS=(--hp-cp-method "$CP_METHOD"); fi
SEQ=${SEQ:-32768}
DATA=${DATA:?set DATA to an indexed-dataset prefix (tools/preprocess_data.py output, without .bin/.idx)}
TOKENIZER=${TOKENIZER:?set TOKENIZER to a HuggingFace tokenizer directory or name}
CKPT=${CKPT:-checkpoints/$(basename "$0" .sh)}
ITERS=${ITERS:-10000}
WARMUP=${WARMUP:-$((ITERS / 50))}    # 200 for the default 10000 iterations; 0 below 50 (Megatron asserts warm-up < decay)
DTYPE=${DTYPE:-bf16}                  # bf16 | fp16 | fp32
case "$DTYPE" in
  bf16) DTYPE_ARGS=(--bf16);; fp16) DTYPE_ARGS=(--fp16);; fp32) DTYPE_ARGS=();;
  *) echo "DTYPE=$DTYPE: use bf16, fp16 or fp32" >&2; exit 2;;
esac
# Resume only from a checkpoint that exists (Megatron-LM's latest_checkpointed_iteration.txt is written last).
LOAD_ARGS=()
if [ -f "$CKPT/latest_checkpointed_iteration.txt" ]; then LOAD_ARGS=(--load "$CKPT"); fi
suffix() { case "$BACKEND" in eager) echo "";; *) echo "_$BACKEND";; esac; }
COMMON_ARGS=(
  --tensor-model-parallel-size "$TP" --context-parallel-size "$CP" --pipeline-model-parallel-size "$PP"
  --sequence-parallel --use-distributed-optimizer
  --seq-length "$SEQ" --max-position-embeddings "$SEQ"
  --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
  --attention-dropout 0 --hidden-dropout 0
  --micro-batch-size 1 --global-batch-size "${GBS:-64}" --train-iters "$ITERS"
  --lr "${LR:-3e-4}" --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters "$WARMUP" --clip-grad 1.0
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 "${DTYPE_ARGS[@]}"
  --data-path "$DATA" --split 99,1,0 --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER"
  --save "$CKPT" "${LOAD_ARGS[@]}" --save-interval "${SAVE_INTERVAL:-500}" --ckpt-format torch_dist
  --log-interval 1 --eval-interval 1000 --eval-iters 10
  --hp-backend "$BACKEND" "${CP_METHOD_ARGS[@]}" --hp-cp-layout zigzag
)
