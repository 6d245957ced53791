#!/usr/bin/env bash
# On a lent GPU: where the GRPO and DPO steps' time goes, at the vs-TRL harness shapes (random init), ours at its
# default flags. One `python -m benchmarks.profile_step` report per run (phases with their top kernels, op
# tables, Python's cumulative time), in $OUT (or /tmp/prof).
#   MODELS="135m 0.5b" STAGES="grpo dpo" bash benchmarks/profile_gpu.sh
# EXTRA (optional): more flags for every run.
set -uo pipefail
OUT=${OUT:-/tmp/prof}
mkdir -p "$OUT" /root/prof
for m in ${MODELS:-135m 0.5b}; do
  M=$(python -c "from benchmarks import vs_trl as V; from pathlib import Path; print(V.make_model('$m', Path('/root/prof')))")
  for s in ${STAGES:-grpo}; do
    if [ "$s" = grpo ]; then
      args=(grpo --eval-data "" --max-steps 6 --prompts-per-step 8 --num-generations 8 --max-new-tokens 512
            --micro-batch-size 16 --reward benchmarks/bench_reward.py:noise --temperature 1.0 --beta 0
            --num-iterations 1 --lr 5e-5 --gradient-checkpointing)
    else
      args=(dpo --eval-data "" --eval-samples 0 --max-steps 6 --batch-size 64 --micro-batch-size 16 --beta 0.1
            --loss sigmoid --max-length 256 --lr 5e-7)
    fi
    tag=$s-$m
    rm -rf "/root/prof/run-$tag"
    timeout ${LIMIT:-240} python -m benchmarks.profile_step --out "$OUT/$tag" --rows ${ROWS:-25} -- "${args[@]}" \
      --model "$M" --out "/root/prof/run-$tag" ${EXTRA:-} > "$OUT/$tag.log" 2>&1
    echo "=== $tag (rc $?)"
    grep -E "^(profiled|phase )" "$OUT/$tag/profile.txt" 2>/dev/null || tail -20 "$OUT/$tag.log"
    grep -o '"time/[a-z]*": [0-9.]*' "/root/prof/run-$tag/metrics.jsonl" 2>/dev/null | tail -4
  done
done
