"""Which candidate a policy names on a "pick one of these numbers" task (reasoning-gym's number_format), from the
held-out answers a stage saved (its eval_samples.jsonl, the last evaluation in it).

A policy can be right half the time on two candidates without comparing them: by naming the first one always, or
by repeating the whole list (a verifier that reads the last number credits it whenever the right one is listed
last; align's `math` reads such a list as no answer). Either leaves every GRPO group all right or all wrong, so GRPO
learns nothing from there on. The table counts, per file, the answers that name exactly one candidate (by its
position in the prompt), several, or none, with how many of each were right.

    python -m benchmarks.answer_positions RUN_DIR/grpo/eval_samples.jsonl [MORE ...]
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from align.rewards import numbers_in, parse_number


def candidates(prompt: str) -> list[float]:
    """The candidate numbers of a number_format prompt (after its last 'candidates:'), as floats."""
    tail = prompt.rsplit("candidates:", 1)[-1]
    return [v for v in (parse_number(s) for s in numbers_in(tail)) if v is not None]


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-12 * max(1.0, abs(b))  # the same decimal in another notation parses to the same float


ORDINALS = ["first", "second", "third", "fourth", "fifth"]
_ORDER = {k: i for i, k in enumerate([*ORDINALS, "several", "none"])}


def answer_kind(prompt: str, answer: str) -> str:
    """'first', 'second', ... (the one candidate the answer names, by its position in the prompt), 'several' (it
    names two or more different candidates) or 'none'. The same candidate written twice is one."""
    cands = candidates(prompt)
    said = [v for v in (parse_number(s) for s in numbers_in(answer or "")) if v is not None]
    named = sorted({i for i, c in enumerate(cands) for v in said if _same(v, c)})
    if len({cands[i] for i in named}) > 1:
        return "several"
    if not named:
        return "none"
    return ORDINALS[named[0]] if named[0] < len(ORDINALS) else f"#{named[0] + 1}"


def last_eval(path: Path) -> list[dict]:
    """The rows of the last evaluation in an eval_samples.jsonl (a file may hold several steps)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    last = max((r.get("step", 0) for r in rows), default=0)
    return [r for r in rows if r.get("step", 0) == last]


def tally(rows: list[dict]) -> dict[str, tuple[int, int]]:
    """kind -> (answers of that kind, how many of them were right)."""
    n, right = Counter(), Counter()
    for r in rows:
        k = answer_kind(r["prompt"], r["greedy"])
        n[k] += 1
        right[k] += bool(r["greedy_correct"])
    return {k: (n[k], right[k]) for k in sorted(n, key=lambda k: (_ORDER.get(k, len(_ORDER)), k))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path, help="eval_samples.jsonl files (a stage's output folder's)")
    args = ap.parse_args(argv)
    print("| file | step | answers | right | named: count (right) |")
    print("|---|---|---|---|---|")
    for f in args.files:
        rows = last_eval(f)
        kinds = ", ".join(f"{k} {n} ({r})" for k, (n, r) in tally(rows).items())
        step = rows[0].get("step", 0) if rows else "-"
        print(f"| {f} | {step} | {len(rows)} | {sum(bool(r['greedy_correct']) for r in rows)} | {kinds} |")


if __name__ == "__main__":
    main()
