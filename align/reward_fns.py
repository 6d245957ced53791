"""Reward functions for RLVR: built-in verifiers, user functions from a Python file, weights, error policy.

`--reward SPEC` (repeatable), SPEC = NAME[:WEIGHT] or path/to/file.py:FUNCTION[:WEIGHT].
A reward function has the signature `fn(prompt: str, completion: str, **row) -> float`, where `row` holds
every other column of the data row (e.g. `answer`). The total reward is Σ weight · fn.

Built in:
  math            1 if the answer (after ####, else \\boxed{}, else the last number) equals row["answer"]
  sort            fraction of positions matching the sorted list (row["answer"])
  sort_inclusion  (prompt items present + adjacent non-decreasing pairs) / (2n − 1)
  format          1 if the completion is <think>…</think> followed by a non-empty answer
  answer_format   1 if the completion ends with "#### <number>"
  length          Kimi k1.5 length reward within each group (needs math; computed per group)
"""

from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from align import rewards as R
from align.errors import UserError

_THINK = re.compile(r"^\s*<think>.*?</think>\s*\S", re.S)
_ANSWER = re.compile(r"####\s*-?[\d,]*\.?\d+\s*\.?\s*$")


def math_fn(prompt, completion, answer=None, **row) -> float:
    return R.math_reward(completion, str(answer))


def sort_fn(prompt, completion, answer=None, **row) -> float:
    return R.sort_reward(completion, str(answer))


def sort_inclusion_fn(prompt, completion, **row) -> float:
    items = R.parse_int_list(prompt.split(":", 1)[-1])
    if not items:
        return 0.0
    score = R.sort_inclusion_ordering_reward(items, R.parse_int_list(completion))
    return score / (2 * len(items) - 1)


def format_fn(prompt, completion, **row) -> float:
    return 1.0 if _THINK.match(completion) else 0.0


def answer_format_fn(prompt, completion, **row) -> float:
    return 1.0 if _ANSWER.search(completion.strip()) else 0.0


BUILTIN: dict[str, Callable] = {
    "math": math_fn, "sort": sort_fn, "sort_inclusion": sort_inclusion_fn,
    "format": format_fn, "answer_format": answer_format_fn,
}
GROUP_REWARDS = ("length",)


@dataclass
class RewardFn:
    name: str
    weight: float
    fn: Callable | None  # None for group rewards (length)


def _load_user_fn(path: str, name: str) -> Callable:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"--reward {path}:{name}: {path} not found.")
    spec = importlib.util.spec_from_file_location(f"align_user_rewards_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's file: report, don't crash with a traceback
        raise UserError(f"{path}: importing it failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"{path}: no function {name!r} (expected `def {name}(prompt, completion, **row) -> float`).")
    return fn


def parse_rewards(specs: list[str]) -> list[RewardFn]:
    out = []
    for spec in specs:
        parts = spec.split(":")
        weight = 1.0
        if len(parts) > 1 and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", parts[-1]):
            weight = float(parts.pop())
        if parts[0].endswith(".py"):
            if len(parts) != 2:
                raise UserError(f"--reward {spec}: a user reward is path/to/file.py:FUNCTION[:WEIGHT].")
            out.append(RewardFn(f"{Path(parts[0]).stem}.{parts[1]}", weight, _load_user_fn(parts[0], parts[1])))
        elif len(parts) == 1 and parts[0] in BUILTIN:
            out.append(RewardFn(parts[0], weight, BUILTIN[parts[0]]))
        elif len(parts) == 1 and parts[0] in GROUP_REWARDS:
            out.append(RewardFn(parts[0], weight, None))
        else:
            known = ", ".join([*BUILTIN, *GROUP_REWARDS])
            raise UserError(f"--reward {spec}: unknown reward; built-ins: {known}, or path/to/file.py:FUNCTION.")
    if not out:
        raise UserError("give at least one --reward (e.g. --reward math).")
    if any(r.name == "length" for r in out) and not any(r.name == "math" for r in out):
        raise UserError("--reward length scores length among correct answers: add --reward math too.")
    return out


class RewardError(Exception):
    pass


def call_reward(r: RewardFn, prompt: str, completion: str, row: dict) -> float:
    """One reward value; raises RewardError (with the offending completion) on an exception, NaN, inf or a
    non-number."""
    extra = {k: v for k, v in row.items() if k not in ("prompt", "completion")}
    try:
        value = r.fn(prompt, completion, **extra)
    except Exception as e:
        raise RewardError(f"reward {r.name!r} raised {type(e).__name__}: {e} on completion {completion!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RewardError(f"reward {r.name!r} returned {type(value).__name__} {value!r} (not a number) "
                          f"on completion {completion!r}")
    if not math.isfinite(value):
        raise RewardError(f"reward {r.name!r} returned {value} on completion {completion!r}")
    return float(value)
