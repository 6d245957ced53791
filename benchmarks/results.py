"""benchmarks/RESULTS.md, generated from benchmarks/baselines/*.json: the current figure of every benchmark.

    python -m benchmarks.results            # write benchmarks/RESULTS.md
    python -m benchmarks.results --check    # exit 1 when benchmarks/RESULTS.md is not what it would write

A baseline is one benchmark's latest measurement, copied from the dated journal (docs/results-history.md), keys in
this order: name (= the file's stem), title, group (one of GROUPS), date, commit (short sha or null), card,
command, metrics (flat key -> number: the headline figures, machine-readable), optionally columns and rows (the
section's main table, cells as printed), reading (what the figure says) and history (the journal section's title).
The GPU speed guard's baselines (benchmarks/guard.py: shape, command, commit, card, date, metrics) are rendered
last. A new measurement: add its section at the end of docs/results-history.md, update the baseline, rerun this.
The output is deterministic (fixed group order, baselines sorted by name, no generation date) and kept to
MAX_LINES: keep tables to their essential rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASELINES = HERE / "baselines"
RESULTS = HERE / "RESULTS.md"
HISTORY = "docs/results-history.md"
GROUPS = ("Learning", "GPU speed", "GPU memory", "CPU", "Monitor", "Tests")
KEYS = ("name", "title", "group", "date", "commit", "card", "command", "metrics", "reading", "history")
TABLE_KEYS = ("columns", "rows")
GUARD_KEYS = ("shape", "command", "commit", "card", "date", "metrics")
GUARD = "GPU speed guard baselines"
MAX_LINES = 440


def check_baseline(path: Path, d: dict) -> str | None:
    """What is wrong with the baseline `d` read from `path` (None when it is well-formed), for either schema."""
    if "shape" in d:  # the guard's
        if set(d) != set(GUARD_KEYS):
            return f"the guard's keys are {', '.join(GUARD_KEYS)}; it has {', '.join(d)}"
        if d["shape"] != path.stem:
            return f"shape {d['shape']!r} is not the file's stem"
    else:
        want = list(KEYS[:8]) + (list(TABLE_KEYS) if "columns" in d or "rows" in d else []) + list(KEYS[8:])
        if list(d) != want:
            return f"keys must be, in this order: {', '.join(want)}; it has {', '.join(d)}"
        if d["name"] != path.stem:
            return f"name {d['name']!r} is not the file's stem"
        if d["group"] not in GROUPS:
            return f"group {d['group']!r} is not one of {', '.join(GROUPS)}"
        if d["commit"] is not None and not isinstance(d["commit"], str):
            return "commit must be a short sha or null"
        for k in ("title", "date", "card", "command", "reading", "history"):
            if not isinstance(d[k], str) or not d[k]:
                return f"{k} must be a non-empty string"
        if "columns" in d:
            cols, rows = d["columns"], d["rows"]
            if not rows or any(not isinstance(r, list) or len(r) != len(cols) for r in rows):
                return f"every row must have the {len(cols)} cells of the columns"
            if any(not isinstance(c, str) for r in [cols, *rows] for c in r):
                return "table cells must be strings"
    m = d["metrics"]
    if not isinstance(m, dict) or not m:
        return "metrics must be a non-empty object"
    bad = [k for k, v in m.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
    if bad:
        return f"metrics must be numbers: {', '.join(bad)}"
    if len(d["date"]) != 10 or d["date"][4] != "-" or d["date"][7] != "-":
        return f"date {d['date']!r} is not YYYY-MM-DD"
    return None


def load(baselines: Path = BASELINES) -> tuple[list[dict], list[dict]]:
    """(benchmarks, guard baselines), each sorted by name; a malformed file stops with its path and what is wrong."""
    benches, guard = [], []
    for path in sorted(baselines.glob("*.json")):
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}: not JSON ({e})") from None
        why = check_baseline(path, d) if isinstance(d, dict) else "not a JSON object"
        if why:
            raise SystemExit(f"{path}: {why}")
        (guard if "shape" in d else benches).append(d)
    return benches, guard


def _cell(v) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def _code(s: str) -> str:
    return f"`` {s} ``" if "`" in s else f"`{s}`"


def _table(cols: list, rows: list[list]) -> list[str]:
    return ["| " + " | ".join(_cell(c) for c in cols) + " |", "|" + "---|" * len(cols),
            *("| " + " | ".join(_cell(c) for c in r) + " |" for r in rows)]


def _number(v) -> str:
    return json.dumps(v)


def render(baselines: Path = BASELINES) -> str:
    """The text of RESULTS.md for the baselines in `baselines`."""
    benches, guard = load(baselines)
    out = ["# Benchmark results", "",
           "Generated by `python -m benchmarks.results` from `benchmarks/baselines/*.json`: do not edit this file; "
           "change a baseline and rerun (`--check` exits 1 while this file is stale). Each benchmark shows its "
           "latest measurement (date · card · commit · command), its main table, what it says, and the section of "
           f"the dated journal, {HISTORY}, that holds the run in full.", ""]
    present = [g for g in GROUPS if any(b["group"] == g for b in benches)] + ([GUARD] if guard else [])
    out += ["Groups: " + " · ".join(f"[{g}](#{g.lower().replace(' ', '-')})" for g in present), ""]
    for g in GROUPS:
        group = [b for b in benches if b["group"] == g]
        if not group:
            continue
        out += [f"## {g}", ""]
        for b in group:
            commit = f"`{b['commit']}`" if b["commit"] else "no single commit"
            out += [f"### {b['title']}", f"{b['date']} · {b['card']} · {commit} · {_code(b['command'])}", ""]
            if "columns" in b:
                out += _table(b["columns"], b["rows"])
            else:
                out += _table(list(b["metrics"]), [[_number(v) for v in b["metrics"].values()]])
            out += ["", f"{b['reading']} — history: {HISTORY}, «{b['history']}»", ""]
    if guard:
        out += [f"## {GUARD}", "",
                "`python -m benchmarks.guard` reruns these shapes on a GPU of the same card and fails on a slowdown "
                "(docs/gpu.md); `--update` rewrites them. Their metrics are the timers' values (seconds per step, "
                "medians; peak GiB), shown here to 4 significant figures.", ""]
        out += _table(["shape", "date", "card", "commit", "command", "metrics"],
                      [[d["shape"], d["date"], d["card"], f"`{d['commit']}`", _code(d["command"]),
                        ", ".join(f"{k} {v:.4g}" for k, v in d["metrics"].items())] for d in guard])
        out += [""]
    while out and out[-1] == "":
        out.pop()
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="benchmarks/RESULTS.md from benchmarks/baselines/*.json.")
    ap.add_argument("--check", action="store_true", help="exit 1 when the file differs from what would be written")
    ap.add_argument("--baselines", type=Path, default=BASELINES, help="the baselines' folder")
    ap.add_argument("--out", type=Path, default=RESULTS, help="the file to write or check")
    a = ap.parse_args(argv)
    text = render(a.baselines)
    n = text.count("\n")
    if n > MAX_LINES:
        print(f"{a.out}: {n} lines would be written, over {MAX_LINES}: keep the baselines' tables to their "
              "essential rows", file=sys.stderr)
        return 1
    if a.check:
        if not a.out.exists() or a.out.read_text() != text:
            print(f"{a.out} is not what `python -m benchmarks.results` writes from {a.baselines}: rerun it",
                  file=sys.stderr)
            return 1
        print(f"{a.out} is up to date ({n} lines)")
        return 0
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(a.out)
    print(f"{a.out} written: {n} lines from {a.baselines}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
