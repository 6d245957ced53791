"""GRPO step anatomy on a GPU: a SmolLM2-135M-shaped Llama (random init: speed does not depend on the weights),
8 prompts x G=8 x up to 512 new tokens, bf16. Prints generation / reward / log-prob / update time per step,
generated tokens/s and peak memory, from a real `align grpo` run.

    python -m benchmarks.grpo_step --steps 4 --max-new-tokens 512 [--nproc 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SMOLLM2_135M = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048)


def make_model(out: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from align.paths import TOKENIZER_DIR

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    cfg = LlamaConfig(**SMOLLM2_135M, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    root = Path(a.out or tempfile.mkdtemp(prefix="align-grpo-bench-"))
    model = make_model(root / "smollm2-135m-shape")
    out = root / "grpo"
    cmd = [sys.executable, "-m", "align", "grpo", "--model", str(model), "--out", str(out), "--overwrite",
           "--eval-data", "", "--max-steps", str(a.steps), "--prompts-per-step", str(a.prompts),
           "--num-generations", str(a.generations), "--max-new-tokens", str(a.max_new_tokens), "--micro-batch-size",
           "16", "--nproc", str(a.nproc),
           "--reward", "benchmarks/bench_reward.py:noise"]  # a random model solves nothing: without signal RLMonitor stops
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        raise SystemExit(f"failed: {' '.join(cmd)}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/generate" in r][1:]  # step 1 includes warm-up
    art = json.loads((out / "artifact.json").read_text())
    keys = ["time/generate", "time/reward", "time/logprobs", "time/update"]
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    total = sum(med.values())
    print(f"\nGRPO step, SmolLM2-135M shape, {a.prompts} prompts x G={a.generations}, <= {a.max_new_tokens} new "
          f"tokens, {a.nproc} process(es); median over steps 2..{a.steps}")
    print(f"{'phase':<16}{'seconds':>9}{'share':>8}")
    for k in keys:
        print(f"{k[5:]:<16}{med[k]:>9.3f}{med[k] / total:>8.1%}")
    print(f"{'step':<16}{total:>9.3f}")
    print(f"generated tokens/s: {statistics.median(r['completions/tokens_per_s'] for r in rows):.0f}   "
          f"mean completion length: {statistics.median(r['completions/mean_length'] for r in rows):.0f}   "
          f"peak GiB per rank: {art['metrics']['peak_memory_gib_per_rank']}")
    print("command:", " ".join(cmd[1:]))


if __name__ == "__main__":
    main()
