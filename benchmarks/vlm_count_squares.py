"""Learning to count squares with a vision-language model on CPU: the tiny random Qwen2.5-VL
(`align model init --preset tiny-vl`), SFT on `align data make count_squares`, then GRPO with the exact-number
verifier; held-out greedy pass@1 (chance: 25 %, k in 1..4) before, after SFT and after GRPO, per seed.

    python -m benchmarks.vlm_count_squares [--seeds 0 1] [--sft-steps 150] [--grpo-steps 100] [--out runs/vlm-bench]
    python -m benchmarks.vlm_count_squares --smoke     # a few steps of each, to check that it runs (tests/test_vlm.py)

Each seed draws its own model, data (2,000 training images, 200 held out) and run seeds. The SFT is kept short on
purpose (it alone reaches 96-98 % in 300-400 steps): what GRPO adds from a partly trained model is what is measured.
Measured on 2 shared CPU cores (2026-12-05; docs/vision.md): untrained 0 / 0 %, after SFT 80.0 / 20.5 %, after
GRPO 83.0 / 47.5 % (seeds 0 / 1); with --sft-steps 100: 26.5 / 20.5 % after SFT, 76.5 / 20.5 % after GRPO.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def subprocess_run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "align", *map(str, args)], capture_output=True, text=True)


def run_seed(seed: int, a, root: Path, run=subprocess_run) -> dict:
    """One seed's chain: model, data, SFT, GRPO; the held-out greedy pass@1 of each and the wall seconds. `run`:
    how `align ARGS` is run (tests: their forked processes)."""

    def align(*args) -> dict:  # its artifact's metrics; a failure: its output, then SystemExit
        done = run(*args)
        if done.returncode:
            sys.exit(f"align {' '.join(map(str, args))} failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                     f"{done.stderr[-3000:]}")
        out = Path(args[args.index("--out") + 1])
        return json.loads((out / "artifact.json").read_text()).get("metrics", {}) if out.is_dir() else {}

    d = root / f"seed{seed}"
    align("model", "init", "--preset", "tiny-vl", "--seed", seed, "--out", d / "base", "--overwrite")
    align("data", "make", "count_squares", "--n", a.train, "--test-n", a.test, "--seed", seed,
          "--out", d / "data/train.jsonl", "--overwrite")
    data, test = d / "data/train.jsonl", d / "data/train.test.jsonl"
    common = ["--eval-data", test, "--max-new-tokens", 3, "--seed", seed, "--overwrite"]
    base = align("eval", d / "base", "--data", test, "--limit", a.test, "--k", 1, "--max-new-tokens", 3,
                 "--out", d / "base-eval", "--overwrite")
    t = time.time()
    sft = align("sft", "--model", d / "base", "--data", data, "--max-steps", a.sft_steps, "--batch-size", 32,
                "--lr", a.sft_lr, "--warmup-steps", min(20, a.sft_steps // 2), "--eval-every", 0,
                "--out", d / "sft", *common)
    sft_s = time.time() - t
    t = time.time()
    grpo = align("grpo", "--model", d / "sft", "--data", data, "--max-steps", a.grpo_steps, "--prompts-per-step", 16,
                 "--num-generations", 8, "--lr", a.grpo_lr, "--warmup-steps", 0, "--beta", 0.0, "--temperature", 1.0,
                 "--eval-samples", a.test, "--eval-every", 0, "--out", d / "grpo", *common)
    return {"seed": seed, "base": base.get("pass@1/greedy"), "sft": sft.get("eval/pass@1"),
            "grpo_start": grpo.get("start/pass@1/greedy"), "grpo": grpo.get("eval/pass@1/greedy"),
            "problems": grpo.get("eval/problems"), "sft_s": sft_s, "grpo_s": time.time() - t}


def smoke(a):
    """--smoke: 2 steps of each on 64 / 16 rows, one seed."""
    if a.smoke:
        a.sft_steps, a.grpo_steps, a.train, a.test, a.seeds = 2, 2, 64, 16, a.seeds[:1]
    return a


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--sft-steps", type=int, default=150)
    ap.add_argument("--sft-lr", type=float, default=2e-3)
    ap.add_argument("--grpo-steps", type=int, default=100)
    ap.add_argument("--grpo-lr", type=float, default=3e-4)
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--test", type=int, default=200)
    ap.add_argument("--out", default="runs/vlm-bench")
    ap.add_argument("--smoke", action="store_true", help="2 steps of each on 64 / 16 rows: it runs, not learns")
    return ap


def main() -> None:
    a = smoke(parser().parse_args())
    results = [run_seed(s, a, Path(a.out)) for s in a.seeds]
    print(f"count_squares, tiny-vl: held-out greedy pass@1 on {a.test} images (chance 25 %); SFT {a.sft_steps} steps "
          f"x 32, GRPO {a.grpo_steps} steps x 16 prompts x G 8")
    print("| seed | untrained | after SFT | GRPO's start | after GRPO | SFT s | GRPO s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['seed']} | {r['base']:.1%} | {r['sft']:.1%} | {r['grpo_start']:.1%} | {r['grpo']:.1%} | "
              f"{r['sft_s']:.0f} | {r['grpo_s']:.0f} |")
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
