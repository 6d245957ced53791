#!/usr/bin/env bash
# On a lent GPU machine: pipelines/pretrained.toml with SmolLM2 from /root/smollm2 (see gpu_smollm2_setup.sh).
# Rerun it to continue: complete stages are skipped, an interrupted one resumes from its checkpoint.
# LIMIT=SECONDS stops the run gracefully (SIGTERM: the stage in flight checkpoints) before a call's time runs out.
set -uo pipefail
bash benchmarks/gpu_smollm2_setup.sh
M=/root/smollm2
timeout -s TERM -k 30 "${LIMIT:-36000}" python -m align pipeline run pipelines/pretrained.toml --set pipeline.out=/root/pre --set stages.eval_base.model=$M \
  --set stages.prefs.from_model=$M --set stages.rm.model=$M --set stages.grpo.model=$M "$@" 2>&1 \
  | grep -v -E "it/s\]|Loading weights|^\s*$|^(eval|grpo|ppo|dpo|rm|sample) [0-9]+/" | tail -c 15000
mkdir -p "$OUT" && (cd /root/pre && tar czf "$OUT/pre.tgz" $(ls -d */artifact.json */metrics.jsonl */health.jsonl \
  2>/dev/null))
