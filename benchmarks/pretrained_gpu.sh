#!/usr/bin/env bash
# On a lent GPU machine: pipelines/pretrained.toml with SmolLM2 from /root/smollm2 (see gpu_smollm2_setup.sh).
# Rerun it to continue: complete stages are skipped, an interrupted one resumes from its checkpoint.
set -uo pipefail
bash benchmarks/gpu_smollm2_setup.sh
M=/root/smollm2
python -m align pipeline run pipelines/pretrained.toml --set pipeline.out=/root/pre --set stages.eval_base.model=$M \
  --set stages.prefs.from_model=$M --set stages.rm.model=$M --set stages.dpo.model=$M "$@" 2>&1 \
  | grep -v -E "it/s\]|Loading weights|^\s*$|^(eval|grpo|ppo|dpo|rm|sample) [0-9]+/" | tail -c 15000
mkdir -p "$OUT/pre"
for d in /root/pre/*/; do n=$(basename "$d"); for f in artifact.json metrics.jsonl health.jsonl; do
  [ -f "$d/$f" ] && cp "$d/$f" "$OUT/pre/$n-$f"; done; done
