"""Verifiable rewards: a math answer checker and list-sorting rewards.

    math_reward("23 + 45 = 68. #### 68", "68")   -> 1.0
    sort_reward("1 3 7 9", "1 3 7 9")            -> 1.0

extract_answer looks, in order, for the text after the last '####', the last \\boxed{...},
then the last number anywhere. Numbers may carry signs, thousands separators ("1,234"),
decimals and fractions ("3/4"); comparisons are exact on fractions, then within a tolerance.
"""

import re
from fractions import Fraction

from align.errors import UserError

# A number: optional sign (only where it cannot be a binary minus), an integer with optional
# thousands groups or a decimal, then an optional "/denominator".
_INT = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)"
_NUM_RE = re.compile(
    rf"(?:(?<![\w)\]}}.])[-+])?(?<![\d.])(?:{_INT}(?:\.\d+)?|\.\d+)(?:/\d+(?:\.\d+)?)?"
)
_FRAC_RE = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_LIST_INT_RE = re.compile(r"(?<![\d.])-?\d+")


def _numbers(text):
    """All number strings in text, normalised (no commas, ASCII minus, no leading '+')."""
    text = text.replace("\u2212", "-")
    return [m.group().replace(",", "").lstrip("+") for m in _NUM_RE.finditer(text)]


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
    in the last \\boxed{...}, else the last number in the text.
    """
    if not text:
        return None
    if "####" in text:
        found = _numbers(text.rsplit("####", 1)[1])
        return found[0] if found else None
    boxed = _last_boxed(text)
    if boxed is not None:
        found = _numbers(_unlatex(boxed))
        return found[-1] if found else None
    found = _numbers(text)
    return found[-1] if found else None


def _fraction(s):
    """Exact Fraction for a number string like '-1,234.5', '$68', '3/4' or '50%'; None if not one."""
    if s is None:
        return None
    s = str(s).strip().replace("\u2212", "-").replace(",", "").replace("$", "")
    s = s.rstrip(".").removesuffix("%").strip()
    if not re.fullmatch(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+(?:\.\d+)?)?", s):
        return None
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


def math_reward(completion, answer, tol=1e-6):
    """1.0 if the completion's extracted answer equals the reference answer, else 0.0.

    Exact on fractions first, then within tol * max(1, |answer|). The reference may be a number
    string or a full solution ending in '#### N'; a reference with no number raises UserError.
    """
    ref = _fraction(answer)
    if ref is None:
        ref = _fraction(extract_answer(str(answer)))
    if ref is None:
        raise UserError(f"reference answer {answer!r} is not a number; fix the dataset's answer column")
    pred = _fraction(extract_answer(completion))
    if pred is None:
        return 0.0
    if pred == ref or abs(float(pred) - float(ref)) <= tol * max(1.0, abs(float(ref))):
        return 1.0
    return 0.0


def parse_int_list(text):
    """All integers in text, in order: '1, 3 -2 7' -> [1, 3, -2, 7]. A '-' after a digit is not a sign."""
    return [int(x) for x in _LIST_INT_RE.findall(text or "")]


def sort_distance_reward(prompt_list, response_list):
    """Number of positions where the response equals sorted(prompt) (zips to the shorter list)."""
    return float(sum(1 for x, y in zip(response_list, sorted(prompt_list)) if x == y))


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


REWARDS = {"math": math_reward, "sort": sort_reward}


def get_reward(name):
    """The reward function registered under name ('math' or 'sort')."""
    if name not in REWARDS:
        raise UserError(f"unknown reward {name!r}; valid rewards: {', '.join(REWARDS)}")
    return REWARDS[name]
