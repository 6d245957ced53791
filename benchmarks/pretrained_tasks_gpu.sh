#!/usr/bin/env bash
# On a lent GPU machine: benchmarks.pretrained_tasks with SmolLM2 from /root/smollm2 (see gpu_smollm2_setup.sh), every
# run at once on the one GPU. END=SECONDS (since this script started) stops them gracefully before a device call's
# limit (a stage in flight checkpoints within 60 s, else it is killed; 90 s are left for that and the copy-out); the same command continues them
# (complete stages skipped). Arguments go to the script (e.g. --tasks pm,add).
set -uo pipefail
bash benchmarks/gpu_smollm2_setup.sh
limit=0; [ -n "${END:-}" ] && limit=$((END - SECONDS - 90))
python -m benchmarks.pretrained_tasks --model /root/smollm2 --out /root/pt --limit "$limit" "$@" 2>&1 | tail -c 5000
for f in /root/pt/*/*.log; do echo "== $f"; grep -v -E "it/s\]|Loading weights|^\s*$|^(eval|grpo|ppo|dpo|rm|sample|resample [0-9]+) [0-9]+/" "$f" \
  | grep -E "^(>|error|RLMonitor|health)|pass@1|accuracy|pairs|samples" | tail -12; done | tail -c 7000
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
mkdir -p "$OUT" && (cd /root/pt && tar czf "$OUT/pt.tgz" summary.json */alone.toml */*.log $(ls -d */*/*/artifact.json \
  */*/*/metrics.jsonl */*/*/health.jsonl */*/*/eval_samples.jsonl 2>/dev/null))
