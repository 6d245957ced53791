#!/usr/bin/env bash
# Real sizes on one H200: random-weight models of real configs (benchmarks/vs_trl.py MODELS), ours against TRL in
# the same command on the same card wherever TRL runs (a TRL run that dies, e.g. out of memory, shows as "-" and
# its log tail is printed: that is a result). One part per call (each fits a device call's 10 minutes); start with
# `. benchmarks/gpu_setup.sh` (the carried wheels) and mind the 64 GB disk (an 8B model is 16 GB).
#   bash benchmarks/sizes_gpu.sh grpo512 MODEL  GRPO full fine-tuning, 8 prompts x G 8, 512 new tokens, defaults
#                                               otherwise (MODEL: qwen2.5-1.5b, qwen3-4b or llama3.1-8b)
#   bash benchmarks/sizes_gpu.sh grpo4k         Llama-3.1-8B, ~256-token prompts + 3,840 new tokens, ours at its
#                                               defaults (the memory plan sizes the micro-batch), --no-final-checkpoint
#   bash benchmarks/sizes_gpu.sh lora8b         the same 4K shape with --lora-r 16 (peak against grpo4k's)
#   bash benchmarks/sizes_gpu.sh dpo8b          DPO full fine-tuning at Llama-3.1-8B, ours against TRL
#   bash benchmarks/sizes_gpu.sh recapture      the decoder's graph re-capture check, then the 135M cold start
set -euo pipefail
export BENCH_TIMEOUT=${BENCH_TIMEOUT:-540}
case "${1:-}" in
grpo512)
  python3 -m benchmarks.grpo_vs_trl --models "${2:?MODEL}" --steps 4 --out /root/sizes ;;
grpo4k)
  python3 -m benchmarks.grpo_vs_trl --models llama3.1-8b --steps 3 --only ours --prompt-tokens 256 \
    --max-new-tokens 3840 --micro-batch-size 0 --no-gradient-checkpointing --ours-extra="--no-final-checkpoint" \
    --out /root/sizes ;;
lora8b)
  python3 -m benchmarks.grpo_vs_trl --models llama3.1-8b --steps 3 --only ours --prompt-tokens 256 \
    --max-new-tokens 3840 --micro-batch-size 0 --no-gradient-checkpointing \
    --ours-extra="--no-final-checkpoint --lora-r 16 --lora-alpha 32" --out /root/sizes-lora ;;
dpo8b)
  python3 -m benchmarks.dpo_vs_trl --models llama3.1-8b --steps 4 --batch-size 64 --micro-batch-size 8 \
    --ours-extra="--no-final-checkpoint" --out /root/sizes-dpo ;;
recapture)
  python3 -m benchmarks.recapture_check
  python3 -m benchmarks.cold_start --models 135m --runs 2 --steps 2 --out /root/cold ;;
*) sed -n 2,13p "$0"; exit 2 ;;
esac
