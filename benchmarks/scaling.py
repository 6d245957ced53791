"""Throughput and memory of a training stage on 1 process and on N processes (ZeRO-3), one table.

    python -m benchmarks.scaling --stage sft --preset small --steps 60 --batch-size 128 --nproc 1,2
    python -m benchmarks.scaling --stage rm  --preset small --steps 60 --batch-size 64 --nproc 1,2
    python -m benchmarks.scaling --stage dpo --preset small --steps 60 --batch-size 64 --nproc 1,2
    python -m benchmarks.scaling --stage ppo --preset small --steps 6 --batch-size 64 --nproc 1,2
    python -m benchmarks.scaling --stage grpo --preset small --steps 6 --batch-size 16 --nproc 1,2

Each run is a real `align <stage>` (subprocess); numbers come from its artifact.json: training tokens/s
(evaluation excluded; SFT: prompt + completion tokens; RM/DPO: tokens through the policy per pair, i.e. the
prompt twice + chosen + rejected + 2 EOS, measured on the data with the model's tokenizer), peak GPU memory
per rank (torch max_memory_allocated; on CPU the process RSS), and the final loss.

RL stages (ppo, grpo): --batch-size is the prompts per step (GRPO: x --num-generations 8 completions); the table
is the median step (steps 2..N: step 1 includes compiling the decoder) split into generation / reward /
scoring (π_old, π_ref, values: PPO; log-probs: GRPO) / update, generated tokens per second over the whole step,
and peak memory per rank. PPO needs a reward model: a short `align rm train` on the same preset is made first
(its quality does not matter for speed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


STAGE_ARGS = {
    "sft": (["sft"], ["--eval-every", "0", "--eval-samples", "64"]),
    "rm": (["rm", "train"], ["--eval-every", "0", "--normalize-samples", "64"]),
    "dpo": (["dpo"], ["--eval-every", "0", "--eval-pairs", "64", "--eval-samples", "16"]),
}
RL_ARGS = {
    "ppo": (["ppo"], ["--eval-data", "", "--max-new-tokens", "48"]),
    "grpo": (["grpo"], ["--eval-data", "", "--max-new-tokens", "48", "--num-generations", "8",
                        "--reward", "benchmarks/bench_reward.py:noise"]),  # a preset solves nothing: no signal
}
RL_PHASES = ["time/generate", "time/reward", "time/score", "time/logprobs", "time/update"]


def tokens_per_pair(data: str) -> float:
    from align import data as D
    from align.models import load_tokenizer, resolve

    tok = load_tokenizer(resolve("tiny"))
    rows = D.load_rows(data, "preference")[:2000]
    p = D.encode_prompts(tok, [r["prompt"] for r in rows])
    c = D.encode_completions(tok, [r["chosen"] for r in rows])
    r = D.encode_completions(tok, [r["rejected"] for r in rows])
    return sum(2 * len(a) + len(b) + len(d) for a, b, d in zip(p, c, r)) / len(rows)


def run_align(cmd: list[str], out: Path) -> dict:
    """Run one `align` command (exit on failure, with its output) and return its artifact.json."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return json.loads((out / "artifact.json").read_text())


def run_stage(stage: str, preset: str, steps: int, batch: int, nproc: int, out: Path, extra: list[str]) -> dict:
    words, defaults = STAGE_ARGS[stage]
    cmd = [sys.executable, "-m", "align", *words, "--model", preset, "--max-steps", str(steps),
           "--batch-size", str(batch), *defaults, "--nproc", str(nproc), "--out", str(out), "--overwrite", *extra]
    t = time.time()
    art = run_align(cmd, out)
    m = art["metrics"]
    if "tokens_per_s" in m:
        tps = m["tokens_per_s"]
    else:  # preference stages report pairs/s
        tps = m["pairs_per_s"] * tokens_per_pair(art["config"]["data"])
    return {"nproc": nproc, "cmd": " ".join(cmd[1:]), "tokens_per_s": tps, "peak_gib": m["peak_memory_gib_per_rank"],
            "loss": m["train/loss"], "params": m.get("parameters"), "train_s": m["train_seconds"],
            "wall_s": round(time.time() - t, 1)}


def run_rl(stage: str, preset: str, steps: int, batch: int, nproc: int, out: Path, extra: list[str]) -> dict:
    import statistics

    words, defaults = RL_ARGS[stage]
    cmd = [sys.executable, "-m", "align", *words, "--model", preset, "--max-steps", str(steps),
           "--prompts-per-step", str(batch), *defaults, "--nproc", str(nproc), "--out", str(out), "--overwrite",
           *extra]
    if stage == "ppo" and "--reward-model" not in extra:
        rm = out.parent / f"rm-{preset}"
        if not (rm / "artifact.json").exists():
            subprocess.run([sys.executable, "-m", "align", "rm", "train", "--model", preset, "--max-steps", "5",
                            "--batch-size", "16", "--eval-every", "0", "--normalize-samples", "16", "--out", str(rm)],
                           check=True, capture_output=True)
        cmd += ["--reward-model", str(rm)]
    t = time.time()
    art = run_align(cmd, out)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/generate" in r]
    rows = rows[1:] if len(rows) > 1 else rows  # step 1 compiles the fast decoder
    med = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in RL_PHASES}
    step = sum(med.values())
    n_gen = batch * art["config"].get("num_generations", 1)  # GRPO: G completions per prompt
    tokens = statistics.median(r["completions/mean_length"] for r in rows) * n_gen
    return {"nproc": nproc, "cmd": " ".join(cmd[1:]), "tokens_per_s": tokens / step, "step_s": step, **med,
            "peak_gib": art["metrics"]["peak_memory_gib_per_rank"], "wall_s": round(time.time() - t, 1)}


def rl_table(a, rows: list[dict]) -> None:
    base = rows[0]["tokens_per_s"]
    print(f"\n{a.stage} {a.preset}, {a.steps} steps, {a.batch_size} prompts per step; median of steps 2..{a.steps}")
    print("| GPUs | step s | generate | reward | score/log-probs | update | gen. tokens/s | vs 1 | peak GiB per rank |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        peaks = ", ".join(f"{p:.2f}" for p in r["peak_gib"])
        print(f"| {r['nproc']} | {r['step_s']:.3f} | {r['time/generate']:.3f} | {r['time/reward']:.3f} | "
              f"{r['time/score'] + r['time/logprobs']:.3f} | {r['time/update']:.3f} | {r['tokens_per_s']:,.0f} | "
              f"{r['tokens_per_s'] / base:.2f} | {peaks} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", default="sft", choices=sorted({**STAGE_ARGS, **RL_ARGS}))
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--nproc", default="1,2")
    ap.add_argument("--out", default="")
    ap.add_argument("--json", default="", help="also write the rows to this JSON file")
    ap.add_argument("extra", nargs="*", help="extra flags passed to align sft")
    a = ap.parse_args()
    root = Path(a.out or tempfile.mkdtemp(prefix="align-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    if a.stage in RL_ARGS:
        rows = [run_rl(a.stage, a.preset, a.steps, a.batch_size, int(n), root / f"{a.stage}-n{n}", a.extra)
                for n in a.nproc.split(",")]
        rl_table(a, rows)
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=2))
        return
    rows = [run_stage(a.stage, a.preset, a.steps, a.batch_size, int(n), root / f"{a.stage}-n{n}", a.extra)
            for n in a.nproc.split(",")]
    base = rows[0]["tokens_per_s"]
    params = f"{rows[0]['params'] / 1e6:.1f}M params" if rows[0]["params"] else "params n/a"
    print(f"\n{a.stage} {a.preset} ({params}), {a.steps} steps, global batch {a.batch_size}")
    print(f"{'procs':>5} {'tokens/s':>10} {'speed-up':>8} {'peak GiB per rank':>22} {'loss':>7} {'train s':>8}")
    for r in rows:
        peaks = ", ".join(f"{p:.2f}" for p in r["peak_gib"])
        print(f"{r['nproc']:>5} {r['tokens_per_s']:>10.0f} {r['tokens_per_s'] / base:>8.2f} {peaks:>22} "
              f"{r['loss']:>7.4f} {r['train_s']:>8.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
