"""reasoning-gym (optional extra `align[tasks]`): its procedural tasks as data, its scorers as rewards.

    rows = make_rows("basic_arithmetic", 1000, seed=0, params={"max_terms": 3})
    fn = reward("basic_arithmetic")          # fn(prompt, completion, **row) -> float in [0, 1]

A row is {"prompt", "answer", "completion", "rg_task", "rg_metadata"}: `completion` is the task's worked solution
when it has one (metadata `answer_cot`, e.g. gsm_symbolic), else the answer, so the same file serves `align sft`;
`rg_task`/`rg_metadata` let the task's own `score_answer` grade a completion later (`--reward rg:TASK`, and
`align eval`'s automatic verifier).

What the scorer sees of a completion: the text inside the last <answer>...</answer> if there is one, else the
text after the last '####', else the last line; white space around it is dropped.
"""

from __future__ import annotations

import ast
import difflib
import json
import re
from typing import Callable

from align.errors import UserError

EXTRA = "pip install 'align[tasks]' (or pip install reasoning-gym)"


def _rg():
    try:
        import reasoning_gym
    except ImportError as e:
        if e.name in (None, "reasoning_gym"):
            raise UserError(f"reasoning-gym tasks need the optional extra: {EXTRA}.") from None
        raise UserError(f"reasoning-gym is installed but cannot import {e.name!r}: {EXTRA}.") from None
    return reasoning_gym


def tasks() -> list[str]:
    from reasoning_gym.factory import DATASETS  # noqa: F401  (after _rg(): a clear error when missing)

    return sorted(DATASETS)


def check_task(task: str) -> None:
    _rg()
    names = tasks()
    if task not in names:
        near = difflib.get_close_matches(task, names, n=3)
        hint = f" Did you mean {', '.join(near)}?" if near else f" {len(names)} tasks, e.g. basic_arithmetic, chain_sum."
        raise UserError(f"rg:{task}: no such reasoning-gym task.{hint}")


def parse_params(items: list[str]) -> dict:
    """['max_terms=3', 'allow_negation=false', "operators=('+','-')"] -> {'max_terms': 3, 'allow_negation': False,
    'operators': ('+', '-')}: JSON or Python literals, anything else a string."""
    params = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise UserError(f"--param {item!r}: write KEY=VALUE, e.g. --param max_terms=3.")
        try:
            params[key.strip()] = json.loads(value.lower() if value.lower() in ("true", "false") else value)
        except json.JSONDecodeError:
            try:
                params[key.strip()] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                params[key.strip()] = value
    return params


def _jsonable(x):
    """Metadata as JSON keeps: tuples become lists, unknown objects their repr."""
    return json.loads(json.dumps(x, default=repr))


def _enum_of(hint):
    """The Enum class a config field's type names (TaskType, list[TaskType], Optional[...]), or None."""
    import enum
    import typing

    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint
    for arg in typing.get_args(hint):
        found = _enum_of(arg)
        if found is not None:
            return found
    return None


def _coerce_enums(task: str, params: dict) -> dict:
    """--param values for a config field of Enum type given as their string values (task_types=['friends'] for
    aiw's list[TaskType]) become the Enum members the task expects."""
    import typing

    from reasoning_gym.factory import DATASETS

    hints = typing.get_type_hints(DATASETS[task][1])
    out = dict(params)
    for key, value in params.items():
        kind = _enum_of(hints.get(key))
        if kind is None:
            continue
        try:
            out[key] = [kind(v) for v in value] if isinstance(value, (list, tuple)) else kind(value)
        except ValueError:
            raise UserError(f"rg:{task}: --param {key}: {value!r} is not among "
                            f"{[m.value for m in kind]}.") from None
    return out


def _dataset(task: str, size: int, seed: int, params: dict):
    try:
        return _rg().create_dataset(task, size=size, seed=seed, **_coerce_enums(task, params))
    except (TypeError, ValueError, AssertionError) as e:
        raise UserError(f"rg:{task}: bad --param ({type(e).__name__}: {e}).") from None


def _items(task: str, size: int, seed: int, params: dict):
    """The task's items; an option combination that only fails while items are made (aiw's task_type_weights of
    another length than task_types) is a bad --param too."""
    dataset = _dataset(task, size, seed, params)
    for i in range(len(dataset)):
        try:
            item = dataset[i]
        except (TypeError, ValueError, AssertionError, AttributeError, KeyError, IndexError) as e:
            raise UserError(f"rg:{task}: bad --param: making item {i} failed ({type(e).__name__}: {e}).") from None
        yield item


def problem_key(prompt: str, metadata: dict | None) -> str:
    """What makes two items the same problem: the expression when the task's metadata has one (basic_arithmetic's
    natural format words one expression four ways, "What is 3 + 4?" / "Compute 3 + 4."), else the prompt."""
    expression = (metadata or {}).get("expression")
    return "expr:" + "".join(expression.split()) if isinstance(expression, str) else prompt


def row_keys(rows: list[dict]) -> set:
    """The prompts and problem keys of rows (a split to keep out of another, by wording and by problem)."""
    return {r["prompt"] for r in rows} | {problem_key(r["prompt"], r.get("rg_metadata")) for r in rows}


# reasoning-gym makes item i of a dataset from Random(dataset seed + i) (some tasks also seed numpy with it, which
# takes seeds below 2**32): `--seed 1` given straight through would share all but one item with `--seed 0`. Each
# align seed's two splits start SPLIT_OFFSET apart, and seeds SEED_STRIDE apart, so two seeds share no item while a
# split draws fewer than SPLIT_OFFSET items; seed 0 keeps the items it always had.
SPLIT_OFFSET = 1_000_003
SEED_STRIDE = 2 * SPLIT_OFFSET
MAX_SEED = (2**32 - 1) // SEED_STRIDE - 1  # 2146: the last seed whose held-out split's items stay below 2**32


def dataset_seed(seed: int, held_out: bool = False) -> int:
    """The reasoning-gym dataset seed of an align seed's training (or held-out) split."""
    if not 0 <= seed <= MAX_SEED:
        raise UserError(f"--seed {seed}: reasoning-gym tasks take seeds 0-{MAX_SEED} (each draws its own items).")
    return seed * SEED_STRIDE + (SPLIT_OFFSET if held_out else 0)


def make_rows(task: str, n: int, seed: int, params: dict | None = None, exclude: set | None = None,
              held_out: bool = False) -> list[dict]:
    """n rows of a reasoning-gym task with distinct problems (problem_key), none whose prompt or problem is in
    `exclude` (small task spaces repeat problems: more items are drawn until n distinct ones are found, or the task
    is reported too small). `seed` is align's: its training and held-out splits (`held_out`) draw items no other
    seed or split draws (dataset_seed)."""
    check_task(task)
    seed = dataset_seed(seed, held_out)
    params, seen, rows, found = dict(params or {}), set(exclude or ()), [], -1
    size = first = min(max(2 * n, 16), SPLIT_OFFSET)
    # stop once drawing 4x more items finds no new problem (the space is exhausted); while nothing outside
    # `exclude` has been found, draw more (up to 64x the first pass) before giving up; never past the split's range
    while len(rows) > found or (not rows and seen and size < 64 * first):
        found, drawn = len(rows), size
        rows, taken = [], set(seen)
        for entry in _items(task, size, seed, params):
            key = problem_key(entry["question"], entry.get("metadata"))
            if entry["question"] in taken or key in taken:
                continue
            taken.add(key)
            meta = _jsonable(entry.get("metadata", {}))
            rows.append({"prompt": entry["question"], "answer": str(entry["answer"]),
                         "completion": str(meta.get("answer_cot") or entry["answer"]),
                         "rg_task": task, "rg_metadata": meta})
            if len(rows) == n:
                return rows
        size = min(size * 4, SPLIT_OFFSET)
        if size == drawn:
            break
    raise UserError(f"rg:{task}: only {len(rows)} distinct problems{' outside the training split' if seen else ''} "
                    f"among {drawn} items; ask for fewer rows or widen the task with --param.")


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


def extract(completion: str) -> str:
    """The part of a completion the task's scorer grades (see the module docstring)."""
    tagged = _ANSWER_TAG.findall(completion or "")
    if tagged:
        return tagged[-1].strip()
    if "####" in (completion or ""):
        return completion.rsplit("####", 1)[1].strip()
    lines = [ln for ln in (completion or "").strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


_SCORERS: dict[str, Callable] = {}


def reward(task: str) -> Callable:
    """fn(prompt, completion, answer=..., rg_metadata=..., **row) -> the task's score_answer in [0, 1]."""
    check_task(task)

    def rg_reward(prompt, completion, answer=None, rg_metadata=None, **row) -> float:
        if task not in _SCORERS:
            _SCORERS[task] = _rg().get_score_answer_fn(task)
        entry = {"question": prompt, "answer": str(answer), "metadata": rg_metadata or {}}
        return float(_SCORERS[task](extract(completion), entry))

    rg_reward.__name__ = f"rg_{task}"
    return rg_reward
