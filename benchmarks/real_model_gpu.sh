#!/usr/bin/env bash
# On a lent GPU machine (see benchmarks/RESULTS.md): SmolLM2-135M-Instruct rebuilt from the GGUF parts sent ahead
# to /root/gg (the last part and the wheels travel with this call), then benchmarks.real_model on SEEDS.
# usage: bash benchmarks/real_model_gpu.sh SEEDS [extra real_model args]
set -euo pipefail
SEEDS=$1; shift
bash benchmarks/gpu_smollm2_setup.sh
python -m benchmarks.real_model --model /root/smollm2 --seeds "$SEEDS" --out /root/runs "$@" 2>&1 \
  | grep -v -E "it/s\]|Loading weights|^\s*$" | tail -c 20000
mkdir -p "$OUT/real" && cp /root/runs/summary.json "$OUT/real/summary-$SEEDS.json" || true
for d in /root/runs/seed*; do cp "$d/metrics.jsonl" "$OUT/real/$(basename $d)-metrics.jsonl" 2>/dev/null || true; done
