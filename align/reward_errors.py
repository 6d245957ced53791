"""What a reward function's value must be and how a failed one is reported: shared by align.rewards (the
in-process functions) and align.reward_http (rewards served over HTTP), which align.rewards reads URLs with."""

from __future__ import annotations

RETURNS = ("A reward is a number (float, int, bool or a NumPy scalar); a batched function returns a list of them, "
           "one per completion, None where the reward does not apply.")


class RewardError(Exception):
    """A reward that failed on a completion: `kind` raised, input (raised UserError: a registered reward refused the
    data, e.g. math an answer that is no number; a URL: the server refused the request, HTTP 4xx, or could not be
    reached), timeout, value (NaN, inf) or type (not a number: a bug in the function, which the probe refuses
    whatever --on-reward-error says)."""

    def __init__(self, message: str, kind: str = "raised"):
        super().__init__(message)
        self.kind = kind

    def fix(self) -> str:
        """What to do, for a run that stops on it."""
        if self.kind == "type":
            return RETURNS
        if self.kind == "input":
            return "Fix the data, or pass --on-reward-error skip|zero."
        return "Fix the function, or pass --on-reward-error skip|zero."


def as_number(value) -> float | None:
    """A reward value as a float: anything float() takes but text and arrays (a bool, an int, a NumPy scalar, a
    0-d tensor); None when it is not one."""
    if isinstance(value, (str, bytes)) or getattr(value, "ndim", 0) or not hasattr(value, "__float__"):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
