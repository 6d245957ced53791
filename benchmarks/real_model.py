"""GRPO on a real pretrained model over a reasoning-gym task, several seeds: held-out greedy pass@1 before and
after (the task's own scorer), wall-clock of the training, step time and peak memory.

    python -m benchmarks.real_model --model DIR --task basic_arithmetic --seeds 0,1,2 --steps 100 \
        [--param KEY=VALUE ...] [-- extra `align grpo` flags]

Data: `align data make rg:TASK` with --n training prompts and a disjoint held-out split (seed 0 for every run:
the seeds vary the training, not the problems). Prints one row per seed and the mean; each run's artifact is
in OUT/seedS.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def align(*args) -> None:
    """`align ARGS`, replacing what a previous run of the benchmark left in its --out (--overwrite)."""
    cmd = [sys.executable, "-m", "align", *map(str, args), "--overwrite"]
    print("$ align " + " ".join(map(str, args)), flush=True)
    subprocess.run(cmd, check=True)


def greedy_pass1(model, data, n: int, verifier: str, max_new_tokens: int, out: Path) -> float:
    """Held-out greedy pass@1 of `model` on the first n rows of `data` through `align eval` (its artifact in out)."""
    align("eval", model, "--data", data, "--k", "1", "--limit", n, "--verifier", verifier,
          "--max-new-tokens", max_new_tokens, "--out", out)
    return json.loads((out / "artifact.json").read_text())["metrics"]["pass@1/greedy"]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--task", default="basic_arithmetic")
    ap.add_argument("--param", action="append", default=[])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--test-n", type=int, default=200)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default="runs/real_model")
    ap.add_argument("--verifier", default="", help="Also measure greedy pass@1 with this verifier (align eval), "
                    "before and after, e.g. math (the last number) beside the task's own scorer.")
    args, extra = ap.parse_known_args(argv)
    extra = [x for x in extra if x != "--"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, test = out / "train.jsonl", out / "test.jsonl"
    params = [x for p in args.param for x in ("--param", p)]
    align("data", "make", f"rg:{args.task}", "--n", args.n, "--test-n", args.test_n, "--seed", 0, "--out", train,
          "--test-out", test, *params)
    def greedy(model, name) -> float:
        return greedy_pass1(model, test, args.test_n, args.verifier, 64, out / f"eval_{name}") if args.verifier \
            else float("nan")

    base = greedy(args.model, "base")
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        run_out = out / f"seed{seed}"
        t0 = time.time()
        align("grpo", "--model", args.model, "--data", train, "--eval-data", test, "--eval-samples", args.test_n,
              "--reward", f"rg:{args.task}", "--max-steps", args.steps, "--seed", seed, "--out", run_out, *extra)
        wall = time.time() - t0
        m = metrics(run_out)
        steps = [r for r in m if "reward" in r]
        step_times = sorted(r["time/step"] for r in steps[1:] if "time/step" in r) or [float("nan")]
        art = json.loads((run_out / "artifact.json").read_text())["metrics"]
        rows.append({"seed": seed, "before": art["start/pass@1/greedy"], "after": art["eval/pass@1/greedy"],
                     "reward first10": statistics.mean(r["reward"] for r in steps[:10]),
                     "reward last10": statistics.mean(r["reward"] for r in steps[-10:]),
                     "train s": art["train_seconds"], "wall s": wall,
                     "step s (median)": step_times[len(step_times) // 2],
                     "peak GiB": max(art["peak_memory_gib_per_rank"])})
        if args.verifier:
            rows[-1].update({f"{args.verifier} before": base, f"{args.verifier} after": greedy(run_out, f"seed{seed}")})
    keys = list(rows[0])
    print("\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")
    gains = [r["after"] - r["before"] for r in rows]
    print(f"\npass@1 gain per seed: {', '.join(f'{g:+.3f}' for g in gains)}; mean {statistics.mean(gains):+.3f}")
    (out / "summary.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
