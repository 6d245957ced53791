#!/usr/bin/env bash
# On a lent GPU: what holds the memory at the GRPO and DPO peaks, at the vs-TRL harness' 0.5B shape (random init),
# one `python -m benchmarks.memory_peak` table per run, under each precision named in PRECISIONS.
#   PRECISIONS="bf16-pure bf16-mixed" STAGES="grpo dpo" MODELS="0.5b" bash benchmarks/memory_gpu.sh
# EXTRA (optional): more flags for every run. Tables land in $OUT (or /tmp/mem).
set -uo pipefail
OUT=${OUT:-/tmp/mem}
mkdir -p "$OUT" /root/mem
for m in ${MODELS:-0.5b}; do
  M=$(python -c "from benchmarks import vs_trl as V; from pathlib import Path; print(V.make_model('$m', Path('/root/mem')))")
  for p in ${PRECISIONS:-bf16-pure}; do
    for s in ${STAGES:-grpo dpo}; do
      if [ "$s" = grpo ]; then
        args=(grpo --eval-data "" --max-steps 3 --prompts-per-step 8 --num-generations 8 --max-new-tokens 512
              --micro-batch-size 16 --reward benchmarks/bench_reward.py:noise --temperature 1.0 --beta 0
              --num-iterations 1 --lr 5e-5 --gradient-checkpointing)
      else
        args=(dpo --eval-data "" --eval-samples 0 --max-steps 3 --batch-size 64 --micro-batch-size 16 --beta 0.1
              --loss sigmoid --max-length 256 --lr 5e-7)
      fi
      tag=$s-$m-$p
      rm -rf "/root/mem/run-$tag"
      python -m benchmarks.memory_peak --out "$OUT/$tag" -- "${args[@]}" --model "$M" --out "/root/mem/run-$tag" \
        --precision "$p" ${EXTRA:-} > "$OUT/$tag.log" 2>&1
      echo "=== $tag (rc $?)"; cat "$OUT/$tag/memory_peak.txt" 2>/dev/null || tail -20 "$OUT/$tag.log"
      grep -o '"memory/[a-z]*": [0-9.]*' "/root/mem/run-$tag/metrics.jsonl" 2>/dev/null | tail -4
    done
  done
done
