"""How long `align COMMAND --help` takes in a fresh process, and how many lines it prints at 80 columns.

    python -m benchmarks.help_time [--runs 5] [--goal 1.0]

Each command's --help reads its light config module (no torch: tests/test_cli.py checks the imports); the goal
is under 1 s on a slow machine. Prints the median wall time of `--runs` fresh processes per command and exits 1 if
any median is over `--goal` seconds. Measured on 2 shared CPU cores: 0.3-0.45 s each (2.0-2.3 s for `grpo --help`
and `sft --help` when the stage module, and torch with it, was imported for them); `grpo --help` 314 lines (707 in
one flat panel of six columns), `sft --help` 196 (399).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(words: tuple[str, ...], runs: int) -> tuple[float, int]:
    """(the median wall seconds of `runs` fresh `python -m align WORDS --help`, the lines of its output)."""
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(ROOT)}
    times, lines = [], 0
    for _ in range(runs):
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "align", *words, "--help"], capture_output=True, text=True,
                              env=env, cwd=ROOT, check=True)
        times.append(time.perf_counter() - t)
        lines = len(proc.stdout.splitlines())
    return statistics.median(times), lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--goal", type=float, default=1.0, help="seconds a command's --help may take (median)")
    a = ap.parse_args()
    from align import registry

    slow = []
    for cmd in registry.COMMANDS:
        seconds, lines = measure(cmd.words, a.runs)
        print(f"align {' '.join(cmd.words):<12} --help  {seconds:5.2f} s  {lines:4d} lines")
        if seconds > a.goal:
            slow.append(cmd.words)
    return 1 if slow else 0


if __name__ == "__main__":
    sys.exit(main())
