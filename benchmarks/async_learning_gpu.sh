#!/usr/bin/env bash
# On a lent 2-GPU machine: does one-step-off GRPO learn like the synchronous run? The real-model recipe
# (benchmarks.real_model: SmolLM2-135M-Instruct, basic_arithmetic with two terms of <= 2 digits and + / -, 2,000
# training prompts, 200 held-out, 16 prompts x G 8, <= 64 new tokens, 100 steps, lr 1e-5) at SEEDS, synchronous
# (one process, staleness 0) against 1 decoder + 1 trainer at staleness 1 with TIS (cap 2). All runs at once (the
# 135M model takes a few GiB; timings are contended and not the point), then held-out greedy pass@1 of every
# model with the math verifier (align eval).
# SmolLM2 as in real_model_gpu.sh (parts sent ahead to /root/gg, .gguf carried). usage: END=560 bash THIS [SEEDS]
set -uo pipefail
END=${END:-560}
SEEDS=${1:-0,1,2}
mkdir -p /root/al; bash benchmarks/gpu_smollm2_setup.sh
P=(--param min_terms=2 --param max_terms=2 --param max_digits=2 --param "operators=['+','-']"
   --param allow_parentheses=false --param allow_negation=false)
R=(--lr 1e-5 --max-new-tokens 64 --eval-k 1 --eval-every 50)
i=0
for s in ${SEEDS//,/ }; do
  CUDA_VISIBLE_DEVICES=$((i % 2)) timeout $((END - SECONDS)) python -m benchmarks.real_model --model /root/smollm2 \
    --seeds $s --steps 100 --out /root/al/sync-s$s "${P[@]}" -- "${R[@]}" > /root/al/log-sync-s$s 2>&1 &
  timeout $((END - SECONDS)) python -m benchmarks.real_model --model /root/smollm2 --seeds $s --steps 100 \
    --out /root/al/async-s$s "${P[@]}" -- "${R[@]}" --nproc 2 --rollout-gpus 1 --max-staleness 1 --tis-cap 2 \
    > /root/al/log-async-s$s 2>&1 &
  i=$((i + 1))
done
wait
echo "all done at ${SECONDS}s"
# held-out greedy pass@1 with the math verifier (the last number; the task's own scorer wants the bare answer)
ev() { CUDA_VISIBLE_DEVICES=$2 python -m align eval "$1" --data /root/al/sync-s0/test.jsonl --k 1 --limit 200 \
  --verifier math --max-new-tokens 64 --out "/root/al/eval-$3" --overwrite > "/root/al/log-eval-$3" 2>&1; }
ev /root/smollm2 0 base &
i=1
for s in ${SEEDS//,/ }; do
  ev /root/al/sync-s$s/seed$s $((i % 2)) sync-s$s & ev /root/al/async-s$s/seed$s $(((i + 1) % 2)) async-s$s &
  i=$((i + 1)); wait
done
wait
for d in /root/al/eval-*; do
  python -c "import json; print('$(basename $d)', json.load(open('$d/artifact.json'))['metrics']['pass@1/greedy'])"
done
for f in /root/al/log-*; do echo "== $f"; grep -E "^\||gain|Error|error" "$f" | tail -6; done | tail -c 9000
(cd /root/al && tar czf "$OUT/al.tgz" log-* */summary.json */seed*/metrics.jsonl */seed*/artifact.json eval-*/artifact.json \
  2>/dev/null)
