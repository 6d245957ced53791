#!/usr/bin/env bash
# On a lent machine of 2+ GPUs, SmolLM2 parts sent ahead (see gpu_smollm2_setup.sh): benchmarks.grpo_parity side by
# side — ours (seeds 0-2, one after the other) on the last GPU, TRL's seeds spread over the others (each GPU runs
# its share one after the other, so every TRL step time is a run alone on its card) — then the table. END: seconds
# into the call by which everything stops (runs cut short are left out of the table). TRL_SEEDS (default 0,1,2).
# PRECISION: ours' --precision values, one after the other (default: auto). BEFORE: the held-out greedy pass@1 of
# the model when already measured (skips that evaluation; 0.070 for the default task and data seed).
set -uo pipefail
END=${END:-560}
bash benchmarks/gpu_smollm2_setup.sh
M=/root/smollm2 R=/root/parity
mkdir -p $R
python -m align data make rg:basic_arithmetic --n 2000 --test-n 200 --seed 0 --param min_terms=2 --param max_terms=2 \
  --param max_digits=2 --param "operators=['+','-']" --param allow_parentheses=false --param allow_negation=false \
  --out $R/train.jsonl --test-out $R/test.jsonl --overwrite > $R/log-data 2>&1
A=(--model $M --data $R/train.jsonl --eval-data $R/test.jsonl --out $R --steps 50)
if [ -n "${BEFORE:-}" ]; then echo "{\"before\": $BEFORE}" > $R/eval_base.json; fi
python -m benchmarks.grpo_parity "${A[@]}" --sides "" > $R/log-base 2>&1
G=$(nvidia-smi -L | wc -l)
IFS=, read -ra SEEDS <<< "${TRL_SEEDS:-0,1,2}"
for g in $(seq 0 $((G - 2))); do
  (for i in "${!SEEDS[@]}"; do
    [ $((i % (G - 1))) -eq "$g" ] || continue
    CUDA_VISIBLE_DEVICES=$g timeout $((END - SECONDS)) python -m benchmarks.grpo_parity "${A[@]}" --sides trl \
      --seeds "${SEEDS[$i]}" > $R/log-trl${SEEDS[$i]} 2>&1
  done) &
done
for p in ${PRECISION:-auto}; do
  CUDA_VISIBLE_DEVICES=$((G - 1)) timeout $((END - SECONDS)) python -m benchmarks.grpo_parity "${A[@]}" \
    --sides ours-$p --seeds 0,1,2 --ours-extra=--precision --ours-extra=$p > $R/log-ours-$p 2>&1
done
wait
echo "all done at ${SECONDS}s"
python -m benchmarks.grpo_parity "${A[@]}" --report
for f in $R/log-*; do echo "== $f"; grep -v -E "it/s\]|Loading weights|^\s*$|^(eval|grpo|sample) [0-9]+/" $f | tail -15; done \
  | tail -c 7000
(cd $R && tar czf "$OUT/parity.tgz" *.json log-* */metrics.jsonl 2>/dev/null)
