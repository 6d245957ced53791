#!/usr/bin/env bash
# LoRA against full fine-tuning on a lent machine with 2 GPUs, the two runs side by side (one per GPU; each
# process sees one GPU, so peaks and learning are per run; timings share the host's CPUs).
#   bash benchmarks/lora_gpu.sh memory   GRPO harness, 0.5B shape (random init), ours at its defaults against
#                                        the same with --lora-r 16 --lora-alpha 32: peak GPU memory, step phases
#   bash benchmarks/lora_gpu.sh real     SmolLM2-135M-Instruct (benchmarks/gpu_smollm2_setup.sh first), GRPO on
#                                        two-term arithmetic for STEPS (100) steps, full fine-tuning at lr 1e-5
#                                        (the real-model recipe) against LoRA at lr 1e-4 (10x: LoRA's usual
#                                        factor, set before any run): held-out greedy pass@1 before and after;
#                                        TOKENS: the completion cap (64)
# Logs and per-step metrics go to $OUT (or ./lora_gpu_out). With one GPU both runs share it (peaks and learning
# are still per run; timings are then contended).
set -euo pipefail
OUT=${OUT:-lora_gpu_out}; mkdir -p "$OUT"
G1=1; [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { G1=0; echo "one GPU: both runs share it"; }
LORA="--lora-r 16 --lora-alpha 32"
case "${1:-}" in
memory)
  CUDA_VISIBLE_DEVICES=0 python -m benchmarks.grpo_vs_trl --models 0.5b --steps "${STEPS:-4}" --only ours \
    --out /tmp/lora-mem-full > "$OUT/mem-full.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=$G1 python -m benchmarks.grpo_vs_trl --models 0.5b --steps "${STEPS:-4}" --only ours \
    --ours-extra="$LORA" --out /tmp/lora-mem-lora > "$OUT/mem-lora.log" 2>&1 || true
  wait || true
  for r in full lora; do cp /tmp/lora-mem-$r/ours-0.5b-n1/metrics.jsonl "$OUT/mem-$r-metrics.jsonl" || true; done
  for r in full lora; do echo "== $r"; grep -A14 "^### GRPO" "$OUT/mem-$r.log" || tail -20 "$OUT/mem-$r.log"; done ;;
real)
  P=(--param min_terms=2 --param max_terms=2 --param max_digits=2 --param "operators=['+','-']"
     --param allow_parentheses=false --param allow_negation=false)
  common=(--model /root/smollm2 --seeds 0 --steps "${STEPS:-100}" --verifier math "${P[@]}")
  tail=(--max-new-tokens "${TOKENS:-64}" --eval-k 1 --eval-every 50)
  CUDA_VISIBLE_DEVICES=0 python -m benchmarks.real_model "${common[@]}" --out /tmp/real-full -- --lr 1e-5 \
    "${tail[@]}" > "$OUT/real-full.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=$G1 python -m benchmarks.real_model "${common[@]}" --out /tmp/real-lora -- --lr 1e-4 $LORA \
    "${tail[@]}" > "$OUT/real-lora.log" 2>&1 || true
  wait || true
  for r in full lora; do
    cp /tmp/real-$r/seed0/metrics.jsonl "$OUT/real-$r-metrics.jsonl" 2>/dev/null || true
    cp /tmp/real-$r/summary.json "$OUT/real-$r-summary.json" 2>/dev/null || true
    echo "== $r"; grep -E "^\||pass@1 gain|Error|error:" "$OUT/real-$r.log" | tail -12
  done ;;
*) echo "usage: bash benchmarks/lora_gpu.sh memory|real" >&2; exit 2 ;;
esac
