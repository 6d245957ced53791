#!/usr/bin/env bash
# On a lent GPU machine (see benchmarks/RESULTS.md): SmolLM2-135M-Instruct rebuilt from the GGUF parts sent ahead
# to /root/gg (the last part and the wheels travel with this call), then benchmarks.real_model on SEEDS.
# usage: bash benchmarks/real_model_gpu.sh SEEDS [extra real_model args]
set -euo pipefail
SEEDS=$1; shift
if [ ! -d /root/smollm2 ]; then
  cat /root/gg/part.aa /root/gg/part.ab .gguf/part.ac > /root/gg/smol.gguf
  sha256sum /root/gg/smol.gguf
  python -m pip install -q --no-deps .whl/*.whl /root/gg/whl2/*.whl 2>&1 | { grep -v -i warn || true; } | tail -3
  python -m pip install -q --no-deps /root/gg/whl2/pycosat-*.tar.gz 2>&1 | tail -2 || echo "pycosat not built"
  python -m benchmarks.smollm2 /root/gg/smol.gguf /root/smollm2 2>&1 | tail -1
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -m benchmarks.real_model --model /root/smollm2 --seeds "$SEEDS" --out /root/runs "$@" 2>&1 \
  | grep -v -E "it/s\]|Loading weights|^\s*$" | tail -c 20000
mkdir -p "$OUT/real" && cp /root/runs/summary.json "$OUT/real/summary-$SEEDS.json" || true
for d in /root/runs/seed*; do cp "$d/metrics.jsonl" "$OUT/real/$(basename $d)-metrics.jsonl" 2>/dev/null || true; done
