#!/usr/bin/env bash
# On a lent GPU, at the vs-TRL harness shapes (random init), one report per run, in $OUT (or /tmp/mem):
#   TOOL=memory_peak (default): what holds the memory at the GRPO and DPO peaks (benchmarks.memory_peak);
#   TOOL=profile_step: where the step's time goes, each phase with its top kernels (benchmarks.profile_step).
#   PRECISIONS="bf16-pure bf16-mixed" STAGES="grpo dpo" MODELS="0.5b" bash benchmarks/memory_gpu.sh
# PRECISIONS "auto" runs ours at its default flags. EXTRA (optional): more flags for every run; STEPS: steps per run
# (default 6); TOOL_ARGS: flags for the tool (e.g. "--warmup 4" with STEPS=8); LIMIT: seconds
# per run; TAG: a suffix for this invocation's run names (several side by side).
set -uo pipefail
OUT=${OUT:-/tmp/mem}
TOOL=${TOOL:-memory_peak}
mkdir -p "$OUT" /root/mem
for m in ${MODELS:-0.5b}; do
  M=$(python -c "from benchmarks import vs_trl as V; from pathlib import Path; print(V.make_model('$m', Path('/root/mem')))")
  for p in ${PRECISIONS:-bf16-pure}; do
    for s in ${STAGES:-grpo dpo}; do
      if [ "$s" = grpo ]; then
        args=(grpo --eval-data "" --max-steps ${STEPS:-6} --prompts-per-step 8 --num-generations 8 --max-new-tokens 512
              --micro-batch-size 16 --reward benchmarks/bench_reward.py:noise --temperature 1.0 --beta 0
              --num-iterations 1 --lr 5e-5 --gradient-checkpointing)
      else
        args=(dpo --eval-data "" --eval-samples 0 --max-steps ${STEPS:-6} --batch-size 64 --micro-batch-size 16 --beta 0.1
              --loss sigmoid --max-length 256 --lr 5e-7)
      fi
      tag=$s-$m-$p${TAG:-}
      rm -rf "/root/mem/run-$tag"
      timeout "${LIMIT:-300}" python -m "benchmarks.$TOOL" ${TOOL_ARGS:-} --out "$OUT/$tag" -- "${args[@]}" --model "$M" \
        --out "/root/mem/run-$tag" --precision "$p" ${EXTRA:-} > "$OUT/$tag.log" 2>&1
      echo "=== $TOOL $tag (rc $?)"
      if [ "$TOOL" = profile_step ]; then
        grep -E "^(profiled|phase )" "$OUT/$tag/profile.txt" 2>/dev/null || tail -20 "$OUT/$tag.log"
      else
        cat "$OUT/$tag/memory_peak.txt" 2>/dev/null || tail -20 "$OUT/$tag.log"
      fi
      grep -o '"\(memory\|time\)/[a-z]*": [0-9.]*' "/root/mem/run-$tag/metrics.jsonl" 2>/dev/null | tail -8
    done
  done
done
