#!/usr/bin/env bash
# RLMonitor's rollout/trainer agreement on one GPU (bf16, the fast decoder): a healthy GRPO run and the same run
# whose fast decoder stops refreshing its weight copy at step ONSET (benchmarks.faults stale_fast_decoder), at the
# SmolLM2-135M shape (random weights, the project's tokenizer, the noise reward: every group has signal).
# Prints each step's rollout/logp_abs_diff and rollout/kl for both runs and the runs' RLMonitor events: the
# healthy run's values are what bf16 explains (rollout_mismatch's 16-bit tolerance), the stale run must fire
# rollout_mismatch within 2 steps of ONSET.
#   . benchmarks/gpu_setup.sh && bash benchmarks/monitor_gpu.sh [ONSET=6] [LR=5e-5]
# (MODEL=tiny ROOT=/tmp/mon NEW=32 run it on a CPU as a smoke test: fp32 there, HF-free fast decoder path forced.)
set -euo pipefail
ONSET=${1:-6}; LR=${2:-5e-5}; R=${ROOT:-/root/mon}
m=${MODEL:-$(python3 -c "from pathlib import Path; from benchmarks import vs_trl as V; print(V.make_model('135m', Path('$R')))" | tail -1)}
common=(grpo --model "$m" --reward benchmarks/bench_reward.py:noise --eval-data '' --max-steps $((ONSET + 6))
        --prompts-per-step 8 --num-generations 8 --max-new-tokens ${NEW:-256} --lr "$LR" --no-final-checkpoint --overwrite)
python3 -m benchmarks.faults none 0 "${common[@]}" --out $R/healthy > $R/healthy.log 2>&1 || tail -20 $R/healthy.log
python3 -m benchmarks.faults stale_fast_decoder "$ONSET" "${common[@]}" --out $R/stale > $R/stale.log 2>&1 \
  || tail -20 $R/stale.log
python3 - "$R" <<'PY'
import json, sys
R = sys.argv[1]
for run in ("healthy", "stale"):
    rows = [json.loads(x) for x in open(f"{R}/{run}/metrics.jsonl") if '"rollout/' in x]
    print(run, "step: logp_abs_diff / kl")
    print("  " + ", ".join(f"{r['step']}: {r['rollout/logp_abs_diff']:.2e} / {r['rollout/kl']:.1e}" for r in rows))
    events = [json.loads(x) for x in open(f"{R}/{run}/health.jsonl")]
    print("  events:", [(e.get("rule"), e.get("step")) for e in events] or "none")
PY
