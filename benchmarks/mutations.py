"""Mutation check of the objectives and the monitor: do the tests fail when the math is wrong?

Each mutation below changes one line of align/objectives/*, align/rl.py, align/losses.py or align/monitor.py (drop
GAE's λ, flip a sign, drop GSPO's 1/|y|, let skipped samples into REINFORCE++'s statistics, move a monitor
threshold, drop an eps, ...). It is applied to a temporary copy of the repository (never to this checkout), the
test files it names run there (`pytest -x -q -n 0 FILES`), and the mutation is caught when they fail. A snippet
that no longer matches its file exactly once stops the script (exit 2): keep the list in step with the code.

    python -m benchmarks.mutations            # every mutation; prints the table, exit 1 if any survives
    python -m benchmarks.mutations -k gspo    # those whose name contains "gspo"

Not part of the test suite (a few minutes on 2 cores): run it after changing an objective, a monitor check or
their tests.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
from benchmarks.mutants import Mutation, all_mutations


def copy_repo(dst: Path) -> None:
    """The repository's tracked and untracked-but-not-ignored files, copied to `dst`."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def check_snippets(mutations: list[Mutation]) -> None:
    """Every snippet occurs exactly once in its file (exit 2 naming the ones that do not)."""
    bad = [f"{m.name}: {m.file} holds its snippet {(ROOT / m.file).read_text().count(m.original)} times, not once"
           for m in mutations if (ROOT / m.file).read_text().count(m.original) != 1]
    if bad:
        sys.exit("mutations out of step with the code:\n  " + "\n  ".join(bad))


def run_tests(root: Path, tests: tuple[str, ...]) -> bool:
    """Whether the tests pass in the copy at `root`."""
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider", *tests]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, timeout=600).returncode == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", default="", help="only the mutations whose name contains this")
    args = ap.parse_args()
    mutations = [m for m in all_mutations() if args.k in m.name]
    check_snippets(mutations)
    with tempfile.TemporaryDirectory(prefix="align-mutations-") as tmp:
        root = Path(tmp)
        copy_repo(root)
        baseline = tuple(sorted({t for m in mutations for t in m.tests}))
        if not run_tests(root, baseline):
            sys.exit(f"the tests fail without any mutation: {' '.join(baseline)}")
        rows, survived = [], 0
        for m in mutations:
            path = root / m.file
            original = path.read_text()
            path.write_text(original.replace(m.original, m.replacement))
            t = time.time()
            caught = not run_tests(root, m.tests)
            path.write_text(original)
            survived += not caught
            rows.append(f"| {m.name.replace('|', chr(92) + '|')} | {m.file} | {' '.join(Path(x).name for x in m.tests)} | "
                        f"{'caught' if caught else '**SURVIVED**'} | {time.time() - t:.0f} |")
    print("| mutation | file | tests | result | s |\n|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\n{len(mutations) - survived} of {len(mutations)} mutations caught"
          f"{f', {survived} survived' if survived else ''}.")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
