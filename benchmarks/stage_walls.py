"""CPU stage walls of the default chain: two copies of the code, run alternately, each stage's wall compared.

    python -m benchmarks.stage_walls --before /tmp/old --runs 3      # /tmp/old: a checkout or unpacked `git archive`

Each run is `align pipeline run pipelines.toml` from scratch (a fresh out directory) in that tree, its code first
on the path; the trees alternate (before, after, before, ...) so that a drift of the machine falls on both alike.
Prints, per stage, each tree's median and spread (min-max) over the runs and whether the after tree's slowest run
is above the before tree's slowest (a stage is "slower" only when its whole spread moved up: the walls of one
2-core machine move by several per cent from run to run). Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
RUN = ("import json, sys; from align import pipeline as P; "
       "rs = P.run('pipelines.toml', echo=lambda *a, **k: None, overrides=['pipeline.out=' + sys.argv[1]]); "
       "print('WALLS ' + json.dumps({r.name: [r.status, r.seconds] for r in rs}))")


def one_run(tree: Path, out: Path) -> dict[str, float]:
    """{stage: wall seconds} of one default chain in `tree` writing to `out`; exits when a stage did not run."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
    p = subprocess.run([sys.executable, "-c", RUN, str(out)], cwd=tree, env=env, capture_output=True, text=True)
    line = next((x for x in p.stdout.splitlines() if x.startswith("WALLS ")), None)
    if p.returncode or line is None:
        raise SystemExit(f"the chain in {tree} failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    walls = json.loads(line[6:])
    bad = {k: v[0] for k, v in walls.items() if v[0] != "ran"}
    if bad:
        raise SystemExit(f"the chain in {tree}: stages that did not run from scratch: {bad}")
    return {k: v[1] for k, v in walls.items()}


def compare(before: list[dict], after: list[dict]) -> list[tuple[str, list[float], list[float], bool]]:
    """(stage, before's walls, after's walls, slower): slower when after's fastest run is above before's
    slowest, i.e. the spreads do not overlap and after's lies above. The sum of the stages is the last row."""
    rows = []
    for stage in [*before[0], "sum"]:
        b = [sum(r.values()) if stage == "sum" else r[stage] for r in before]
        a = [sum(r.values()) if stage == "sum" else r[stage] for r in after]
        rows.append((stage, b, a, min(a) > max(b)))
    return rows


def table(rows, names=("before", "after")) -> str:
    fmt = lambda xs: f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"  # noqa: E731
    out = [f"| stage | {names[0]} median (min-max) s | {names[1]} median (min-max) s | after / before | slower |",
           "|---|---|---|---|---|"]
    for stage, b, a, slower in rows:
        out.append(f"| {stage} | {fmt(b)} | {fmt(a)} | {statistics.median(a) / statistics.median(b):.3f} | "
                   f"{'**yes**' if slower else 'no'} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the tree before the change (a checkout or unpacked archive)")
    ap.add_argument("--after", default=str(HERE), help="the tree after it (default: this checkout)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default="", help="also write every run's walls here")
    a = ap.parse_args()
    trees = {"before": Path(a.before).resolve(), "after": Path(a.after).resolve()}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    root = Path(tempfile.mkdtemp(prefix="align-stage-walls-"))
    for i in range(a.runs):
        for name, tree in trees.items():
            out = root / f"{name}-{i}"
            runs[name].append(one_run(tree, out))
            shutil.rmtree(out, ignore_errors=True)
            print(f"[{name} {i + 1}/{a.runs}] " + " ".join(f"{k} {v:.1f}" for k, v in runs[name][-1].items())
                  + f" | sum {sum(runs[name][-1].values()):.1f}", flush=True)
    rows = compare(runs["before"], runs["after"])
    print(table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps({"trees": {k: str(v) for k, v in trees.items()}, "runs": runs}, indent=1))
    sys.exit(1 if any(slower for *_, slower in rows) else 0)


if __name__ == "__main__":
    main()
