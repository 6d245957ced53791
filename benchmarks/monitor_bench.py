"""RLMonitor, measured: labelled runs of the tiny models on CPU, every default rule scored on them.

    python -m benchmarks.monitor_bench [--out runs/monitor_bench] [--write-docs] [--only NAME ...]

Healthy runs (GRPO, PPO, DPO at a few seeds and learning rates) and runs with a known failure and the step it
starts at, read from the run itself (the RUNS table says how): a stale decoder weight copy or a NaN injected at
step k with benchmarks.faults; a reward paid per character (answers triple in length); a reward paid per "7" from
the untrained model (entropy 6.2 -> below 0.1 nats); a KL blow-up; held-out degradation without proxy gain (PPO
from the arithmetic chain's SFT model against its RM with no KL and lr 2e-4); over-optimisation of a weak reward
model (PPO without KL against a scalar RM trained 40 steps: its score rises while the verifier's falls, in
training and on held-out problems). Each run writes its metrics.jsonl once (kept in --out with the artifacts it trains against: a
rerun of the benchmark only replays them); the metrics are replayed through a fresh RLMonitor with the default
rules, step by step as the run fed it (an evaluation's metrics with its step's).

For each rule: detections (failure runs where it fired at or after the onset / failure runs), the mean delay
from the labelled onset to its first event, and false alarms per 100 healthy steps. PPO and DPO runs need the
arithmetic chain's sft and rm (`align pipeline run pipelines/arithmetic.toml`, ~7 min). Runs in ~6 min on 2
cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from align.monitor import RLMonitor, default_rules

ROOT = Path(__file__).resolve().parent.parent
SFT, RM = ROOT / "runs/arithmetic/sft", ROOT / "runs/arithmetic/rm"  # pipelines/arithmetic.toml's
DOCS = ROOT / "docs/monitor.md"
BEGIN, END = "<!-- monitor_bench:begin -->", "<!-- monitor_bench:end -->"


def _reward_file(name: str, body: str) -> str:
    f = Path(tempfile.gettempdir()) / f"align-bench-{name}.py"
    f.write_text(f"def {name}(prompt, completion, **row):\n    return {body}\n")
    return f"{f}:{name}"


def grpo(seed: int, lr: float, steps: int = 15, *extra, reward: str = "", model: str = "tiny",
         tokens: int = 12) -> list[str]:
    reward = reward or _reward_file("parity", "float(len(completion) % 2)")
    return ["grpo", "--model", model, "--reward", reward,
            "--data", str(ROOT / "data/arithmetic/train.jsonl"), "--eval-data", "", "--max-steps", str(steps),
            "--prompts-per-step", "4", "--num-generations", "4", "--max-new-tokens", str(tokens), "--seed", str(seed),
            "--lr", str(lr), "--warmup-steps", "0", *extra]


def ppo(seed: int, lr: float, steps: int = 15, *extra, rm: str = str(RM), prompts: int = 16,
        epochs: int = 2) -> list[str]:
    return ["ppo", "--model", str(SFT), "--reward-model", rm, "--max-steps", str(steps), "--seed", str(seed),
            "--lr", str(lr), "--prompts-per-step", str(prompts), "--minibatch-size", str(prompts),
            "--ppo-epochs", str(epochs), "--eval-samples", "100", *extra]


def dpo(seed: int, lr: float, steps: int = 20) -> list[str]:
    return ["dpo", "--model", str(SFT), "--data", str(ROOT / "data/prefs/train.jsonl"), "--eval-data",
            str(ROOT / "data/prefs/test.jsonl"), "--pass-data", "", "--max-steps", str(steps), "--batch-size", "8",
            "--lr", str(lr), "--seed", str(seed), "--eval-every", "5", "--eval-pairs", "64", "--warmup-steps", "0"]


CHAIN_PPO = ["--fixed-kl", "--init-kl-coef", "0.2", "--ptx-coef", "0.5"]  # the arithmetic chain's PPO settings
# name: (failure label or None for healthy, onset step (1-based, as logged), fault, fault step (0-based), args)
RUNS = {
    "grpo-s0-lr5e-5": (None, 0, "none", 0, grpo(0, 5e-5)),
    "grpo-s1-lr5e-5": (None, 0, "none", 0, grpo(1, 5e-5)),
    "grpo-s0-lr2e-4": (None, 0, "none", 0, grpo(0, 2e-4)),
    "grpo-s2-lr2e-4-beta": (None, 0, "none", 0, grpo(2, 2e-4, 15, "--beta", "0.04")),
    "ppo-s0-chain": (None, 0, "none", 0, ppo(0, 3e-5, 15, *CHAIN_PPO)),
    "ppo-s1-chain": (None, 0, "none", 0, ppo(1, 3e-5, 15, *CHAIN_PPO)),
    "dpo-s0-lr1e-4": (None, 0, "none", 0, dpo(0, 1e-4)),
    "dpo-s1-lr5e-5": (None, 0, "none", 0, dpo(1, 5e-5)),
    "grpo-stale-decoder@6": ("stale decoder copy", 6, "stale_decoder", 5, grpo(0, 5e-5)),
    "grpo-nan@6": ("NaN loss", 6, "nan", 5, grpo(1, 5e-5)),
    # per-character pay from the SFT model (answers ~15 tokens, room for 48): length flat to step 19, x3 by step 23
    "grpo-length-reward": ("length-exploitable reward", 20, "none", 0,
                           grpo(0, 1e-3, 40, reward=_reward_file("longer", "len(completion) / 40"), model=str(SFT),
                                tokens=48)),
    # from the untrained model (entropy 6.2 nats) paid per "7": entropy falls from step 12, below 0.1 from step 33
    "grpo-entropy-collapse": ("entropy collapse", 12, "none", 0,
                              grpo(0, 3e-3, 45, reward=_reward_file("sevens", "completion.count('7') / 12"))),
    "grpo-kl-blowup": ("KL blow-up", 1, "none", 0, grpo(0, 3e-3, 15, "--beta", "0.01", "--num-iterations", "2")),
    "ppo-degradation": ("held-out degradation without proxy gain", 1, "none", 0,
                        ["ppo", "--model", str(SFT), "--reward-model", str(RM), "--init-kl-coef", "0", "--fixed-kl",
                         "--ptx-coef", "0", "--lr", "2e-4", "--seed", "11", "--max-steps", "60"]),
    # PPO without KL against a reward model trained 40 steps (held-out pair accuracy 0.63), 4 epochs a batch: from
    # the first updates the RM's score rises (training and held-out) while the verifier's falls (held-out 0.43 -> 0.04)
    "ppo-weak-rm": ("over-optimisation of a weak reward model", 1, "none", 0,
                    ppo(0, 1e-4, 60, "--init-kl-coef", "0", "--fixed-kl", "--ptx-coef", "0", rm="@rm-weak", prompts=32,
                        epochs=4)),
}


# Artifacts that runs train against, trained once into --out like the runs; a run's argument "@NAME" is its path
PREP = {"rm-weak": ["rm", "train", "--model", str(SFT), "--data", str(ROOT / "data/prefs/train.jsonl"), "--eval-data",
                    str(ROOT / "data/prefs/test.jsonl"), "--head", "scalar", "--max-steps", "40", "--batch-size", "16",
                    "--lr", "1e-3", "--seed", "0"]}


def run(name: str, out: Path) -> Path:
    """The run's out directory, trained unless a finished (or monitor-stopped) one is there."""
    label, onset, fault, fault_step, args = RUNS[name]
    args = [str(_train(a[1:], out, "none", 0, PREP[a[1:]])) if a[1:] in PREP and a[0] == "@" else a for a in args]
    return _train(name, out, fault, fault_step, args)


def _train(name: str, out: Path, fault: str, fault_step: int, args: list[str]) -> Path:
    d = out / name
    art = d / "artifact.json"
    if art.is_file() and json.loads(art.read_text()).get("status") in ("complete", "failed", "stopped"):
        return d
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "benchmarks.faults", fault, str(fault_step), *args, "--out", str(d), "--overwrite"]
    print(f"  {name}: {' '.join(cmd[3:])}", flush=True)
    subprocess.run(cmd, cwd=ROOT, env={**env, "COLUMNS": "200"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return d


def replay(d: Path) -> tuple[list, int]:
    """(events, training steps) of a run's metrics replayed through the default rules: one update per step, an
    evaluation's metrics together with its step's (as StageRun feeds them)."""
    by_step: dict[int, dict] = {}
    for line in (d / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(row.pop("step"), {}).update(row)
    m = RLMonitor()
    for step in sorted(by_step):
        m.update(step, by_step[step])
    m.end(max(by_step, default=0))
    return m.events, max(by_step, default=0)


def score(out: Path, names: list[str]) -> tuple[dict, list]:
    """Per rule: detections, delays, false alarms; and per run: the first event of each rule."""
    rules = [r.name for r in default_rules()]
    table = {r: {"detected": 0, "delays": [], "false": 0} for r in rules}
    failures, healthy_steps, runs = 0, 0, []
    for name in names:
        label, onset, *_ = RUNS[name]
        d = out / name
        if not (d / "metrics.jsonl").is_file():
            runs.append((name, label, onset, 0, "did not run"))
            continue
        events, steps = replay(d)
        first = {}
        for e in events:
            first.setdefault(e.rule, e.step)
        runs.append((name, label, onset, steps, ", ".join(f"{r}@{s}" for r, s in first.items()) or "-"))
        if label is None:
            healthy_steps += steps
            for e in events:
                table[e.rule]["false"] += 1
        else:
            failures += 1
            for r, s in first.items():
                if s >= onset:
                    table[r]["detected"] += 1
                    table[r]["delays"].append(s - onset)
    return {"rules": table, "failures": failures, "healthy_steps": healthy_steps}, runs


def render(summary: dict, runs: list) -> str:
    lines = ["| rule | detections (failure runs) | mean delay from onset (steps) | false alarms / 100 healthy steps |",
             "|---|---|---|---|"]
    hs = max(summary["healthy_steps"], 1)
    for rule, t in summary["rules"].items():
        delay = f"{sum(t['delays']) / len(t['delays']):.1f}" if t["delays"] else "-"
        lines.append(f"| `{rule}` | {t['detected']} / {summary['failures']} | {delay} | {100 * t['false'] / hs:.2f} |")
    lines += ["", f"{summary['healthy_steps']} healthy steps. Runs (first event of each rule, at its step):", "",
              "| run | failure (onset step) | steps | events |", "|---|---|---|---|"]
    for name, label, onset, steps, events in runs:
        lines.append(f"| {name} | {f'{label} ({onset})' if label else 'healthy'} | {steps} | {events} |")
    return "\n".join(lines)


def write_docs(text: str) -> None:
    doc = DOCS.read_text()
    if BEGIN not in doc:
        doc = doc.rstrip() + f"\n\n{BEGIN}\n{END}\n"
    head, rest = doc.split(BEGIN, 1)
    DOCS.write_text(f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "runs/monitor_bench"))
    ap.add_argument("--only", nargs="*", default=None, help="run names (default: all)")
    ap.add_argument("--write-docs", action="store_true", help="write the table into docs/monitor.md")
    a = ap.parse_args(argv)
    out, names = Path(a.out), a.only or list(RUNS)
    for name in names:
        if (RUNS[name][4][0] in ("ppo", "dpo") or str(SFT) in RUNS[name][4]) and not (SFT.is_dir() and RM.is_dir()):
            print(f"  {name}: skipped (needs {SFT} and {RM}: align pipeline run)")
            continue
        run(name, out)
    text = render(*score(out, names))
    print(text)
    if a.write_docs:
        write_docs(text)


if __name__ == "__main__":
    main()
