"""Reward shaping (kind "shaping"): terms GRPO adds to a group's rewards from its completions' lengths,

    fn(lengths: list[int], correct: list[bool], *, max_len: int, cache: int) -> list[float]

`lengths` of one group's completions (a truncated one counts as max_len + 1), `correct` whether each solved the
problem, `max_len` the token budget (--max-new-tokens), `cache` --overlong-cache.
"""

from __future__ import annotations

from align.objectives.registry import register


@register("shaping", "overlong", help="DAPO's soft overlong punishment over the last --overlong-cache tokens")
def overlong_penalty(lengths: list[int], correct: list[bool] | None = None, *, max_len: int, cache: int) -> list[float]:
    """DAPO (Yu et al. 2025) soft overlong punishment: 0 up to L_max − L_cache, then falling linearly to −1 at
    L_max and staying there: R(n) = min(0, max(−1, ((L_max − L_cache) − n) / L_cache))."""
    start = max_len - cache
    return [0.0 if n <= start else max(-1.0, (start - n) / cache) for n in lengths]


@register("shaping", "length", help="Kimi k1.5's length reward within a group (--reward length)")
def length_rewards(lengths: list[int], correct: list[bool], *, max_len: int = 0, cache: int = 0) -> list[float]:
    """Kimi k1.5 (Kimi Team 2025) length reward within a group: λ = 0.5 − (len − min_len)/(max_len − min_len);
    correct answers get λ, wrong ones min(0, λ). All equal lengths give 0."""
    lo, hi = min(lengths), max(lengths)
    if hi == lo:
        return [0.0] * len(lengths)
    lam = [0.5 - (n - lo) / (hi - lo) for n in lengths]
    return [lm if c else min(0.0, lm) for lm, c in zip(lam, correct)]
