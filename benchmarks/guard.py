"""GPU speed guard: rerun the shapes of the stored baselines on this GPU and fail on a slowdown.

    python -m benchmarks.guard                 # every shape; exit 1 when a phase is slower than its baseline
    python -m benchmarks.guard --only grpo-qwen2.5-1.5b --tolerance 0.05
    python -m benchmarks.guard --update        # measure and store the figures as the new baselines
    python -m benchmarks.guard --against /tmp/old   # the code before a change, run just before, as the baseline
    python -m benchmarks.guard --against /tmp/old --repeat 3   # the two trees alternated 3 times, medians compared

CI has no GPU: run this on a lent machine before merging a change to a hot path (the decoder, the update, the
engine), and after it, back to back. A baseline is `benchmarks/baselines/SHAPE.json`: the harness command, the
commit, the card, the date and the metrics (each phase's median seconds per step, peak GiB). A phase slower than
baseline × (1 + --tolerance), or a peak above baseline × (1 + --memory-tolerance), fails the shape; a baseline
taken on another card is not compared (it says so). The harnesses are the *_vs_trl scripts (ours only) and
benchmarks.ppo_speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BASELINES = Path(__file__).resolve().parent / "baselines"
# shape: (harness module, its arguments, the JSON it writes, the key of our result in it, the metrics compared)
SHAPES = {
    "grpo-qwen2.5-1.5b": ("benchmarks.grpo_vs_trl", ["--models", "qwen2.5-1.5b", "--steps", "4", "--only", "ours"],
                          "grpo_vs_trl.json", "ours-qwen2.5-1.5b",
                          ["time/generate", "time/reward", "time/logprobs", "time/update", "time/step", "peak_gib"]),
    # completions of ragged lengths (the random model stops after half the budget on average: vs_trl.ragged), padded and
    # padding-free (--packing: varlen attention on a GPU)
    "grpo-qwen2.5-1.5b-ragged": ("benchmarks.grpo_vs_trl", ["--models", "qwen2.5-1.5b", "--steps", "4", "--only", "ours",
                                                            "--ragged"], "grpo_vs_trl.json", "ours-qwen2.5-1.5b",
                                 ["time/generate", "time/logprobs", "time/update", "time/step", "peak_gib"]),
    "grpo-qwen2.5-1.5b-ragged-packed": ("benchmarks.grpo_vs_trl", ["--models", "qwen2.5-1.5b", "--steps", "4", "--only",
                                                                   "ours", "--ragged", "--ours-extra=--packing"],
                                        "grpo_vs_trl.json", "ours-qwen2.5-1.5b",
                                        ["time/generate", "time/logprobs", "time/update", "time/step", "peak_gib"]),
    "dpo-0.5b": ("benchmarks.dpo_vs_trl", ["--models", "0.5b", "--steps", "6", "--only", "ours"], "dpo_vs_trl.json",
                 "ours-0.5b", ["time/step", "peak_gib"]),
    "ppo-0.5b": ("benchmarks.ppo_speed", ["--models", "0.5b", "--steps", "4"], "ppo_speed.json", "ours-0.5b",
                 ["time/generate", "time/reward", "time/score", "time/update", "time/step", "peak_gib"]),
}
SMALL = 0.02  # seconds: a phase this short is compared with this much slack besides the tolerance (timer noise)


def compare(base: dict, now: dict, tolerance: float, memory_tolerance: float) -> list[tuple[str, float, float, bool]]:
    """(metric, baseline, measured, within the tolerance) for each metric of `base`: seconds may grow by
    `tolerance` (relative; + SMALL seconds for phases of a few milliseconds), peak memory by `memory_tolerance`."""
    rows = []
    for k, b in base.items():
        v = now.get(k)
        if v is None:
            rows.append((k, b, float("nan"), False))
            continue
        limit = b * (1 + memory_tolerance) if k == "peak_gib" else b * (1 + tolerance) + (SMALL if b < 10 * SMALL else 0)
        rows.append((k, b, v, v <= limit))
    return rows


def median_metrics(runs: list[dict]) -> dict:
    """Each metric's median over `runs` (the metrics of repeated harness runs; a metric missing in a run is
    missing in the result)."""
    import statistics

    keys = set.intersection(*(set(r) for r in runs)) if runs else set()
    return {k: statistics.median(r[k] for r in runs) for k in sorted(keys)}


def measure(shape: str, tree: Path | None = None) -> tuple[dict, str]:
    """Run the shape's harness (ours only) and return (its metrics, the command); `tree`: in that copy of the
    repository (its code first on the path) instead of this one."""
    import os

    module, args, js, key, metrics = SHAPES[shape]
    out = Path(tempfile.mkdtemp(prefix=f"align-guard-{shape}-"))
    cmd = [sys.executable, "-m", module, *args, "--out", str(out)]
    here = tree or Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), *filter(None, [os.environ.get("PYTHONPATH")])])}
    print(f"[{shape}{f' in {tree}' if tree else ''}] {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, check=True, cwd=here, env=env)
    res = json.loads((out / js).read_text())["results"].get(key)
    if not res:
        raise SystemExit(f"[{shape}] the harness gave no result for {key}: see the logs under {out}")
    shutil.rmtree(out, ignore_errors=True)  # its models and checkpoints: a few runs of them fill a small disk
    got = {k: float(res[k]) for k in metrics if res.get(k) is not None}
    print(f"[{shape}{' before' if tree else ''}] {json.dumps(got)}", flush=True)  # each run's figures as they come
    return got, " ".join(["python", *cmd[1:-2]])


def card() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def commit() -> str:
    """GUARD_COMMIT (a lent machine's copy of the tree may carry a stale or no git history), else the checkout's."""
    import os

    if os.environ.get("GUARD_COMMIT"):
        return os.environ["GUARD_COMMIT"]
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           cwd=Path(__file__).resolve().parent.parent)
        sha = r.stdout.strip() if r.returncode == 0 else ""
    except OSError:
        sha = ""
    return sha or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description="GPU speed guard: the baselines' shapes rerun and compared.")
    ap.add_argument("--only", default="", help=f"shapes, comma-separated (default: all of {', '.join(SHAPES)})")
    ap.add_argument("--tolerance", type=float, default=0.03, help="a phase may be this much slower (relative)")
    ap.add_argument("--memory-tolerance", type=float, default=0.01, help="peak memory may be this much higher")
    ap.add_argument("--update", action="store_true", help="store the measured figures as the baselines")
    ap.add_argument("--against", default="", help="a copy of the code before a change (a checkout or an unpacked "
                    "`git archive`): each shape runs there first, then here, back to back, and is compared with "
                    "that run instead of the stored baseline (figures of another day or machine differ by more "
                    "than the tolerance)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each shape (with --against: the two trees "
                    "alternated); each metric's median is compared")
    a = ap.parse_args()
    shapes = [s for s in a.only.split(",") if s] or list(SHAPES)
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    here, failed, lines = card(), [], []
    for shape in shapes:
        path = BASELINES / f"{shape}.json"
        base = json.loads(path.read_text()) if path.exists() else None
        before, after = [], []
        for _ in range(a.repeat):  # alternated, so that a drift of the machine falls on both alike
            if a.against:
                before.append(measure(shape, Path(a.against).resolve())[0])
            m, cmd = measure(shape)
            after.append(m)
        if a.against:
            base = {"card": here, "metrics": median_metrics(before)}
        now = median_metrics(after)
        if base and base["card"] == here:
            for k, b, v, ok in compare(base["metrics"], now, a.tolerance, a.memory_tolerance):
                lines.append(f"| {shape} | {k} | {b:.3f} | {v:.3f} | {v / b if b else float('nan'):.3f} | "
                             f"{'ok' if ok else '**SLOWER**'} |")
                if not ok:
                    failed.append(f"{shape} {k}")
        else:
            why = f"its baseline is from {base['card']}" if base else "no baseline yet"
            lines.append(f"| {shape} | – | – | – | – | not compared: {why} |")
        if a.update:
            BASELINES.mkdir(exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"shape": shape, "command": cmd, "commit": commit(), "card": here,
                                       "date": datetime.date.today().isoformat(), "metrics": now}, indent=1) + "\n")
            tmp.replace(path)
    against = f", against {a.against} run just before" if a.against else ""
    against += f", medians of {a.repeat} runs" if a.repeat > 1 else ""
    print(f"\n### GPU speed guard on {here} at {commit()}{against} (tolerance {a.tolerance:.0%} on time, "
          f"{a.memory_tolerance:.0%} on memory)\n| shape | metric | baseline | now | now / baseline | |\n|---|---|---|---|---|---|")
    print("\n".join(lines))
    if a.update:
        print(f"baselines written: {', '.join(shapes)}")
    if failed:
        print(f"slower than the baselines: {', '.join(failed)}", file=sys.stderr)
        if not a.update:
            sys.exit(1)


if __name__ == "__main__":
    main()
