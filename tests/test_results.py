"""benchmarks/RESULTS.md is generated (benchmarks/results.py) from benchmarks/baselines/*.json: the file on disk is
what the generator writes, every baseline is well-formed (a benchmark's schema or the GPU speed guard's) and names
a section of the dated journal (docs/results-history.md), and benchmarks/ stays small (RESULTS.md at most 440 lines,
no file over 200 KB)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import results

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
ORDER = ["name", "title", "group", "date", "commit", "card", "command", "metrics", "reading", "history"]


def _baselines() -> list[tuple[Path, dict]]:
    paths = sorted((BENCH / "baselines").glob("*.json"))
    assert paths, "no baselines"
    return [(p, json.loads(p.read_text())) for p in paths]


def test_results_md_is_what_the_generator_writes(tmp_path):
    """The committed RESULTS.md equals the generator's output (the --check logic), and --check tells a stale or
    missing file from a fresh one; what it writes, --check accepts."""
    text = results.render()
    assert results.RESULTS.read_text() == text, "benchmarks/RESULTS.md is stale: run `python -m benchmarks.results`"
    assert results.main(["--check"]) == 0
    assert results.render() == text  # deterministic
    stale = tmp_path / "RESULTS.md"
    stale.write_text(text.replace("\n## ", "\n## (edited) ", 1))
    assert results.main(["--check", "--out", str(stale)]) == 1
    assert results.main(["--check", "--out", str(tmp_path / "missing.md")]) == 1
    assert results.main(["--out", str(stale)]) == 0 and stale.read_text() == text
    assert results.main(["--check", "--out", str(stale)]) == 0
    # every benchmark and every guard shape is rendered, under its group in the fixed order
    heads = [line for line in text.splitlines() if line.startswith("## ")]
    assert heads == [f"## {g}" for g in results.GROUPS if any(d.get("group") == g for _, d in _baselines())] + [
        f"## {results.GUARD}"]
    for _, d in _baselines():
        assert (f"### {d['title']}\n" if "name" in d else f"| {d['shape']} |") in text


def test_every_baseline_parses_and_has_the_required_keys():
    """Each baselines/*.json is a benchmark (keys in the schema's order, name = file stem, a known group, numeric
    metrics, a table whose rows fit its columns, a history title that is a heading of docs/results-history.md) or a
    GPU speed guard baseline (shape = file stem, command, commit, card, date, numeric metrics)."""
    journal = (ROOT / "docs" / "results-history.md").read_text()
    headings = {line.lstrip("#").strip() for line in journal.splitlines() if line.startswith("#")}
    kinds = {"bench": 0, "guard": 0}
    for p, d in _baselines():
        m = d["metrics"]
        assert isinstance(m, dict) and m, p
        assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in m.values()), p
        assert len(d["date"]) == 10 and d["date"][4] == d["date"][7] == "-", p
        if "shape" in d:
            kinds["guard"] += 1
            assert set(d) == {"shape", "command", "commit", "card", "date", "metrics"}, p
            assert d["shape"] == p.stem, p
        else:
            kinds["bench"] += 1
            table = ["columns", "rows"] if "columns" in d else []
            assert list(d) == ORDER[:8] + table + ORDER[8:], p
            assert d["name"] == p.stem and d["group"] in results.GROUPS, p
            assert d["commit"] is None or isinstance(d["commit"], str), p
            assert all(isinstance(d[k], str) and d[k] for k in ("title", "card", "command", "reading")), p
            assert d["history"] in headings, f"{p}: history {d['history']!r} is no heading of the journal"
            if table:
                assert d["rows"] and all(len(r) == len(d["columns"]) for r in d["rows"]), p
                assert all(isinstance(c, str) for r in [d["columns"], *d["rows"]] for c in r), p
        assert results.check_baseline(p, d) is None, p
    assert kinds["bench"] >= 20 and kinds["guard"] >= 2, kinds
    assert {"grpo-qwen2.5-1.5b.json", "dpo-0.5b.json"} <= {p.name for p, _ in _baselines()}


def test_a_malformed_baseline_is_refused(tmp_path):
    """The generator stops on a baseline it cannot render faithfully: keys out of order, an unknown group, a
    non-numeric metric, a row of the wrong width, a name that is not the file's stem."""
    good = {"name": "x", "title": "X", "group": "CPU", "date": "2026-12-02", "commit": None, "card": "2 CPU cores",
            "command": "python -m x", "metrics": {"s": 1.5}, "columns": ["a", "b"], "rows": [["1", "2"]],
            "reading": "r", "history": "h"}
    p = tmp_path / "x.json"
    assert results.check_baseline(p, good) is None
    swapped = dict(list(good.items())[1:2] + list(good.items())[:1] + list(good.items())[2:])
    bad = [swapped, {**good, "group": "GPUs"}, {**good, "metrics": {"s": "1.5"}}, {**good, "metrics": {"ok": True}},
           {**good, "rows": [["1"]]}, {**good, "name": "y"}, {**good, "date": "02.12.2026"}]
    for d in bad:
        assert results.check_baseline(p, d), d
    p.write_text(json.dumps({**good, "group": "GPUs"}))
    with pytest.raises(SystemExit, match="group"):
        results.render(tmp_path)


def test_benchmarks_stays_small():
    """RESULTS.md is at most 440 lines, and no file under benchmarks/ is over 200 KB."""
    assert results.RESULTS.read_text().count("\n") <= results.MAX_LINES == 440
    big = [str(p.relative_to(ROOT)) for p in BENCH.rglob("*") if p.is_file() and p.stat().st_size > 200_000]
    assert not big, f"over 200 KB under benchmarks/: {big}"
