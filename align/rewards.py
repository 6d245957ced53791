"""Rewards: the one registry of verifiers and reward functions (grpo's --reward, ppo's gold reward, eval's
--verifier), answer checking, and user functions loaded from a Python file.

    math_reward("23 + 45 = 68. #### 68", "68")   -> 1.0
    sort_reward("1 3 7 9", "1 3 7 9")            -> 1.0

A reward function takes one of two forms (docs/rewards.md):
  per sample       fn(prompt, completion, **row) -> float, where `row` holds every other column of the data row
                   (e.g. `answer`);
  batched (TRL)    fn(prompts, completions, **kwargs) -> list[float | None], called by keyword with lists: every
                   other column as a list, and `completion_ids`; None: the reward does not apply to that sample.
A function whose `batched` attribute is True or False is of that form; else one with a parameter named `prompts`
or `completions` (TRL's names) is batched, any other per sample. `--reward SPEC` (repeatable), SPEC = NAME[:WEIGHT]
or path/to/file.py:FUNCTION[:WEIGHT]; the total reward is Σ weight · fn. Registered (REWARDS):
  math            1 if the answer (after ####, else \\boxed{}, else the last number) equals row["answer"]
  sort            fraction of positions matching the sorted list (row["answer"])
  sort_inclusion  (prompt items present + adjacent non-decreasing pairs) / (2n − 1)
  format          1 if the completion is <think>…</think> followed by a non-empty answer
  answer_format   1 if the completion ends with "#### <number>"
  exact           1 if the completion equals row["answer"] (surrounding white space ignored)
  length          Kimi k1.5 length reward within each group (needs math; computed per group: GROUP_REWARDS)
  env             the rewards an environment (--env) gave along the episode, summed (the stage adds them)
  rg:TASK         a reasoning-gym task's own scorer (optional extra; rows made by `align data make rg:TASK`)
A verifier (eval's --verifier) is a registered reward read as correct when it returns 1; `auto` picks rg:TASK for
rows made from a reasoning-gym task, math when every answer is a number or ends in one (what math reads), else
exact (`choose_verifier`, which says why).

extract_answer looks, in order, for the text after the last '####', the last \\boxed{...}, then the last number
anywhere; an answer that ends in a list of different numbers ("526.007 526.274", "3 or 5") gives none. Numbers
may carry signs, thousands separators ("1,234"), decimals and fractions ("3/4"); comparisons are exact on
fractions, then within a tolerance.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import math
import re
import signal
import threading
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable

from align.errors import UserError
from align.reward_errors import RETURNS, RewardError, as_number  # noqa: F401  (re-exported)

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


def reference_number(answer) -> tuple[str | None, Fraction | None]:
    """The number a reference answer stands for, as (its string, its exact value): the answer itself when it is a
    number ('68', '1,234', '3/4'), else the final answer of a full solution ('... #### 68', '\\boxed{68}', '... is
    68'); (None, None) when it has none ('blue', '3 5 7': a list names no single value)."""
    want = _fraction(answer)
    if want is not None:
        return answer, want
    ref = extract_answer(str(answer))
    return ref, _fraction(ref)


def math_reward(completion, answer, tol=1e-6):
    """1.0 if the completion's extracted answer equals the reference answer, else 0.0.

    Exact on fractions first, then |pred - answer| <= min(tol * max(1, |answer|), 0.5 * 10^-d) where d is the
    reference's decimal places: the relative tolerance absorbs float formatting ('0.3333333' for 1/3), and never
    exceeds half a unit of the reference's last digit, so 521219525 is not 521219524 and 2.5 is not 2.4. The
    reference may be a number string or a full solution ending in '#### N'; a reference with no number raises
    UserError.
    """
    ref, want = reference_number(answer)
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
GROUP_REWARDS = ("length", "env")  # no function of a completion: the stage computes them


@dataclass
class RewardFn:
    """A reward function of --reward (or a verifier): `fn` None for a group reward (length); `batched`: its form
    (`is_batched`); `path`: the user's file it was loaded from, or the URL it is served at (None for a registered
    one); `spec`: how the user named it (file.py:FUNCTION; a URL with its credentials hidden)."""

    name: str
    weight: float
    fn: Callable | None
    batched: bool = False
    path: str | None = None
    spec: str = ""

    def __call__(self, prompt, completion, **row):
        """The value of one completion, whatever the form: a batched function is called with batches of one."""
        if not self.batched:
            return self.fn(prompt, completion, **row)
        return self.fn(**batch_kwargs([{"prompt": prompt, **row}], [completion], [row.pop("completion_ids", None)]))[0]


# ---- user functions: the two forms, how they are called, and their checks

# TRL's names: a function with a parameter of either name is batched (TRL passes them by keyword)
BATCH_PARAMS = ("prompts", "completions")
BATCH_KEYWORDS = (*BATCH_PARAMS, "completion_ids")  # what a batched function is always given, beside the columns
PROBE_ROWS = 4  # the data rows a function is tried on before any model is built

def is_batched(fn: Callable) -> bool:
    """The form of a reward function: its `batched` attribute where it sets one (True or False: the explicit
    marker); else batched when a parameter is named `prompts` or `completions`; else per sample."""
    marker = getattr(fn, "batched", None)
    if isinstance(marker, bool):
        return marker
    params = _parameters(fn)
    return params is not None and any(name in params for name in BATCH_PARAMS)


def _parameters(fn: Callable):
    """fn's parameters by name (inspect), or None for a callable without a signature."""
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None


def forms(name: str) -> str:
    """The two signatures a reward function may have, for messages."""
    return (f"  per sample:    def {name}(prompt, completion, **row) -> float\n"
            f"  batched (TRL): def {name}(prompts, completions, **kwargs) -> list[float]\n"
            "(row / kwargs: the data row's other columns, e.g. answer; a batched function gets each as a list, and "
            f"completion_ids; a parameter named prompts or completions, or `{name}.batched = True`, makes it "
            "batched).")


def form_error(r: RewardFn, spec: str, flag: str, why: str) -> UserError:
    """A reward function that cannot be called as its form says: the two forms in the message."""
    name = getattr(r.fn, "__name__", r.name)
    return UserError(f"{flag} {spec}: {name}{_signature_text(r.fn)} {why}. A reward function has one of two forms:\n"
                     f"{forms(name)}", option=flag.lstrip("-").replace("-", "_"))


def _signature_text(fn: Callable) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def check_form(r: RewardFn, spec: str, flag: str = "--reward") -> None:
    """Refuse (UserError, both forms in the message) a function its form cannot call: per sample, one that takes
    no prompt and completion as its first two arguments; batched, one that takes prompts, completions and
    completion_ids by keyword neither by name nor through **kwargs. The data's columns are checked by `probe`."""
    params = _parameters(r.fn)
    if params is None:
        return
    P = inspect.Parameter
    kinds = [p.kind for p in params.values()]
    if r.batched:
        named = {n for n, p in params.items() if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
        missing = [] if P.VAR_KEYWORD in kinds else [n for n in BATCH_KEYWORDS if n not in named]
        if missing:
            raise form_error(r, spec, flag, f"is batched but takes no {', '.join(missing)} by keyword (add "
                                            "**kwargs)")
        return
    positional = [p for p in params.values() if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and P.VAR_POSITIONAL not in kinds:
        raise form_error(r, spec, flag, "takes no prompt and completion as its first two arguments")
    if any(p.kind is P.POSITIONAL_ONLY and p.default is P.empty for p in positional[2:]):
        raise form_error(r, spec, flag, "needs more than two positional arguments")


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
        raise UserError(f"{path}: no function {name!r}. A reward function has one of two forms:\n{forms(name)}")
    return fn


# functions handed to the Python API (align.grpo(reward=fn)): registered in this process as python:NAME specs
PYTHON_REWARDS: dict[str, Callable] = {}


def python_reward(fn: Callable, weight: float = 1.0) -> str:
    """The --reward spec `python:NAME[:WEIGHT]` of a Python function given to the API, registered in this process
    under NAME (its module and qualified name; another function of the same name gets a numbered one). The spec is
    what the run's artifact.json records; the function's source file is hashed into its inputs (`spec_file`)."""
    if not callable(fn):
        raise UserError(f"reward {fn!r} is neither a function nor a --reward spec.")
    base = f"{getattr(fn, '__module__', None) or 'fn'}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    base = re.sub(r"[^\w.]", "_", base)  # <lambda>, <locals>: no ':' nor brackets in a spec
    name, n = base, 1
    while PYTHON_REWARDS.get(name, fn) is not fn:
        n += 1
        name = f"{base}_{n}"
    PYTHON_REWARDS[name] = fn
    return f"python:{name}" + (f":{weight:g}" if weight != 1.0 else "")


def _python_fn(name: str, flag: str) -> Callable:
    fn = PYTHON_REWARDS.get(name)
    if fn is None:
        raise UserError(f"{flag} python:{name}: names a Python function given to align's Python API "
                        "(align.grpo(reward=fn)) in that process; here name a file: path/to/file.py:FUNCTION.")
    return fn


def lookup(name: str) -> Callable | None:
    """The reward function registered as `name` (a REWARDS key or rg:TASK), or None."""
    if name.startswith("rg:"):
        from align import rgym

        return rgym.reward(name[3:])
    return REWARDS.get(name)


def _split(spec: str) -> tuple[list[str], float]:
    """A spec's parts and weight: 'f.py:fn:0.5' -> (['f.py', 'fn'], 0.5)."""
    parts, weight = spec.split(":"), 1.0
    if len(parts) > 1 and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", parts[-1]):
        weight = float(parts.pop())
    return parts, weight


def spec_file(spec: str) -> str | None:
    """The user's Python file a --reward / --verifier spec names (path/to/file.py:FUNCTION[:WEIGHT]), else None."""
    parts, _ = _split(spec)
    if len(parts) == 2 and parts[0] == "python" and parts[1] in PYTHON_REWARDS:  # the API's: where it is written
        try:
            return inspect.getsourcefile(PYTHON_REWARDS[parts[1]])
        except TypeError:  # a builtin or a C function: no source file
            return None
    return parts[0] if len(parts) == 2 and parts[0].endswith(".py") else None


def _is_url(spec) -> bool:
    from align.reward_http import is_url

    return is_url(spec)


def _url_reward(spec: str, flag: str) -> RewardFn:
    """The reward a URL serves (align.reward_http): batched, named by the URL's last path segment, its spec and
    path the URL with its credentials hidden."""
    from align.reward_http import HttpReward, split_spec

    url, weight = split_spec(spec)
    client = HttpReward(url, flag)
    return RewardFn(client.name, weight, client, True, client.shown, client.shown)


def parse_rewards(specs: list[str], flag: str = "--reward", judge_rubric: str = "") -> list[RewardFn]:
    """The reward functions of --reward specs NAME[:WEIGHT], rg:TASK[:WEIGHT], file.py:FUNCTION[:WEIGHT],
    judge:MODEL[:WEIGHT], http(s)://HOST:PORT/PATH[:WEIGHT] (`flag` names the option in messages; `judge_rubric`:
    the judge's rubric text, default align.judge.RUBRIC); a user function is checked against its form
    (`check_form`)."""
    out = []
    for spec in specs:
        if _is_url(spec):  # http(s)://HOST:PORT/PATH[:WEIGHT]: a reward served over HTTP (align.reward_http)
            out.append(_url_reward(spec, flag))
            continue
        parts, weight = _split(spec)
        if len(parts) == 2 and (parts[0] in REWARDS or parts[0] in GROUP_REWARDS):
            raise UserError(f"{flag} {spec}: the weight {parts[1]!r} is not a number (NAME:WEIGHT, e.g. "
                            f"{parts[0]}:0.5).")
        if parts[0] == "rg" and len(parts) == 2:
            name = ":".join(parts)
            out.append(RewardFn(name, weight, lookup(name)))
        elif parts[0] == "judge" and len(parts) == 2:  # an LLM judge's score in [0, 1] (align.judge)
            from align import judge

            out.append(RewardFn("judge", weight, judge.reward(parts[1], judge_rubric or judge.RUBRIC), True, None,
                                spec))
        elif parts[0] == "python" and len(parts) == 2:
            fn = _python_fn(parts[1], flag)
            out.append(RewardFn(parts[1], weight, fn, is_batched(fn), getattr(fn, "__module__", None) or "python",
                                spec))
            check_form(out[-1], spec, flag)
        elif parts[0].endswith(".py"):
            if len(parts) != 2:
                raise UserError(f"{flag} {spec}: a user reward is path/to/file.py:FUNCTION[:WEIGHT].")
            fn = _load_user_fn(parts[0], parts[1])
            out.append(RewardFn(f"{Path(parts[0]).stem}.{parts[1]}", weight, fn, is_batched(fn), parts[0],
                                ":".join(parts)))
            check_form(out[-1], spec, flag)
        elif len(parts) == 1 and parts[0] in REWARDS:
            out.append(RewardFn(parts[0], weight, REWARDS[parts[0]]))
        elif len(parts) == 1 and parts[0] in GROUP_REWARDS:
            out.append(RewardFn(parts[0], weight, None))
        else:
            known = ", ".join([*REWARDS, *GROUP_REWARDS])
            raise UserError(f"{flag} {spec}: unknown reward; built-ins: {known}, rg:TASK (reasoning-gym), "
                            "judge:MODEL (an LLM judge), path/to/file.py:FUNCTION, or http://HOST:PORT/PATH (a "
                            "reward server).")
    if not out:
        raise UserError("give at least one --reward (e.g. --reward math).")
    if any(r.name == "length" for r in out) and not any(r.name == "math" for r in out):
        raise UserError("--reward length scores length among correct answers: add --reward math too.")
    return out


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


def is_chat(prompt) -> bool:
    """A conversational prompt: a list of {role, content} messages."""
    return isinstance(prompt, list)


def batch_kwargs(rows: list[dict], completions: list[str], ids: list | None = None) -> dict:
    """A batched function's keyword arguments, as TRL's GRPOTrainer passes them: prompts, completions (where the
    prompts are message lists, each completion as [{"role": "assistant", "content": text}]), completion_ids, and
    every other column of the rows as a list (a row without it: None)."""
    chat = bool(rows) and is_chat(rows[0]["prompt"])
    kwargs = {"prompts": [row["prompt"] for row in rows],
              "completions": [[{"role": "assistant", "content": c}] if chat else c for c in completions],
              "completion_ids": list(ids) if ids is not None else [None] * len(completions)}
    columns = dict.fromkeys(k for row in rows for k in row_fields(row) if k not in BATCH_KEYWORDS)
    kwargs.update({k: [row.get(k) for row in rows] for k in columns})
    return kwargs


def _checked(r: RewardFn, value, completion) -> float:
    """`value` as a reward, or RewardError: not a number (kind type), NaN or inf (kind value)."""
    number = as_number(value)
    if number is None:
        note = "; None (does not apply) is for a batched function's list" if value is None and not r.batched else ""
        raise RewardError(f"reward {r.name!r} returned {type(value).__name__} {value!r:.80} (not a number{note}) "
                          f"on completion {completion!r}", "type")
    if not math.isfinite(number):
        raise RewardError(f"reward {r.name!r} returned {number} on completion {completion!r}", "value")
    return number


def call_reward(r: RewardFn, prompt: str, completion: str, row: dict, timeout: float = 0.0) -> float:
    """One reward value of a per-sample function; raises RewardError (with the offending completion) on an
    exception, NaN, inf, a non-number, or a call that takes longer than `timeout` seconds."""
    extra = row_fields(row)
    try:
        with _time_limit(timeout):
            value = r.fn(prompt, completion, **extra)
    except _TimeUp:
        raise RewardError(f"reward {r.name!r} took longer than {timeout:g} s on completion {completion!r}",
                          "timeout") from None
    except Exception as e:
        raise RewardError(f"reward {r.name!r} raised {type(e).__name__}: {e} on completion {completion!r}",
                          "input" if isinstance(e, UserError) else "raised") from None
    return _checked(r, value, completion)


def call_rewards(r: RewardFn, rows: list[dict], completions: list[str], ids: list | None = None,
                 timeout: float = 0.0) -> list:
    """r's value of each completion i of data row rows[i]: a float, None (a batched function's "does not apply")
    or a RewardError (the sample's failure; a batched call that raised or ran past `timeout` seconds per
    completion fails every sample of the batch). A per-sample function is called once a completion, a batched one
    once for them all."""
    if not r.batched:
        out = []
        for row, c in zip(rows, completions):
            try:
                out.append(call_reward(r, row["prompt"], c, row, timeout))
            except RewardError as e:
                out.append(e)
        return out
    return _call_batched(r, rows, completions, ids, timeout)


def _call_batched(r: RewardFn, rows: list[dict], completions: list[str], ids, timeout: float) -> list:
    """call_rewards of a batched function: one call, then each value checked."""
    n = len(completions)
    where = f"a batch of {n} completions, the first {completions[0]!r}" if n else "no completions"
    timed = getattr(r.fn, "timed", None)  # a URL's client: limits each request itself, reports its own failures
    try:
        if timed is not None:
            out = timed(timeout, **batch_kwargs(rows, completions, ids))
        else:
            with _time_limit(timeout * n):
                out = r.fn(**batch_kwargs(rows, completions, ids))
    except _TimeUp:
        return [RewardError(f"reward {r.name!r} took longer than {timeout * n:g} s (--reward-timeout {timeout:g} s "
                            f"a completion) on {where}", "timeout")] * n
    except Exception as e:
        return [RewardError(f"reward {r.name!r} raised {type(e).__name__}: {e} on {where}",
                            "input" if isinstance(e, UserError) else "raised")] * n
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__") or len(out) != n:
        got = f"{type(out).__name__} of {len(out)}" if hasattr(out, "__len__") else f"{type(out).__name__} {out!r:.80}"
        return [RewardError(f"reward {r.name!r} is batched and returned {got}, not a list of {n} values (one per "
                            f"completion) on {where}", "type")] * n
    values = []
    for v, c in zip(out, completions):
        try:
            values.append(v if v is None or isinstance(v, RewardError) else _checked(r, v, c))
        except RewardError as e:
            values.append(e)
    return values


def every_number(r: RewardFn, values: list) -> list[float]:
    """`values` (call_rewards') when each is a number; else the first failure as a RewardError (None too: a
    reward that must score every completion — a gold reward, a verifier — cannot call one "not applicable")."""
    for v in values:
        if isinstance(v, RewardError):
            raise v
        if v is None:
            raise RewardError(f"reward {r.name!r} returned None (does not apply) for a completion; here every "
                              "completion needs a score", "type")
    return values


# ---- the check before any model is built: each function tried on the data's first rows


def _candidates(rows: list[dict]) -> list[list[str]]:
    """Completions a probe tries, one list per kind, each a completion per row: the rows' answers, their
    reference completions, empty text."""
    out = []
    for key in ("answer", "completion"):
        if all(isinstance(row.get(key), (str, int, float)) and not isinstance(row.get(key), bool) for row in rows):
            out.append([str(row[key]) for row in rows])
    out.append([""] * len(rows))
    return [c for i, c in enumerate(out) if c not in out[:i]]


def _bind_error(r: RewardFn, rows: list[dict]) -> str | None:
    """Why the rows' columns cannot be passed to r in its form (TypeError's words), or None."""
    try:
        signature = inspect.signature(r.fn)
    except (TypeError, ValueError):
        return None
    try:
        if r.batched:
            signature.bind(**batch_kwargs(rows, [""] * len(rows)))
        else:
            for row in rows:
                signature.bind(row["prompt"], "", **row_fields(row))
    except TypeError as e:
        return str(e)
    return None


def probe(fns: list[RewardFn], rows: list[dict], flag: str = "--reward", *, timeout: float = 0.0, tokenizer=None,
          where: str = "") -> None:
    """Try each function on the first PROBE_ROWS rows of the data (`where`: the file) before any model is built:
    its signature against the data's columns, and its return on probe completions (the rows' answers, else their
    reference completions, else empty text; `tokenizer` makes their completion_ids). A wrong signature or a return
    that is not a number (a batched function: not a list of one per completion) is a UserError naming both forms,
    whatever --on-reward-error says; so is bad data a registered reward refuses on every probe completion (math
    on an answer that is no number). A function that raises otherwise (or runs past `timeout`) on every probe
    completion is warned of: a probe completion is not a sampled one, and a function may rightly refuse it."""
    head = rows[:PROBE_ROWS]
    for r in fns:
        if r.fn is not None and head:
            _probe_one(r, head, flag, timeout, tokenizer, where)


def _probe_values(r: RewardFn, rows: list[dict], texts: list[str], ids, timeout: float) -> list:
    """call_rewards on the probe rows; a per-sample function's rows one at a time, the first timeout the last."""
    if r.batched:
        return call_rewards(r, rows, texts, ids, timeout)
    values = []
    for i, row in enumerate(rows):
        values += call_rewards(r, [row], texts[i:i + 1], ids[i:i + 1] if ids else None, timeout)
        if isinstance(values[-1], RewardError) and values[-1].kind == "timeout":
            break
    return values


def _probe_one(r: RewardFn, rows: list[dict], flag: str, timeout: float, tokenizer, where: str) -> None:
    from align.console import warn

    spec, option, where = r.spec or r.name, flag.lstrip("-").replace("-", "_"), where or "the data"
    columns = ", ".join(dict.fromkeys(k for row in rows for k in row_fields(row))) or "none"
    if bad := _bind_error(r, rows):
        raise form_error(r, spec, flag, f"cannot take the columns of {where} ({columns}): {bad}")
    failures = []
    for texts in _candidates(rows):
        ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts] if tokenizer is not None else None
        values = _probe_values(r, rows, texts, ids, timeout)
        if wrong := next((v for v in values if isinstance(v, RewardError) and v.kind == "type"), None):
            fix = (wrong.fix() if type(wrong) is not RewardError else  # a URL's: the protocol, not the two forms
                   f"{RETURNS} The two forms:\n{forms(getattr(r.fn, '__name__', r.name))}")
            raise UserError(f"{flag} {spec}: {wrong} (one of the first rows of {where}, before any model is built). "
                            f"{fix}", option=option)
        if any(not isinstance(v, RewardError) for v in values):
            return
        failures.append(values[0])
        if values[-1].kind == "timeout":
            break
    if all(f.kind == "input" for f in failures):
        raise UserError(f"{flag} {spec}: {failures[0]} (the first rows of {where}, before any model is built).",
                        option=option)
    warn(f"{flag} {spec}: {failures[0]}: it failed on every probe completion of the first rows of {where} (their "
         "answers, reference completions, empty text) before any model was built; a sampled completion may fare "
         "better, but check the function")


# ---- verifiers (eval --verifier NAME): a registered reward that returns 1 means "correct"


def verifier_fn(name: str) -> RewardFn:
    """The reward a verifier name stands for (callable as fn(prompt, completion, **row) in either form); an
    unknown name is a UserError."""
    fn = lookup(name)
    if fn is not None:
        return RewardFn(name, 1.0, fn)
    if ".py:" in name or name.startswith("python:") or _is_url(name):
        return parse_rewards([name], "--verifier")[0]
    raise UserError(f"--verifier must be auto, one of {', '.join(REWARDS)}, rg:TASK, file.py:FUNCTION or "
                    f"http://HOST:PORT/PATH, not {name!r}.")


def verify(fn: Callable, row: dict, completion: str, ids: list[int] | None = None) -> bool:
    """True when the verifier `fn` (a RewardFn, or a per-sample function) gives the completion of this row
    (prompt, answer, ...) a reward of 1. A user's verifier that raises is a UserError naming the completion."""
    if not isinstance(fn, RewardFn):
        return fn(row.get("prompt", ""), completion, **row_fields(row)) == 1.0
    if fn.path is None:
        return fn.fn(row.get("prompt", ""), completion, **row_fields(row)) == 1.0
    (value,) = call_rewards(fn, [{"prompt": "", **row}], [completion], [ids])
    if isinstance(value, RewardError):
        raise UserError(f"--verifier: {value}. {value.fix()}") from None
    return value == 1.0


@dataclass(frozen=True)
class Verifier:
    """How a stage checks answers: `name` the verifier it uses (auto made concrete), `why` auto's reason ('' when
    the user named it), `fn` its function."""

    name: str
    why: str
    fn: RewardFn

    @property
    def line(self) -> str:
        """What the stage says of it in its first lines: 'verifier: math (auto: the answers are numbers)'."""
        return f"verifier: {self.name}" + (f" (auto: {self.why})" if self.why else "")

    def record(self) -> dict:
        """artifact.json's "verifier": the concrete choice, and why when auto chose it."""
        return {"name": self.name, "auto": bool(self.why), **({"why": self.why} if self.why else {})}

    def check(self, row: dict, completion: str, ids: list[int] | None = None) -> bool:
        return verify(self.fn, row, completion, ids)


def auto_verifier(rows: list[dict]) -> tuple[str, str]:
    """(verifier, why) for --verifier auto: rg:TASK for rows made from a reasoning-gym task; math when every
    reference answer is a number or ends in one (`reference_number`: what math compares with); else exact."""
    if rows[0].get("rg_task"):
        return f"rg:{rows[0]['rg_task']}", f"the rows were made by reasoning-gym's {rows[0]['rg_task']}"
    answers = [row.get("answer") for row in rows]
    plain = [i for i, a in enumerate(answers) if _fraction(a) is None]
    if not plain:
        return "math", "the answers are numbers"
    other = [i for i in plain if reference_number(answers[i])[1] is None]
    if not other:
        return "math", "the answers are numbers or end in one"
    if len(other) == len(answers):
        return "exact", "the answers are not numbers"
    i = other[0]
    return "exact", f"{len(other)} of {len(answers)} answers are not numbers, e.g. row {i + 1}'s {answers[i]!r:.40}"


def choose_verifier(setting: str, rows: list[dict], tokenizer=None, where: str = "") -> Verifier:
    """The verifier of `setting` (--verifier: a name, or auto) for `rows`, tried on their first rows (`probe`)
    before any model is built."""
    name, why = auto_verifier(rows) if setting == "auto" else (setting, "")
    fn = verifier_fn(name)
    v = Verifier(fn.spec if _is_url(name) else name, why, fn)  # a URL as shown: its credentials hidden
    probe([v.fn], rows, "--verifier", tokenizer=tokenizer, where=where)
    return v


def guess_verifier(rows: list[dict]) -> str:
    """The verifier --verifier auto picks for rows (auto_verifier)."""
    return auto_verifier(rows)[0]
