"""Rewards: the one registry of verifiers and reward functions (grpo's --reward, ppo's gold reward, eval's
--verifier), answer checking, and user functions loaded from a Python file.

    math_reward("23 + 45 = 68. #### 68", "68")   -> 1.0
    sort_reward("1 3 7 9", "1 3 7 9")            -> 1.0

A reward function has the signature `fn(prompt: str, completion: str, **row) -> float`, where `row` holds every
other column of the data row (e.g. `answer`). `--reward SPEC` (repeatable), SPEC = NAME[:WEIGHT] or
path/to/file.py:FUNCTION[:WEIGHT]; the total reward is Σ weight · fn. Registered (REWARDS):
  math            1 if the answer (after ####, else \\boxed{}, else the last number) equals row["answer"]
  sort            fraction of positions matching the sorted list (row["answer"])
  sort_inclusion  (prompt items present + adjacent non-decreasing pairs) / (2n − 1)
  format          1 if the completion is <think>…</think> followed by a non-empty answer
  answer_format   1 if the completion ends with "#### <number>"
  exact           1 if the completion equals row["answer"] (surrounding white space ignored)
  length          Kimi k1.5 length reward within each group (needs math; computed per group: GROUP_REWARDS)
  rg:TASK         a reasoning-gym task's own scorer (optional extra; rows made by `align data make rg:TASK`)
A verifier (eval's --verifier) is a registered reward read as correct when it returns 1.

extract_answer looks, in order, for the text after the last '####', the last \\boxed{...}, then the last number
anywhere; an answer that ends in a list of different numbers ("526.007 526.274", "3 or 5") gives none. Numbers
may carry signs, thousands separators ("1,234"), decimals and fractions ("3/4"); comparisons are exact on
fractions, then within a tolerance.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import re
import signal
import threading
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable

from align.errors import UserError

# A number: optional sign (only where it cannot be a binary minus), an integer with optional
# thousands groups or a decimal, then an optional exponent ("4.9558e+02") or "/denominator".
_INT = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)"
_NUM_RE = re.compile(
    rf"(?:(?<![\w)\]}}.])[-+])?(?<![\d.])(?:{_INT}(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+(?!\w|\.\d)|/\d+(?:\.\d+)?)?"
)
_FRAC_RE = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_LIST_INT_RE = re.compile(r"(?<![\d.])-?\d+")


def _number_matches(text) -> list[re.Match]:
    """The numbers of text (its minus signs made ASCII), as regex matches: their spans say what stands between."""
    return list(_NUM_RE.finditer(text.replace("\u2212", "-")))


def _normal(match: re.Match) -> str:
    """A matched number as a plain string: no thousands commas, no leading '+'."""
    return match.group().replace(",", "").lstrip("+")


def numbers_in(text):
    """All number strings in text, normalised (no commas, ASCII minus, no leading '+')."""
    return [_normal(m) for m in _number_matches(text)]


def _last_boxed(text):
    """Content of the last \\boxed{...} (or \\fbox{...}) with nested braces, or None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: no usable box


def _unlatex(s):
    """Turn simple LaTeX numbers into plain ones: \\frac{3}{4} -> 3/4, 1{,}000 -> 1,000."""
    s = _FRAC_RE.sub(r"\1/\2", s)
    for a, b in (("{,}", ","), ("\\!", ""), ("\\,", ""), ("\\$", ""), ("\\%", "")):
        s = s.replace(a, b)
    return s


def extract_answer(text):
    """The final answer in a completion as a normalised number string, or None.

    Order: first number after the last '####' (None if there is none), else the last number
    in the last \\boxed{...}, else the last number in the text; the last number ending a list of different
    numbers ('3, 5' or '3 or 5') is none (_final_number).
    """
    if not text:
        return None
    if "####" in text:
        found = numbers_in(text.rsplit("####", 1)[1])
        return found[0] if found else None
    boxed = _last_boxed(text)
    return _final_number(_unlatex(boxed) if boxed is not None else text)


# What may stand between two numbers of a list: white space, a comma or semicolon, "or", "and".
_LIST_SEP_RE = re.compile(r"\s*(?:[,;]|\b(?:or|and)\b)?\s*", re.I)


def _final_number(text):
    """The last number of text, normalised, or None where it ends a list of different numbers ('526.007 526.274',
    '3, 5', '3 or 5'): such an answer names no single value, and reading its last number would credit a policy
    that repeats every candidate it was given (the right one is last about half the time). The same value twice
    ('0.5 or 1/2') is one answer."""
    found = _number_matches(text)
    if not found:
        return None
    last = _normal(found[-1])
    if len(found) > 1 and _LIST_SEP_RE.fullmatch(found[-1].string[found[-2].end():found[-1].start()]):
        if _fraction(found[-2].group()) != _fraction(last):
            return None
    return last


# Beyond these a string is no answer a verifier compares: exact arithmetic on it would stall the reward.
_MAX_DIGITS, _MAX_EXPONENT = 1000, 1000


def _fraction(s):
    """Exact Fraction for a number string like '-1,234.5', '$68', '3/4', '50%' or '4.9e+02'; None if not one."""
    if s is None:
        return None
    s = str(s).strip().replace("\u2212", "-").replace(",", "").replace("$", "")
    s = s.rstrip(".").removesuffix("%").strip()
    if not re.fullmatch(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+|/\d+(?:\.\d+)?)?", s):
        return None
    mantissa, _, exponent = s.lower().partition("e")
    if len(mantissa) > _MAX_DIGITS or abs(int(exponent or 0)) > _MAX_EXPONENT:
        return None  # '1e99999999' would take seconds to expand exactly, 5,000 digits raise in int()
    try:
        if "/" in s:
            num, den = s.split("/")
            return Fraction(num) / Fraction(den)
        return Fraction(s)
    except ZeroDivisionError:
        return None


def parse_number(s):
    """A number string ('1,234', '-5', '68.0', '3/4', '$68') as a float, or None if it is not one."""
    value = _fraction(s)
    return None if value is None else float(value)


def _decimal_places(s) -> int | None:
    """Decimal places of a number written as a decimal ('68' 0, '-1,234.50' 2, '4.95577e+02' 3); None for a
    fraction ('1/3')."""
    s = str(s).strip()
    if "/" in s:
        return None
    s, _, exponent = s.lower().partition("e")  # 4.95577e+02: 5 places of the mantissa, 3 of the number
    _, dot, tail = s.partition(".")
    return max(0, (len(re.sub(r"\D", "", tail)) if dot else 0) - int(exponent or 0))


def math_reward(completion, answer, tol=1e-6):
    """1.0 if the completion's extracted answer equals the reference answer, else 0.0.

    Exact on fractions first, then |pred - answer| <= min(tol * max(1, |answer|), 0.5 * 10^-d) where d is the
    reference's decimal places: the relative tolerance absorbs float formatting ('0.3333333' for 1/3), and never
    exceeds half a unit of the reference's last digit, so 521219525 is not 521219524 and 2.5 is not 2.4. The
    reference may be a number string or a full solution ending in '#### N'; a reference with no number raises
    UserError.
    """
    ref = answer
    want = _fraction(ref)
    if want is None:  # a full solution: its answer
        ref = extract_answer(str(answer))
        want = _fraction(ref)
    if want is None:
        raise UserError(f"reference answer {answer!r} is not a number (or has more than {_MAX_DIGITS} digits or an "
                        f"exponent beyond ±{_MAX_EXPONENT}); fix the dataset's answer column")
    pred = _fraction(extract_answer(completion))
    if pred is None:
        return 0.0
    bound = Fraction(tol) * max(1, abs(want))  # exact: '1e400' is a number a float cannot hold
    if (d := _decimal_places(ref)) is not None:
        bound = min(bound, Fraction(1, 2) / Fraction(10) ** d)
    return 1.0 if abs(pred - want) <= bound else 0.0


def parse_int_list(text):
    """All integers in text, in order: '1, 3 -2 7' -> [1, 3, -2, 7]. A '-' after a digit is not a sign."""
    return [int(x) for x in _LIST_INT_RE.findall(text or "")]


def sort_inclusion_ordering_reward(prompt_list, response_list):
    """(# prompt items present in the response) + (# adjacent non-decreasing pairs in the response)."""
    present = set(response_list)
    inclusion = sum(1 for x in prompt_list if x in present)
    ordering = sum(1 for x, y in zip(response_list, response_list[1:]) if x <= y)
    return float(inclusion + ordering)


def sort_reward(completion, answer):
    """Fraction of positions that match the sorted answer, over the longer of the two lists, in [0, 1].

    Reads integers after the last '####' when the completion has one. Exact match -> 1.0.
    """
    target = parse_int_list(answer)
    if not target:
        raise UserError(f"reference answer {answer!r} holds no integers; fix the dataset's answer column")
    text = completion.rsplit("####", 1)[1] if "####" in (completion or "") else completion
    response = parse_int_list(text)
    return sum(1 for x, y in zip(response, target) if x == y) / max(len(response), len(target))


_THINK = re.compile(r"^\s*<think>.*?</think>\s*\S", re.S)
_ANSWER = re.compile(r"####\s*-?[\d,]*\.?\d+\s*\.?\s*$")


# ---- the registry: reward functions fn(prompt, completion, **row) -> float


def math_fn(prompt, completion, answer=None, **row) -> float:
    return math_reward(completion, str(answer))


def sort_fn(prompt, completion, answer=None, **row) -> float:
    return sort_reward(completion, str(answer))


def sort_inclusion_fn(prompt, completion, **row) -> float:
    items = parse_int_list(prompt.split(":", 1)[-1])
    if not items:
        return 0.0
    score = sort_inclusion_ordering_reward(items, parse_int_list(completion))
    return score / (2 * len(items) - 1)


def format_fn(prompt, completion, **row) -> float:
    return 1.0 if _THINK.match(completion) else 0.0


def answer_format_fn(prompt, completion, **row) -> float:
    return 1.0 if _ANSWER.search(completion.strip()) else 0.0


def exact_fn(prompt, completion, answer=None, **row) -> float:
    return float(completion.strip() == str(answer).strip())


REWARDS: dict[str, Callable] = {
    "math": math_fn, "sort": sort_fn, "sort_inclusion": sort_inclusion_fn,
    "format": format_fn, "answer_format": answer_format_fn, "exact": exact_fn,
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


def lookup(name: str) -> Callable | None:
    """The reward function registered as `name` (a REWARDS key or rg:TASK), or None."""
    if name.startswith("rg:"):
        from align import rgym

        return rgym.reward(name[3:])
    return REWARDS.get(name)


def parse_rewards(specs: list[str], flag: str = "--reward") -> list[RewardFn]:
    """The reward functions of --reward specs NAME[:WEIGHT], rg:TASK[:WEIGHT], file.py:FUNCTION[:WEIGHT] (`flag`
    names the option in messages)."""
    out = []
    for spec in specs:
        parts = spec.split(":")
        weight = 1.0
        if len(parts) > 1 and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", parts[-1]):
            weight = float(parts.pop())
        if len(parts) == 2 and (parts[0] in REWARDS or parts[0] in GROUP_REWARDS):
            raise UserError(f"{flag} {spec}: the weight {parts[1]!r} is not a number (NAME:WEIGHT, e.g. "
                            f"{parts[0]}:0.5).")
        if parts[0] == "rg" and len(parts) == 2:
            name = ":".join(parts)
            out.append(RewardFn(name, weight, lookup(name)))
        elif parts[0].endswith(".py"):
            if len(parts) != 2:
                raise UserError(f"{flag} {spec}: a user reward is path/to/file.py:FUNCTION[:WEIGHT].")
            out.append(RewardFn(f"{Path(parts[0]).stem}.{parts[1]}", weight, _load_user_fn(parts[0], parts[1])))
        elif len(parts) == 1 and parts[0] in REWARDS:
            out.append(RewardFn(parts[0], weight, REWARDS[parts[0]]))
        elif len(parts) == 1 and parts[0] in GROUP_REWARDS:
            out.append(RewardFn(parts[0], weight, None))
        else:
            known = ", ".join([*REWARDS, *GROUP_REWARDS])
            raise UserError(f"{flag} {spec}: unknown reward; built-ins: {known}, rg:TASK (reasoning-gym), or "
                            "path/to/file.py:FUNCTION.")
    if not out:
        raise UserError("give at least one --reward (e.g. --reward math).")
    if any(r.name == "length" for r in out) and not any(r.name == "math" for r in out):
        raise UserError("--reward length scores length among correct answers: add --reward math too.")
    return out


class RewardError(Exception):
    pass


class _TimeUp(BaseException):  # not an Exception: a user function's `except Exception` must not swallow it
    pass


@contextlib.contextmanager
def _time_limit(seconds: float):
    """SIGALRM after `seconds` (0: no limit; only in the main thread, where signals are delivered)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def alarm(signum, frame):
        raise _TimeUp()

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def row_fields(row: dict) -> dict:
    """A data row as a reward function's keyword arguments: every column but the prompt and a reference
    completion (the function gets the prompt and the sampled completion positionally)."""
    return {k: v for k, v in row.items() if k not in ("prompt", "completion")}


def call_reward(r: RewardFn, prompt: str, completion: str, row: dict, timeout: float = 0.0) -> float:
    """One reward value; raises RewardError (with the offending completion) on an exception, NaN, inf, a
    non-number, or a call that takes longer than `timeout` seconds."""
    extra = row_fields(row)
    try:
        with _time_limit(timeout):
            value = r.fn(prompt, completion, **extra)
    except _TimeUp:
        raise RewardError(f"reward {r.name!r} took longer than {timeout:g} s on completion {completion!r}") from None
    except Exception as e:
        raise RewardError(f"reward {r.name!r} raised {type(e).__name__}: {e} on completion {completion!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RewardError(f"reward {r.name!r} returned {type(value).__name__} {value!r} (not a number) "
                          f"on completion {completion!r}")
    if not math.isfinite(value):
        raise RewardError(f"reward {r.name!r} returned {value} on completion {completion!r}")
    return float(value)


# ---- verifiers (eval --verifier NAME): a registered reward that returns 1 means "correct"


def verifier_fn(name: str) -> Callable:
    """The reward a verifier name stands for; an unknown name is a UserError."""
    fn = lookup(name)
    if fn is None and ".py:" in name:
        fn = parse_rewards([name])[0].fn
    if fn is None:
        raise UserError(f"--verifier must be auto, one of {', '.join(REWARDS)}, rg:TASK or file.py:FUNCTION, "
                        f"not {name!r}.")
    return fn


def verify(fn: Callable, row: dict, completion: str) -> bool:
    """True when the verifier `fn` gives the completion of this row (prompt, answer, ...) a reward of 1."""
    return fn(row.get("prompt", ""), completion, **row_fields(row)) == 1.0


def guess_verifier(rows: list[dict]) -> str:
    """rg:TASK for rows made from a reasoning-gym task, math when the first reference answer is a number, else
    exact."""
    if rows[0].get("rg_task"):
        return f"rg:{rows[0]['rg_task']}"
    return "math" if parse_number(str(rows[0]["answer"])) is not None else "exact"
