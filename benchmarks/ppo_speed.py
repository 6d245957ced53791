"""PPO-ptx speed at a fixed shape, ours only: the guard's PPO harness (`benchmarks.guard`, shape ppo-0.5b).

    python -m benchmarks.ppo_speed --models 0.5b --steps 4 [--prompts 32 --max-new-tokens 256]

A random-weight model of the named config (benchmarks/vs_trl.py MODELS) is the policy; a one-step `align rm train`
on the shipped pairs from that same model is the reward model (and so the value network's start). `align ppo`
then runs its four models on one GPU with the defaults except the batch shape and a tiny learning rate
(1e-8 for policy and value: the updates run in full, but a random policy stays near-uniform over its vocabulary,
so it rarely samples EOS and every step generates the whole --max-new-tokens: a fixed amount of work per step,
which a speed guard needs). The table: the median of each phase over steps 2..N (step 1 compiles).

TRL's PPOTrainer is not run here: its four-model loop takes a reward model in another form (no normalisation,
no separate value initialisation from it), so a same-shape comparison would compare different algorithms.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import vs_trl as V

PHASES = ["time/generate", "time/reward", "time/score", "time/update"]


def rm_command(model: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "align", "rm", "train", "--model", str(model), "--out", str(out), "--overwrite",
            "--eval-data", "", "--max-steps", "1", "--batch-size", "16", "--micro-batch-size", "16",
            "--no-final-checkpoint"]


def ppo_command(model: Path, rm: Path, out: Path, a) -> list[str]:
    return [sys.executable, "-m", "align", "ppo", "--model", str(model), "--reward-model", str(rm), "--out", str(out),
            "--overwrite", "--eval-data", "", "--eval-samples", "0", "--max-steps", str(a.steps),
            "--prompts-per-step", str(a.prompts), "--minibatch-size", str(min(a.prompts, 32)), "--max-new-tokens", str(a.max_new_tokens), "--lr", "1e-8",
            "--vf-lr", "1e-8", "--no-final-checkpoint", *a.ours_extra.split()]


def ours(model: Path, root: Path, name: str, a) -> dict | None:
    rm = root / f"rm-{name}"
    if not (rm / "artifact.json").exists() and not V.run(rm_command(model, rm), root / f"rm-{name}.log"):
        return None
    out = root / f"ours-ppo-{name}"
    cmd = ppo_command(model, rm, out, a)
    if not V.run(cmd, out.parent / (out.name + ".log")):
        return None
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/update" in r]
    art = json.loads((out / "artifact.json").read_text())
    med = V.median_rows(rows, PHASES + ["time/step", "completions/mean_length"])
    return {**med, "peak_gib": max(art["metrics"]["peak_memory_gib_per_rank"]), "cmd": " ".join(cmd)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    V.harness_args(ap, models="0.5b", steps=4)
    ap.add_argument("--prompts", type=int, default=32, help="prompts per PPO step")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    a = ap.parse_args()
    if a.only == "trl":
        ap.error("this harness runs ours only (see its docstring)")
    root = V.out_root(a.out, "align-ppo-speed-")
    results, report = {}, []
    for name in a.models.split(","):
        o = ours(V.make_model(name, root), root, name, a)
        results[f"ours-{name}"] = o
        g = lambda k: V.fmt(None if o is None else o.get(k))  # noqa: E731
        report += [f"\n### PPO-ptx {name}: {a.prompts} prompts x {a.max_new_tokens} new tokens, four models, 1 GPU; "
                   f"median of steps 2..{a.steps}", "| phase | seconds |", "|---|---|",
                   *[f"| {k.split('/')[1]} | {g(k)} |" for k in PHASES + ["time/step"]],
                   f"| mean completion length | {g('completions/mean_length')} |",
                   f"| peak GPU memory (GiB) | {V.fmt(None if o is None else o.get('peak_gib'), '.2f')} |"]
    V.write_json(root / "ppo_speed.json", {"results": results, "argv": sys.argv})
    print("\n".join(report))


if __name__ == "__main__":
    main()
