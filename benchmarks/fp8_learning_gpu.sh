#!/usr/bin/env bash
# On a lent GPU machine with SmolLM2 in /root/smollm2 (gpu_smollm2_setup.sh or tools_smollm2_gpu.sh's rebuild):
# GRPO on basic_arithmetic (two terms of 1-2 digits, `+`; DATA/train.jsonl, DATA/test.jsonl) with bf16 rollouts and
# with --rollout-precision fp8, seeds 0-2, all six runs side by side on the one GPU. Each run's artifact.json and
# metrics.jsonl go to $OUT/fp8-learning/.
# usage: bash benchmarks/fp8_learning_gpu.sh DATA [STEPS]
set -uo pipefail
DATA=$1; STEPS=${2:-60}; R=/root/fp8l
mkdir -p "$OUT/fp8-learning"
for seed in 0 1 2; do
  for prec in bf16 fp8; do
    python3 -m align grpo --model /root/smollm2 --data "$DATA/train.jsonl" --eval-data "$DATA/test.jsonl" \
      --reward math --max-steps "$STEPS" --lr 1e-5 --max-new-tokens 64 --eval-every "$STEPS" --eval-k 1 \
      --eval-samples 200 --seed $seed --rollout-precision ${prec/bf16/auto} --out $R/$prec-$seed --overwrite \
      > $R-$prec-$seed.log 2>&1 &
  done
done
wait
for seed in 0 1 2; do for prec in bf16 fp8; do
  cp $R/$prec-$seed/artifact.json "$OUT/fp8-learning/$prec-$seed-artifact.json" 2>/dev/null || tail -5 $R-$prec-$seed.log
  cp $R/$prec-$seed/metrics.jsonl "$OUT/fp8-learning/$prec-$seed-metrics.jsonl" 2>/dev/null
done; done
python3 - <<'PY'
import json, glob, os, statistics
out = os.environ["OUT"] + "/fp8-learning"
print("| rollouts | seed | greedy pass@1 before -> after | reward, last 10 steps | rollout/logp_abs_diff (mean) | median step s |")
print("|---|---|---|---|---|---|")
for prec in ("bf16", "fp8"):
    for seed in (0, 1, 2):
        try:
            art = json.load(open(f"{out}/{prec}-{seed}-artifact.json"))["metrics"]
            rows = [json.loads(l) for l in open(f"{out}/{prec}-{seed}-metrics.jsonl") if '"reward"' in l]
        except OSError:
            print(f"| {prec} | {seed} | (no run) |"); continue
        steps = [r for r in rows if "reward" in r]
        diff = [r["rollout/logp_abs_diff"] for r in steps if "rollout/logp_abs_diff" in r]
        st = sorted(r["time/step"] for r in steps[1:] if "time/step" in r) or [float("nan")]
        print(f"| {prec} | {seed} | {art.get('start/pass@1/greedy', float('nan')):.3f} -> {art.get('eval/pass@1/greedy', float('nan')):.3f} "
              f"| {statistics.mean(r['reward'] for r in steps[-10:]):.3f} | {statistics.mean(diff) if diff else float('nan'):.4f} | {st[len(st)//2]:.2f} |")
PY
