"""Mutation benchmark: do the tests fail when the code is wrong?

Each mutation (benchmarks/mutants/: the formulas of align/objectives and RLMonitor's
checks; the wiring of each stage to them) changes one snippet of one file: drop GAE's λ, flip a sign, use the
policy as its own reference, detach a loss term, count the prompt in a length, shuffle every epoch alike, ... It is
applied to a temporary copy of the repository (never to this checkout), the tests it names run there (`pytest -x -q
-n 0 TESTS`), and the mutation is caught when they fail. A snippet that no longer matches its file exactly once stops
the script (exit 2): keep the lists in step with the code.

    python -m benchmarks.mutations            # every mutation; prints the table, exit 1 if any survives
    python -m benchmarks.mutations -k gspo    # those whose name contains "gspo"
    python -m benchmarks.mutations --jobs 1   # one at a time (default: one per core, at most 4)
    python -m benchmarks.mutations --mutants FILE.py   # the list MUTATIONS of another file (e.g. an audit's)
    ALIGN_SUITE_RECORD=DIR python -m pytest -q && python -m benchmarks.mutations --after-suite DIR   # CI

CI runs it after the test suite (.ci/run; a few minutes on 2 cores), with --after-suite: the suite's run has just
shown every named test passing unmutated, so the benchmark does not run them once more first. Each mutation's
tests run in a process forked from this one after it imported torch, transformers, deepspeed, pytest and every
other module the unmutated tests imported (never align, stages or tests: those are imported in the child, from the
mutated copy), so a mutation costs its tests' own time, not an interpreter's start.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `python benchmarks/mutations.py` as well as `python -m benchmarks.mutations`

from benchmarks.mutants import Mutation, all_mutations  # noqa: E402

TIMEOUT_S = 300  # one mutation's tests (--timeout); past it the mutation is not counted as caught: name faster tests
BASELINE_TIMEOUT_S = 3600  # every named test, unmutated, in one process
# Imported once here, before any fork: what every test process imports first (~3.5 s of CPU each time otherwise).
PRELOAD = ("torch", "transformers", "deepspeed", "safetensors.torch", "peft", "pytest", "xdist",
           "transformers.models.llama.modeling_llama")
OWN = ("align", "stages", "tests", "benchmarks")  # imported in each child, from its copy


def copy_repo(dst: Path) -> None:
    """The repository's tracked and untracked-but-not-ignored files, copied to `dst`."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def load_list(path: str) -> list[Mutation]:
    """The list MUTATIONS of the Python file at `path`."""
    import runpy

    return list(runpy.run_path(path)["MUTATIONS"])


def check_snippets(mutations: list[Mutation]) -> None:
    """Every snippet occurs exactly once in its file, every name once (exit 2 naming the ones that do not)."""
    bad = []
    for m in mutations:
        path = ROOT / m.file
        n = path.read_text().count(m.original) if path.is_file() else 0
        if n != 1:
            bad.append(f"{m.name}: {m.file} holds its snippet {n} times, not once")
    names = [m.name for m in mutations]
    bad += [f"{n}: named {names.count(n)} times" for n in sorted(set(names)) if names.count(n) > 1]
    if bad:
        sys.exit("mutations out of step with the code:\n  " + "\n  ".join(bad))


def baseline_parts(tests: list[str], n: int) -> list[tuple[str, ...]]:
    """The unmutated tests in at most `n` parts of whole test files (a file's module fixtures are built once), the
    files dealt in turn to the part with the fewest tests so far."""
    by_file: dict[str, list[str]] = {}
    for t in tests:
        by_file.setdefault(t.split("::")[0], []).append(t)
    parts: list[list[str]] = [[] for _ in range(max(1, min(n, len(by_file))))]
    for f in sorted(by_file, key=lambda f: -len(by_file[f])):
        min(parts, key=len).extend(by_file[f])
    return [tuple(p) for p in parts]


def preload(names: list[str]) -> int:
    """Import here, before the mutations' forks, every module the unmutated tests imported that is not the
    project's own (transformers' lazily loaded model and tokenizer classes, safetensors, datasets, ...): each child
    then pays only for align, stages and tests. Returns how many were imported."""
    n = 0
    for name in names:
        if name.split(".")[0] in OWN or name.startswith("__") or name in sys.modules:
            continue
        try:
            __import__(name)
            n += 1
        except Exception:  # noqa: BLE001 — a module that cannot be imported on its own is imported by the tests
            pass
    return n


def unmutated_pass(slots: list["Slot"], tests: list[str], tmp: Path) -> list[str]:
    """Every named test, unmutated, in a share of the test files per slot (exit when one fails), each slot's
    process recording what passed and what it imported as the suite does (ALIGN_SUITE_RECORD); returns the
    modules, for preload()."""
    failed = []
    os.environ["ALIGN_SUITE_RECORD"] = str(tmp / "record")
    run_all(slots, [(None, part) for part in baseline_parts(tests, len(slots))],
            lambda m, code, s, log: failed.append(log) if code != 0 else None, BASELINE_TIMEOUT_S)
    del os.environ["ALIGN_SUITE_RECORD"]
    if failed:
        print(failed[0][-6000:], file=sys.stderr)
        sys.exit("the tests fail without any mutation (output above)")
    return suite_passed(tests, tmp / "record")


def suite_passed(tests: list[str], record: Path) -> list[str]:
    """What a test run under ALIGN_SUITE_RECORD=`record` wrote (tests/conftest.py): every named test (a node id; a
    file or a parametrized test: some of its tests) must have passed there, else it stops, naming those that did
    not (renamed, skipped, deselected). Returns the modules its processes imported, for preload()."""
    runs = [json.loads(f.read_text()) for f in sorted(record.glob("*.json"))]
    if not runs:
        sys.exit(f"--after-suite {record}: no record of a suite run there (run pytest with ALIGN_SUITE_RECORD={record})")
    passed = {t for r in runs for t in r["passed"]}
    named = passed | {t.split("::")[0] for t in passed} | {t.split("[")[0] for t in passed}  # a file, a test's params
    missing = [t for t in tests if t not in named]
    if missing:
        sys.exit("named tests that did not pass in the suite run:\n  " + "\n  ".join(missing))
    return sorted({m for r in runs for m in r["modules"]})


def _child(root: Path, tests: tuple[str, ...], log: Path) -> None:
    """In the forked process: pytest on `tests` in the copy at `root`; never returns."""
    code = 3
    try:
        os.setpgid(0, 0)  # its own group: a timeout kills what its tests started too
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        for name in [n for n in sys.modules if n.split(".")[0] in OWN]:
            del sys.modules[name]
        os.chdir(root)
        sys.path[:] = [str(root)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT]
        os.environ.update(PYTHONPATH=str(root), OMP_NUM_THREADS="1", ALIGN_TEST_FORKSERVER="lazy")
        sys.argv = ["pytest"]
        import pytest

        code = int(pytest.main(["-x", "-q", "-n", "0", "-p", "no:cacheprovider", *tests]))
    except BaseException:  # noqa: BLE001 — whatever happened, the parent reads an exit code
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class Slot:
    """One copy of the repository and the mutation whose tests run in it."""

    def __init__(self, root: Path):
        self.root, self.pid, self.m, self.saved, self.t = root, 0, None, "", 0.0

    def start(self, m: Mutation | None, tests: tuple[str, ...]) -> None:
        self.m, self.t = m, time.time()
        if m is not None:
            path = self.root / m.file
            self.saved = path.read_text()
            path.write_text(self.saved.replace(m.original, m.replacement))
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            _child(self.root, tests, self.root / ".mutation.log")

    def finish(self) -> None:
        if self.m is not None:
            (self.root / self.m.file).write_text(self.saved)
        self.pid = 0

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_all(slots: list[Slot], jobs: list[tuple[Mutation | None, tuple[str, ...]]], on_done,
            timeout: float = TIMEOUT_S) -> None:
    """Run every (mutation, tests) job on the free slots; on_done(mutation, exit code or None on a timeout, s, log)."""
    pending, busy = list(jobs), {}
    while pending or busy:
        while pending and len(busy) < len(slots):
            slot = next(s for s in slots if not s.pid)
            slot.start(*pending.pop(0))
            busy[slot.pid] = slot
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            for slot in busy.values():
                if time.time() - slot.t > timeout:
                    slot.kill()
            time.sleep(0.05)
            continue
        slot = busy.pop(pid, None)
        if slot is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        timed_out = time.time() - slot.t > timeout
        log = (slot.root / ".mutation.log").read_text(errors="replace")
        m, seconds = slot.m, time.time() - slot.t
        slot.finish()
        on_done(m, None if timed_out else code, seconds, log)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", default="", help="only the mutations whose name contains this")
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="mutations run at once")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds one mutation's tests may take "
                                                                      "(past it: not caught)")
    ap.add_argument("--after-suite", default="", metavar="DIR",
                    help="the suite has just passed with ALIGN_SUITE_RECORD=DIR: no unmutated pass of the named tests")
    ap.add_argument("--mutants", default="", help="a Python file whose list MUTATIONS (of benchmarks.mutants.Mutation) "
                                                  "is run instead of the benchmark's")
    args = ap.parse_args()
    mutations = [m for m in (load_list(args.mutants) if args.mutants else all_mutations()) if args.k in m.name]
    if not mutations:
        sys.exit(f"no mutation's name contains {args.k!r}")
    check_snippets(mutations)
    t0 = time.time()
    # one thread per process: the tests' processes run `--jobs` at a time (OpenMP reads this when torch loads)
    os.environ["OMP_NUM_THREADS"] = "1"
    for name in PRELOAD:
        __import__(name)
    with tempfile.TemporaryDirectory(prefix="align-mutations-") as tmp:
        slots = [Slot(Path(tmp) / f"copy{i}") for i in range(max(1, args.jobs))]
        for s in slots:
            copy_repo(s.root)
        # unmutated first: every test a mutation names passes (a share of the test files in each slot's process,
        # which says what they import)
        baseline = sorted({t for m in mutations for t in m.tests})
        if args.after_suite:
            modules = suite_passed(baseline, Path(args.after_suite))
        else:
            modules = unmutated_pass(slots, baseline, Path(tmp))
        n = preload(modules)
        # what is imported now lives as long as the process: out of the collector's reach, so that each child's
        # gc.collect (pytest runs two at a session's end) walks only what its own tests made, not torch's heap
        gc.collect()
        gc.freeze()
        print(f"unmutated: {len(baseline)} tests pass{' (in the suite just run)' if args.after_suite else ''} "
              f"({time.time() - t0:.0f} s); {n} more modules preloaded", file=sys.stderr, flush=True)
        results: dict[str, tuple[str, float]] = {}

        def done(m, code, seconds, log):
            verdict = "caught" if code != 0 else "**SURVIVED**"
            if code is None:
                verdict = "**TIMED OUT**"
            elif code not in (0, 1):  # 2: interrupted or a collection error (the mutation broke an import), ...
                verdict = f"caught (pytest exit {code})"
            results[m.name] = (verdict, seconds)
            print(f"[{len(results)}/{len(mutations)}] {m.name}: {verdict} ({seconds:.0f} s)", file=sys.stderr,
                  flush=True)

        run_all(slots, [(m, m.tests) for m in mutations], done, args.timeout)
    rows = []
    for m in mutations:
        verdict, seconds = results[m.name]
        tests = " ".join(Path(t.split("::")[0]).name + (f"::{t.split('::', 1)[1]}" if "::" in t else "")
                         for t in m.tests)
        rows.append(f"| {m.name.replace('|', chr(92) + '|')} | {m.file} | {tests} | {verdict} | {seconds:.0f} |")
    survived = sum(results[m.name][0] in ("**SURVIVED**", "**TIMED OUT**") for m in mutations)
    print("| mutation | file | tests | result | s |\n|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\n{len(mutations) - survived} of {len(mutations)} mutations caught"
          f"{f', {survived} survived or timed out' if survived else ''} ({time.time() - t0:.0f} s, {len(slots)} at a time).")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
