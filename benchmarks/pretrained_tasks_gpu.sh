#!/usr/bin/env bash
# On a lent GPU machine: benchmarks.pretrained_tasks with SmolLM2 from /root/smollm2 (see gpu_smollm2_setup.sh), every
# run at once. END=SECONDS (since this script started) stops them gracefully before a device call's limit (a stage in
# flight checkpoints within 60 s, else it is killed; 90 s are left for that and the copy-out); the same command
# continues them (complete stages skipped). Arguments go to the script (e.g. --tasks pm,add); several invocations
# run side by side when separated by "::", the first in /root/pt, the next in /root/pt2, ... (e.g. the recipe on
# seed 0 with GRPO alone :: the same on seed 1 without it).
set -uo pipefail
bash benchmarks/gpu_smollm2_setup.sh
limit=0; [ -n "${END:-}" ] && limit=$((END - SECONDS - 90))
runs=(); cur=()
for a in "$@"; do
  if [ "$a" = "::" ]; then runs+=("$(printf '%q ' "${cur[@]}")"); cur=(); else cur+=("$a"); fi
done
runs+=("$(printf '%q ' "${cur[@]}")")
outs=()
for i in "${!runs[@]}"; do
  out=/root/pt; [ "$i" -gt 0 ] && out=/root/pt$((i + 1)); outs+=("$out")
  eval "python -m benchmarks.pretrained_tasks --model /root/smollm2 --out $out --limit $limit ${runs[$i]}" \
    > "$out.log" 2>&1 &
done
wait
for out in "${outs[@]}"; do
  echo "=== $out"; tail -c 4000 "$out.log"
  for f in "$out"/*/*.log; do echo "== $f"; grep -v -E "it/s\]|Loading weights|^\s*$|^(eval|grpo|ppo|dpo|rm|sample|resample [0-9]+) [0-9]+/" "$f" \
    | grep -E "^(>|error|RLMonitor|health)|pass@1|accuracy|pairs|samples" | tail -6; done | tail -c 3000
done
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
mkdir -p "$OUT"
for out in "${outs[@]}"; do
  (cd "$out" && tar czf "$OUT/$(basename "$out").tgz" summary.json */*.toml */*.log $(ls -d */*/*/artifact.json \
    */*/*/metrics.jsonl */*/*/health.jsonl */*/*/eval_samples.jsonl 2>/dev/null))
done
