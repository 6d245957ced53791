#!/usr/bin/env bash
# On the lent 4-GPU machine that ran parity_gpu.sh: the pretrained pipeline continues on GPU 0; once its dpo
# stage has started, `align dpo` with that stage's settings (its .pipeline-stage.toml) at seeds 1 and 2 on GPUs 1-2 (the pipeline's own
# dpo stage is seed 0); GPU 3 reruns the default GRPO recipe of benchmarks/real_model (seed 0). END as there.
set -uo pipefail
END=${END:-540}
CUDA_VISIBLE_DEVICES=0 LIMIT=$((END - SECONDS - 40)) bash benchmarks/pretrained_gpu.sh > /root/log-pre2 2>&1 &
CUDA_VISIBLE_DEVICES=3 timeout $((END - SECONDS)) python -m benchmarks.real_model --model /root/smollm2 --seeds 0 \
  --steps 100 --verifier math --out /root/real --param min_terms=2 --param max_terms=2 --param max_digits=2 \
  --param "operators=['+','-']" --param allow_parentheses=false --param allow_negation=false -- --lr 1e-5 \
  --max-new-tokens 64 --eval-k 1 --eval-every 50 > /root/log-real 2>&1 &
complete() { python -c "import json,sys; sys.exit(json.load(open('$1/artifact.json'))['status'] != 'complete')" 2>/dev/null; }
until complete /root/pre/prefs || [ $SECONDS -gt $((END - 240)) ]; do sleep 5; done
if complete /root/pre/prefs; then
  for s in 1 2; do
    until [ -f /root/pre/dpo/.pipeline-stage.toml ] || [ $SECONDS -gt $((END - 200)) ]; do sleep 5; done
    CUDA_VISIBLE_DEVICES=$s timeout $((END - SECONDS)) python -m align dpo --config /root/pre/dpo/.pipeline-stage.toml \
      --seed $s --out /root/dpo_s$s > /root/log-dpo$s 2>&1 &
  done
fi
wait
echo "all done at ${SECONDS}s"
for f in /root/log-*; do echo "== $f"; grep -v -E "it/s\]|Loading weights|^\s*$|^(eval|grpo|ppo|dpo|rm|sample) [0-9]+/" $f \
  | tail -25; done | tail -c 11000
(cd /root && tar czf "$OUT/seeds.tgz" log-* dpo_s*/artifact.json dpo_s*/metrics.jsonl real/summary.json \
  real/seed0/metrics.jsonl 2>/dev/null)
