#!/usr/bin/env bash
# On a lent GPU machine: install the wheels sent ahead (/root/gg/whl, /root/gg/whl2) and rebuild SmolLM2-135M-Instruct in
# /root/smollm2 from the GGUF parts sent ahead to /root/gg (part.aa, part.ab) and the one carried (.gguf/part.ac).
# Idempotent: a machine that already has /root/smollm2 is left as it is.
set -euo pipefail
if [ ! -d /root/smollm2 ]; then
  cat /root/gg/part.aa /root/gg/part.ab .gguf/part.ac > /root/gg/smol.gguf
  sha256sum /root/gg/smol.gguf
  python -m pip install -q --no-deps /root/gg/whl/*.whl /root/gg/whl2/*.whl 2>&1 | { grep -v -i warn || true; } | tail -3
  python -m pip install -q --no-deps /root/gg/whl2/pycosat-*.tar.gz 2>&1 | tail -2 || echo "pycosat not built"
  python -m benchmarks.smollm2 /root/gg/smol.gguf /root/smollm2 2>&1 | tail -1
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
