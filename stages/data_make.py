"""`align data make TASK`: generate a dataset (and optionally a held-out split with no prompt in common)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from align import tasks
from align.config import opt
from align.console import summary_table
from align.errors import UserError


@dataclass
class DataMakeConfig:
    task: str = opt("arithmetic", "Task: arithmetic, sort, prefs or text.")
    n: int = opt(1000, "Rows to generate.")
    seed: int = opt(0, "Random seed.")
    out: str = opt("data.jsonl", "Output JSONL file.")
    test_n: int = opt(0, "Also write a held-out split of N rows, disjoint from the main one.")
    test_out: str = opt("", "Held-out output file (default: OUT with .test.jsonl).")
    levels: str = opt("1,2,3,4", "arithmetic/prefs difficulty levels: 1-digit/2 operands .. 2-digit/3 operands.")


def run(cfg: DataMakeConfig) -> dict:
    try:
        levels = tuple(int(x) for x in cfg.levels.split(","))
    except ValueError:
        raise UserError(f"--levels must be comma-separated integers 1..4, not {cfg.levels!r}.") from None
    opts = {"levels": levels} if cfg.task in ("arithmetic", "prefs") else {}
    rows = tasks.make_dataset(cfg.task, cfg.n, cfg.seed, **opts)
    tasks.write_jsonl(rows, Path(cfg.out))
    summary = {"task": cfg.task, "rows": len(rows), "out": cfg.out}
    if cfg.test_n:
        key = "text" if cfg.task == "text" else "prompt"
        test = tasks.make_dataset(cfg.task, cfg.test_n, cfg.seed + 1_000_003, exclude={r[key] for r in rows}, **opts)
        test_out = cfg.test_out or str(Path(cfg.out).with_suffix("")) + ".test.jsonl"
        tasks.write_jsonl(test, Path(test_out))
        summary.update(test_rows=len(test), test_out=test_out)
    summary_table("data make", summary)
    return summary
