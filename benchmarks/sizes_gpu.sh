#!/usr/bin/env bash
# Real sizes on one H200: random-weight models of real configs (benchmarks/vs_trl.py MODELS), ours against TRL in
# the same command on the same card wherever TRL runs (a TRL run that dies, e.g. out of memory, shows as "-" and
# its log tail is printed: that is a result). One part per call (each fits a device call's 10 minutes); start with
# `. benchmarks/gpu_setup.sh` (the carried wheels) and mind the 64 GB disk (an 8B model is 16 GB).
#   bash benchmarks/sizes_gpu.sh grpo512 MODEL  GRPO full fine-tuning, 8 prompts x G 8, 512 new tokens, defaults
#                                               otherwise (MODEL: qwen2.5-1.5b, qwen3-4b or llama3.1-8b)
#   bash benchmarks/sizes_gpu.sh defaults MODEL ours alone at 8 prompts x G 8, 512 new tokens, with our defaults:
#                                               no gradient checkpointing, the plan's micro-batch (the harness'
#                                               own default, checkpointing and micro 16, matches TRL's settings)
#   bash benchmarks/sizes_gpu.sh grpo4k         Llama-3.1-8B, ~256-token prompts + 3,840 new tokens, ours at its
#                                               defaults (the memory plan sizes the micro-batch), --no-final-checkpoint
#   bash benchmarks/sizes_gpu.sh lora8b         the same 4K shape with --lora-r 16 (peak against grpo4k's)
#   bash benchmarks/sizes_gpu.sh ragged4k [packed]  the 4K shape with ragged completions (--ragged: half the
#                                               budget on average), padded or with --packing (one call each; the
#                                               second reuses the first's model)
#   bash benchmarks/sizes_gpu.sh dpo8b          DPO full fine-tuning at Llama-3.1-8B, ours against TRL
#   bash benchmarks/sizes_gpu.sh recapture      the decoder's graph re-capture check, then the 135M cold start
#   bash benchmarks/sizes_gpu.sh ppo MODEL [LORA_R]  PPO-ptx with its four models (policy, reference, RM, value
#                                               network from the RM): a 2-step RM on the shipped pairs, then 3 PPO
#                                               steps of 64 prompts x 512 new tokens, defaults otherwise
#   bash benchmarks/sizes_gpu.sh refuse         Llama-3.1-8B GRPO with a deliberately huge batch: the memory plan
#                                               must stop it (exit 2) before anything is built
# Every `align` run here is bounded by BENCH_TIMEOUT seconds (the vs_trl harness' runs, and `capped` below): a call
# that runs out prints what it has instead of nothing (a `timeout` around the whole script with a pipe after it
# kills the shell, not the python under it, and the call's limit then takes the output with it).
set -euo pipefail
export BENCH_TIMEOUT=${BENCH_TIMEOUT:-540}
capped() { timeout -k 15 "$BENCH_TIMEOUT" "$@" || echo "[exit $?: stopped after BENCH_TIMEOUT=$BENCH_TIMEOUT s or failed] $*"; }
case "${1:-}" in
grpo512)
  python3 -m benchmarks.grpo_vs_trl --models "${2:?MODEL}" --steps 4 --out /root/sizes ;;
defaults)
  python3 -m benchmarks.grpo_vs_trl --models "${2:?MODEL}" --steps 4 --only ours --micro-batch-size 0 \
    --no-gradient-checkpointing --ours-extra="--no-final-checkpoint" --out /root/sizes-defaults ;;
grpo4k)
  python3 -m benchmarks.grpo_vs_trl --models llama3.1-8b --steps 3 --only ours --prompt-tokens 256 \
    --max-new-tokens 3840 --micro-batch-size 0 --no-gradient-checkpointing --ours-extra="--no-final-checkpoint" \
    --out /root/sizes ;;
lora8b)
  python3 -m benchmarks.grpo_vs_trl --models llama3.1-8b --steps 3 --only ours --prompt-tokens 256 \
    --max-new-tokens 3840 --micro-batch-size 0 --no-gradient-checkpointing \
    --ours-extra="--no-final-checkpoint --lora-r 16 --lora-alpha 32" --out /root/sizes-lora ;;
ragged4k)
  python3 -m benchmarks.grpo_vs_trl --models llama3.1-8b --steps 3 --only ours --prompt-tokens 256 \
    --max-new-tokens 3840 --micro-batch-size 0 --no-gradient-checkpointing --ragged \
    --ours-extra="--no-final-checkpoint${2:+ --packing}" --out /root/sizes-ragged ;;
dpo8b)
  python3 -m benchmarks.dpo_vs_trl --models llama3.1-8b --steps 4 --batch-size 64 --micro-batch-size 8 \
    --ours-extra="--no-final-checkpoint" --out /root/sizes-dpo ;;
recapture)
  python3 -m benchmarks.recapture_check
  python3 -m benchmarks.cold_start --models 135m --runs 2 --steps 2 --out /root/cold ;;
ppo)
  name=${2:?MODEL}; lora=(); [ -n "${3:-}" ] && lora=(--lora-r "$3" --lora-alpha $((2 * $3)))
  m=$(python3 -c "from pathlib import Path; from benchmarks import vs_trl as V; print(V.make_model('$name', Path('/root/sizes')))" | tail -1)
  t=$(date +%s)
  capped python3 -m align rm train --model "$m" --out /root/ppo/rm-$name --overwrite --eval-data '' --max-steps 2 \
    --batch-size 32 --micro-batch-size 16 --no-final-checkpoint --max-shard-size 20GB "${lora[@]}"
  echo "rm: $(( $(date +%s) - t )) s"; t=$(date +%s)
  capped python3 -m align ppo --model "$m" --reward-model /root/ppo/rm-$name --out /root/ppo/ppo-$name --overwrite \
    --max-steps 3 --prompts-per-step 64 --max-new-tokens 512 --eval-samples 0 --no-final-checkpoint \
    --max-shard-size 20GB "${lora[@]}"
  echo "ppo: $(( $(date +%s) - t )) s"
  python3 - "$name" <<'PY'
import json, sys
import os
if not os.path.exists(f"/root/ppo/ppo-{sys.argv[1]}/metrics.jsonl"):
    sys.exit("no PPO metrics: the run did not reach its first step")
rows = [json.loads(x) for x in open(f"/root/ppo/ppo-{sys.argv[1]}/metrics.jsonl") if '"time/' in x]
for r in rows:
    print({k: round(v, 3) for k, v in r.items() if isinstance(v, (int, float)) and k.split("/")[0] in
           ("step", "time", "memory", "completions", "tokens")})
art = json.load(open(f"/root/ppo/ppo-{sys.argv[1]}/artifact.json"))
print("status", art.get("status"), "peak GiB per rank", art["metrics"].get("peak_memory_gib_per_rank"))
PY
  ;;
refuse)
  m=$(python3 -c "from pathlib import Path; from benchmarks import vs_trl as V; print(V.make_model('llama3.1-8b', Path('/root/sizes')))" | tail -1)
  set +e
  timeout -k 15 "$BENCH_TIMEOUT" python3 -m align grpo --model "$m" --out /root/refuse --reward benchmarks/bench_reward.py:noise --eval-data '' \
    --prompts-per-step 256 --num-generations 16 --max-new-tokens 3840 --micro-batch-size 256
  echo "exit code $? (2 expected); out dir exists: $(test -e /root/refuse && echo yes || echo no)" ;;
*) sed -n 2,18p "$0"; exit 2 ;;
esac
