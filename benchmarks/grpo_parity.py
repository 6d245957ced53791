"""Learning parity: `align grpo` and TRL's GRPOTrainer on the same pretrained model, data, reward, G, prompts per
step, completion length, lr, schedule, clip range and loss aggregation, with fp32 master weights on both sides
(TRL: fp32 weights + bf16 autocast; ours: bf16 compute, fp32 master weights), several seeds each.

    python -m benchmarks.grpo_parity --model DIR --data train.jsonl --eval-data test.jsonl --seeds 0,1,2 --steps 50

Both sides: reward `math` (align.rewards, the same function), held-out greedy pass@1 before/after through the same
evaluator (`align eval --verifier math`), token-mean loss over every completion token of the step (TRL's
`loss_type="dapo"`; ours `--loss-agg token-mean` with our default `--drop-zero-std-groups`, whose normaliser
counts the dropped groups' tokens too, so the objective is the same), z-score advantages per group, clip 0.2 /
0.28, β 0, AdamW (0.9, 0.999), constant lr after 5 warmup steps, grad clip 1.0.
Prints, per side: mean training reward over steps 31-50 (mean ± standard error over seeds), pass@1 before/after,
median step time, wall-clock until the 10-step mean reward first reaches TRL's steps 41-50 mean, peak memory,
median gradient norm (before clipping) and, for ours, the median share of tokens whose terms enter the loss
(`kept_token_frac`: a normaliser over the kept tokens only would scale the gradient by its inverse).

Runs are independent: one (side, seed) per process writes OUT/SIDE-seedS.json, so they can run side by side on
different GPUs (CUDA_VISIBLE_DEVICES, one run per card); `--report` then prints the table of every run in OUT.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.real_model import align, greedy_pass1


def greedy(model, a, out: Path) -> float:
    return greedy_pass1(model, a.eval_data, a.eval_n, "math", a.max_new_tokens, out)


def ours(a, seed: int, out: Path) -> dict:
    t0 = time.time()
    align("grpo", "--model", a.model, "--data", a.data, "--eval-data", "", "--reward", "math", "--seed", seed,
          "--max-steps", a.steps, "--lr", a.lr, "--prompts-per-step", a.prompts, "--num-generations", a.generations,
          "--max-new-tokens", a.max_new_tokens, "--loss-agg", "token-mean", "--advantage", "zscore",
          "--epsilon", "0.2", "--epsilon-high", "0.28", "--beta", "0",
          "--schedule", "constant", "--warmup-steps", "5", "--grad-clip", "1.0", "--out", out, *a.ours_extra)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"reward"' in x]
    art = json.loads((out / "artifact.json").read_text())["metrics"]
    return {"reward": [r["reward"] for r in rows], "grad_norm": [r["grad_norm"] for r in rows],
            "kept_token_frac": [r["kept_token_frac"] for r in rows if "kept_token_frac" in r],
            "step_time": [r["time/step"] for r in rows], "wall": time.time() - t0,
            "peak_gib": max(art["peak_memory_gib_per_rank"]), "model": str(out)}


def trl_worker(a, seed: int, out: Path) -> None:
    """TRL's GRPOTrainer in this process; writes OUT/trl.json and the final model to OUT/model."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from align.data import read_rows
    from align.rewards import math_fn

    def math_reward(completions, answer, **kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [math_fn("", t, answer=x) for t, x in zip(texts, answer)]

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.t = [], None

        def on_step_begin(self, *args, **kw):
            self.t = time.time()

        def on_step_end(self, *args, **kw):
            self.times.append(time.time() - self.t)

    cuda = torch.cuda.is_available()
    tok = AutoTokenizer.from_pretrained(a.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)  # fp32 master weights
    rows = read_rows(a.data)
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": str(r["answer"])}
                            for r in rows])
    n = a.prompts * a.generations
    args = GRPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=n, gradient_accumulation_steps=1,
        num_generations=a.generations, max_completion_length=a.max_new_tokens, max_steps=a.steps,
        learning_rate=a.lr, lr_scheduler_type="constant_with_warmup", warmup_steps=5, max_grad_norm=1.0,
        loss_type="dapo", scale_rewards="group", epsilon=0.2, epsilon_high=0.28, beta=0.0, num_iterations=1,
        temperature=1.0, bf16=cuda and not a.trl_fp32, use_cpu=not cuda, logging_steps=1, report_to=[], save_strategy="no", seed=seed,
        log_completions=False, dataloader_num_workers=0)
    timer = Timer()
    tr = GRPOTrainer(model=model, reward_funcs=[math_reward], args=args, train_dataset=ds, processing_class=tok,
                     callbacks=[timer])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    tr.train()
    wall = time.time() - t0
    logs = [h for h in tr.state.log_history if "reward" in h]
    tr.save_model(str(out / "model"))
    tok.save_pretrained(str(out / "model"))
    (out / "trl.json").write_text(json.dumps({
        "reward": [h["reward"] for h in logs], "grad_norm": [h.get("grad_norm", float("nan")) for h in logs],
        "step_time": timer.times, "wall": wall, "model": str(out / "model"),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0}))


def trl(a, seed: int, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    argv = [x for x in sys.argv[1:] if not x.startswith("--worker")]
    subprocess.run([sys.executable, "-m", "benchmarks.grpo_parity", *argv, f"--worker={seed}:{out}"], check=True)
    return json.loads((out / "trl.json").read_text())


def late(reward: list[float]) -> list[float]:
    """Steps 31-50 (the acceptance window); a shorter smoke run: its second half."""
    return reward[30:50] if len(reward) >= 50 else reward[len(reward) // 2:]


def summary(runs: list[dict], target: float | None) -> dict:
    late_means = [statistics.mean(late(r["reward"])) for r in runs]
    se = statistics.stdev(late_means) / len(runs) ** 0.5 if len(runs) > 1 else float("nan")
    reach = []
    for r in runs:
        avg = [statistics.mean(r["reward"][max(0, i - 9):i + 1]) for i in range(len(r["reward"]))]
        hit = next((i for i, v in enumerate(avg) if target is not None and v >= target), None)
        reach.append(sum(r["step_time"][:hit + 1]) if hit is not None else float("nan"))
    return {"reward 31-50": f"{statistics.mean(late_means):.3f} ± {se:.3f}",
            "pass@1 before → after": ", ".join(f"{r['before']:.3f}→{r['after']:.3f}" for r in runs),
            "median step s": f"{statistics.median(t for r in runs for t in r['step_time'][1:]):.2f}",
            "s to TRL's step-50 reward": ", ".join(f"{x:.0f}" for x in reach),
            "peak GiB": f"{max(r['peak_gib'] for r in runs):.2f}",
            "median grad norm": f"{statistics.median(g for r in runs for g in r['grad_norm']):.3f}",
            "median kept_token_frac": (f"{statistics.median(f for r in runs for f in r['kept_token_frac']):.3f}"
                                       if runs[0].get("kept_token_frac") else "1 (all)")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--eval-data", required=True)
    ap.add_argument("--eval-n", type=int, default=200)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--sides", default="trl,ours")
    ap.add_argument("--ours-extra", action="append", default=[])
    ap.add_argument("--trl-fp32", action="store_true", help="TRL without bf16 autocast (fp32 compute): its bf16 "
                    "sampling can crash on a NaN probability late in a run; the side is then named trl-fp32")
    ap.add_argument("--out", default="runs/grpo_parity")
    ap.add_argument("--worker", default="")
    ap.add_argument("--report", action="store_true", help="Print the table of the runs already in --out.")
    a = ap.parse_args(argv)
    if a.worker:
        seed, out = a.worker.split(":", 1)
        return trl_worker(a, int(seed), Path(out))
    root = Path(a.out)
    root.mkdir(parents=True, exist_ok=True)
    if not a.report:
        base = root / "eval_base.json"  # measured once (`--sides ""` before side-by-side runs), then read
        if not base.exists():
            base.write_text(json.dumps({"before": greedy(a.model, a, root / "eval_base")}))
        before = json.loads(base.read_text())["before"]
        for side in filter(None, a.sides.split(",")):  # --sides "": the baseline only
            for seed in [int(s) for s in a.seeds.split(",")]:
                out = root / f"{side}-seed{seed}"
                r = trl(a, seed, out) if side.startswith("trl") else ours(a, seed, out)  # ours, ours-PRECISION, ...
                r.update(side=side, seed=seed, before=before,
                         after=greedy(r["model"], a, out.with_name(out.name + "-eval")))
                (root / f"{side}-seed{seed}.json").write_text(json.dumps(r))
    results: dict[str, list[dict]] = {}
    for f in sorted(root.glob("*-seed*.json")):
        r = json.loads(f.read_text())
        results.setdefault(r["side"], []).append(r)
    if not results:
        return
    (root / "parity.json").write_text(json.dumps(results, indent=1))
    target = (statistics.mean(statistics.mean(r["reward"][40:50] or r["reward"][-10:]) for r in results["trl"])
              if "trl" in results else None)
    rows = {side: summary(runs, target) for side, runs in results.items()}
    keys = list(next(iter(rows.values())))
    print("\n| side | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for side, row in rows.items():
        print(f"| {side} | " + " | ".join(row[k] for k in keys) + " |")


if __name__ == "__main__":
    main()
