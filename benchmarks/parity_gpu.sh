#!/usr/bin/env bash
# On a lent 4-GPU machine, SmolLM2 parts sent ahead (see gpu_smollm2_setup.sh): benchmarks.grpo_parity side by
# side, TRL seeds 0-2 on GPUs 0-2 and ours (seeds 0-2, one after the other) on GPU 3, then the table. END:
# seconds into the call by which everything stops (runs cut short are left out of the table). PRECISION: ours'
# --precision values, one after the other on GPU 3 (default: auto), e.g. PRECISION=bf16-mixed.
set -uo pipefail
END=${END:-560}
bash benchmarks/gpu_smollm2_setup.sh
M=/root/smollm2 R=/root/parity
mkdir -p $R
python -m align data make rg:basic_arithmetic --n 2000 --test-n 200 --seed 0 --param min_terms=2 --param max_terms=2 \
  --param max_digits=2 --param "operators=['+','-']" --param allow_parentheses=false --param allow_negation=false \
  --out $R/train.jsonl --test-out $R/test.jsonl > $R/log-data 2>&1
A=(--model $M --data $R/train.jsonl --eval-data $R/test.jsonl --out $R --steps 50)
python -m benchmarks.grpo_parity "${A[@]}" --sides "" > $R/log-base 2>&1
for i in 0 1 2; do
  CUDA_VISIBLE_DEVICES=$i timeout $((END - SECONDS)) python -m benchmarks.grpo_parity "${A[@]}" --sides trl --seeds $i \
    > $R/log-trl$i 2>&1 &
done
for p in ${PRECISION:-auto}; do
  CUDA_VISIBLE_DEVICES=3 timeout $((END - SECONDS)) python -m benchmarks.grpo_parity "${A[@]}" --sides ours-$p \
    --seeds 0,1,2 --ours-extra=--precision --ours-extra=$p > $R/log-ours-$p 2>&1
done
wait
echo "all done at ${SECONDS}s"
python -m benchmarks.grpo_parity "${A[@]}" --report
for f in $R/log-*; do echo "== $f"; grep -v -E "it/s\]|Loading weights|^\s*$|^(eval|grpo|sample) [0-9]+/" $f | tail -15; done \
  | tail -c 7000
(cd $R && tar czf "$OUT/parity.tgz" *.json log-* */metrics.jsonl 2>/dev/null)
