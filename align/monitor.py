"""RLMonitor: the one health checker every training stage feeds each step.

The trainer calls `events = monitor.update(step, metrics)` once per logged step. The monitor
keeps the history of every metric key it has seen, runs every rule and returns the events
that *started* this step. Rules whose metric is never logged stay silent, so one default
rule set serves SFT, RM, DPO, PPO and GRPO alike.

Metric keys follow TRL naming: loss, grad_norm, kl, reward, entropy, clip_ratio,
completions/mean_length, completions/mean_terminated_length, completions/clipped_ratio, distinct_1, distinct_2,
logps/chosen, gold_reward.

A rule's check is a pure function `check(*series, window=..., **params) -> Check`, where
each series is the history (list of floats) of one of the rule's metric keys. Pure Python,
no torch, so importing this module is instant.
"""

import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, NamedTuple

from align.errors import UserError

SEVERITIES = ("warn", "stop")
RULE_OPTIONS = ("enabled", "severity", "short_run", "window", "message")  # overridable besides a rule's params
NOISE_SPAN = 5  # drop tests estimate the step noise over the last NOISE_SPAN * window values


class Check(NamedTuple):
    """Result of one rule check. `metric` names the key that fired when a rule reads several."""

    fired: bool
    value: float = math.nan
    threshold: float = math.nan
    detail: str = ""
    metric: str = ""


QUIET = Check(False)


@dataclass
class Rule:
    """One health rule: which metric it reads, how it is checked, and what to do when it fires."""

    name: str
    metric: str  # primary metric key; events report it
    check: Callable[..., Check]
    severity: str = "warn"  # "warn" | "stop"
    window: int = 10
    message: str = ""  # plain text: likely cause and the fix
    params: dict = field(default_factory=dict)  # threshold params, passed to check as keywords
    extra: tuple = ()  # further metric keys the check reads, after `metric`
    aligned: bool = False  # check sees only steps where all keys were logged in the same update
    enabled: bool = True
    at_end: bool = False  # also judged once at the end over the whole run, when the run was shorter than `window`
    # the severity of that judgement of a run shorter than `window` ("": the rule's own): a stop rule whose verdict
    # a short run cannot support (no_signal: a smoke test of a task the model already solves) only warns there
    short_run: str = ""
    # --on-alarm rollback's advised change: factors for the learning rate ("lr") and the KL coefficient ("kl");
    # {} : nothing a rollback would fix (the run stops instead)
    remedy: dict = field(default_factory=lambda: {"lr": 0.5})
    # (key, substitute) pairs: where a run logs the substitute, the rule reads it in place of the key
    # (reward_hacking: a GRPO run's proxy_reward, the learned scorers' part of a reward that holds a verifier's too)
    substitutes: tuple = ()

    def __post_init__(self):
        if self.severity not in SEVERITIES or self.short_run not in ("", *SEVERITIES):
            raise ValueError(f"rule {self.name}: severity must be one of {SEVERITIES}, got {self.severity!r}")

    @property
    def end_severity(self) -> str:
        """The severity of the judgement over a whole run shorter than the window (a warn rule never stops)."""
        return "stop" if self.severity == "stop" and (self.short_run or "stop") == "stop" else "warn"

    @property
    def keys(self) -> tuple:
        return (self.metric, *self.extra)

    def read(self, logged) -> tuple:
        """The keys the rule reads where `logged` holds these metrics: each of `keys`, or its substitute where
        that is logged."""
        swap = dict(self.substitutes)
        return tuple(swap[k] if swap.get(k) in logged else k for k in self.keys)


@dataclass
class Event:
    """A rule that started firing (or, for severity stop, fired again) at `step`."""

    step: int
    rule: str
    severity: str
    metric: str
    value: float
    threshold: float
    message: str
    detail: str = ""

    def to_dict(self) -> dict:
        """JSON-safe dict: non-finite floats become the strings "nan", "inf", "-inf"."""
        d = asdict(self)
        for k in ("value", "threshold"):
            if not math.isfinite(d[k]):
                d[k] = str(d[k])
        return d

    def __str__(self) -> str:
        return f"[{self.severity}] step {self.step} {self.rule}: {self.detail}. {self.message}"


# ---------------------------------------------------------------------------------------------
# small statistics helpers


def _finite(xs: list) -> list:
    return [x for x in xs if math.isfinite(x)]


def _mean(xs: list) -> float:
    """Mean of the finite values; nan if there are none (nan compares False, so rules stay quiet)."""
    xs = _finite(xs)
    return sum(xs) / len(xs) if xs else math.nan


def _noise_sd(xs: list) -> float:
    """Per-step noise s.d. from successive differences, sqrt(mean((x[i] - x[i-1])^2) / 2).

    Unlike the sample s.d. it is not inflated by slow trends, so it measures the step-to-step noise.
    """
    xs = _finite(xs)
    diffs = [y - x for x, y in zip(xs, xs[1:])]
    return math.sqrt(sum(d * d for d in diffs) / (2 * len(diffs))) if diffs else math.inf


def _slope(ys: list) -> tuple:
    """Least-squares slope of ys against 0..n-1 and its standard error."""
    n = len(ys)
    xbar, ybar = (n - 1) / 2, sum(ys) / n
    sxx = sum((i - xbar) ** 2 for i in range(n))
    slope = sum((i - xbar) * (y - ybar) for i, y in enumerate(ys)) / sxx
    ssr = sum((y - ybar - slope * (i - xbar)) ** 2 for i, y in enumerate(ys))
    return slope, math.sqrt(ssr / (n - 2) / sxx) if n > 2 else math.inf


def _significant_drop(before: list, after: list, noise: list, min_drop: float, min_z: float) -> tuple:
    """(fired, drop): the mean fell from `before` to `after` by more than min_drop and by more
    than min_z standard errors, the per-step noise being estimated on `noise`."""
    drop = _mean(before) - _mean(after)
    stderr = _noise_sd(noise) * math.sqrt(1 / len(before) + 1 / len(after))
    return drop > min_drop and drop > min_z * stderr, drop


LEARNING_WINDOW = 10  # _learning compares the first and the last this many steps of the reward and truncated share
MIN_TRUNCATION_RISE = 0.1  # a rise of the truncated share that shows answers running into the limit: a tenth of them


def _learning(reward: list, truncated: list, min_z: float, max_truncated: float, what: str = "reward") -> tuple:
    """(learning, why): does the run show that it is learning the task, so that a policy growing sharper (lower
    entropy, fewer distinct n-grams, shorter answers) is converging onto answers the reward pays for? Both must hold:

    - the reward rose: the mean of its last LEARNING_WINDOW values is above the mean of its first ones by more than
      min_z standard errors (step noise from successive differences over the last NOISE_SPAN windows; half the run
      each while it is shorter than two windows);
    - the answers end: the share of completions cut off at the token limit (`completions/clipped_ratio`) over the
      last LEARNING_WINDOW steps is at most max_truncated, and it did not grow since the start (by more than
      MIN_TRUNCATION_RISE and beyond its noise). A policy converging onto an answer template ends its answers as
      before or more often; one collapsing into a loop (a repetition the reward pays for) runs to the limit: nearly
      every answer, or more and more of them.

    Without either series (a stage that does not log them) nothing shows learning: (False, why). `what` names the
    reward in `why`."""
    reward, truncated = _finite(reward), _finite(truncated)
    k, j = min(LEARNING_WINDOW, len(reward) // 2), min(LEARNING_WINDOW, len(truncated) // 2)
    if k < 3 or j < 3:
        return False, "too short a reward and truncated-answer history to show that the run is learning"
    first, last = reward[:k], reward[-k:]
    rose, _ = _significant_drop(last, first, reward[-NOISE_SPAN * LEARNING_WINDOW :], 0.0, min_z)
    if not rose:
        return False, f"the {what} did not rise beyond its noise ({_mean(first):.3g} -> {_mean(last):.3g})"
    start, share = _mean(truncated[:j]), _mean(truncated[-j:])
    if share > max_truncated:
        return False, (f"the {what} rose, but {share:.0%} of the answers of the last {j} steps ran to the token "
                       f"limit: a collapse onto output that does not end")
    grew, _ = _significant_drop(truncated[-j:], truncated[:j], truncated[-NOISE_SPAN * LEARNING_WINDOW :],
                                MIN_TRUNCATION_RISE, min_z)
    if grew:
        return False, (f"the {what} rose, but the share of answers cut off at the token limit grew ({start:.0%} -> "
                       f"{share:.0%}): answers that stop ending")
    return True, ""


def _unless_learning(res: Check, reward: list, truncated: list, gold: list, min_z: float,
                     max_truncated: float) -> Check:
    """A fired `res` of a sharpening rule, or QUIET while the run is learning (_learning); a fired check given the
    reward history says why learning does not explain it. The gold reward (a verifier's, logged beside a reward
    model's proxy) is the evidence where the run logs it: a policy growing confident raises the score of a reward
    model that pays for confidence, not the verified one."""
    if not res.fired or not (reward or gold):
        return res
    evidence, what = (gold, "gold reward") if _finite(gold) else (reward, "reward")
    learning, why = _learning(evidence, truncated, min_z, max_truncated, what)
    return QUIET if learning else res._replace(detail=f"{res.detail}; {why}")


# ---------------------------------------------------------------------------------------------
# checks: pure functions over metric histories


def check_nonfinite(loss: list, grad_norm: list, window: int) -> Check:
    """Fires when the latest loss or grad_norm is NaN or inf."""
    for key, xs in (("loss", loss), ("grad_norm", grad_norm)):
        if xs and not math.isfinite(xs[-1]):
            return Check(True, xs[-1], math.inf, f"{key} is {xs[-1]}", key)
    return QUIET


def check_spike(xs: list, window: int, factor: float, max_value: float, min_history: float,
                min_value: float = 0.0, skip_zero: bool = False) -> Check:
    """Latest value > max_value, or > factor x median of the previous `window` values and > min_value.

    The jump test catches a single step that a window mean (check_above) averages away; min_value keeps
    tiny absolute values (early KL of ~0.01 nats) from firing on noise. skip_zero leaves exact zeros out of the
    history: a gradient norm of 0 is a step without an update (GRPO with no group carrying signal), not a baseline
    (with it, the first step that learns anything was "10x the median")."""
    x = xs[-1]
    if not math.isfinite(x):
        return QUIET  # the nan rule owns non-finite values
    if x > max_value:
        return Check(True, x, max_value, f"latest {x:.4g} > {max_value:.4g}")
    prev = [v for v in _finite(xs[-window - 1 : -1]) if not (skip_zero and v == 0)]
    if len(prev) < min_history:
        return QUIET
    jump = factor * statistics.median(prev)
    limit = max(min_value, jump)
    if x > limit:
        floor = f" and > {min_value:g}" if min_value else ""
        return Check(True, x, limit, f"latest {x:.4g} > {factor:g} x the median of the previous {len(prev)} "
                                     f"({factor:g} x {jump / factor:.4g} = {jump:.4g}){floor}")
    return QUIET


def check_above(xs: list, window: int, max_value: float) -> Check:
    """Mean of the last `window` values (fewer at the start) > max_value."""
    m = _mean(xs[-window:])
    if m > max_value:
        return Check(True, m, max_value, f"mean of last {min(window, len(xs))} values {m:.4g} > {max_value:.4g}")
    return QUIET


def check_median_above(xs: list, window: int, max_value: float) -> Check:
    """Median of the last `window` values > max_value: most of the last steps are over the limit (a sustained rise,
    caught as soon as it holds for a majority of the window, where a window mean waits until the excess has paid
    for the quiet steps before it; a single spike alone does not move the median)."""
    last = _finite(xs[-window:])
    if len(last) < window:
        return QUIET
    m = statistics.median(last)
    if m > max_value:
        return Check(True, m, max_value, f"median of the last {window} values {m:.4g} > {max_value:.4g}")
    return QUIET


def check_abandoned(calls: list, reward: list = (), *, window: int, max_ratio: float, min_calls: float) -> Check:
    """The policy gives up its tools while its reward falls: the mean tool calls per episode of the last `window`
    steps below max_ratio × those of the first `window` (which were at least `min_calls`), and the reward's mean
    over the last `window` below its first. Needs 2 × window steps."""
    if len(calls) < 2 * window or len(reward) < 2 * window:
        return QUIET
    start, now = _mean(calls[:window]), _mean(calls[-window:])
    fell = _mean(reward[-window:]) < _mean(reward[:window])
    if start < min_calls or not now < max_ratio * start or not fell:
        return QUIET
    return Check(True, now, max_ratio * start, f"tool calls per episode {now:.3g} in the last {window} steps, "
                                               f"{start:.3g} in the first, while the reward fell")


def check_collapse(xs: list, reward: list = (), truncated: list = (), gold: list = (), *, window: int, ref_window: int,
                   max_ratio: float, min_fall: float, min_z: float, min_value: float, floor_ratio: float,
                   learning_z: float = math.inf, max_truncated: float = 0.9) -> Check:
    """A collapse against the run's own start. The mean of the last `window` values is below max_ratio × the mean
    of the first `ref_window` values, and either

    - still falling fast: below the mean of the `window` values before it by more than min_fall of that mean and by
      more than min_z standard errors (step noise from successive differences over the last NOISE_SPAN windows), or
    - below the absolute floor min_value, from a start at least min_value / floor_ratio (a slower fall that ended
      near-greedy: fell by floor_ratio or more, into the floor). A stage that starts near-greedy (a policy already
      trained by RL: entropy ~0.15 nats/token) and sharpens further has no exploration to lose on this path; a fast
      fall (the first) still fires there.

    Relative, because the level depends on the task and the start model (an untrained model samples at ~6
    nats/token, an SFT model's arithmetic answers at ~0.15): a run that starts low does not fire until it falls.
    Needs ref_window + window values.

    Given the reward and truncated-share histories (and the gold reward's, where logged), it stays quiet while the
    run is learning (_learning: the reward rose beyond its noise, z >= learning_z, and the answers end): RL on a
    verifiable reward trades entropy for reward as the policy converges onto the answers that score (Cui et al.
    2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models"), so a low entropy bought
    with reward, on answers that finish, is the task being learned. It still fires on entropy lost without a reward
    gain (exploration spent for nothing) and on a collapse onto output that runs to the token limit (a repetition
    loop a reward pays for)."""
    if len(xs) < max(ref_window + window, 2 * window):
        return QUIET
    ref, now, before = _mean(xs[:ref_window]), _mean(xs[-window:]), _mean(xs[-2 * window : -window])
    if not now < max_ratio * ref:
        return QUIET
    noise = xs[-NOISE_SPAN * window :]
    falling, drop = _significant_drop(xs[-2 * window : -window], xs[-window:], noise, min_fall * before, min_z)
    if not (falling or (now < min_value and ref >= min_value / floor_ratio)):
        return QUIET
    how = (f"still falling ({before:.4g} in the {window} before)" if falling else
           f"below the floor {min_value:g}, from a start above {min_value / floor_ratio:g}")
    res = Check(True, now, max_ratio * ref, f"mean of the last {window} values {now:.4g} < {max_ratio:g} x the "
                                             f"first {ref_window} ({ref:.4g}), {how}")
    return _unless_learning(res, reward, truncated, gold, learning_z, max_truncated)


def _held(xs: list, window: int, holds, bound: float, what: str) -> Check:
    """Fires when `holds(x)` is true of each of the last `window` values."""
    last = xs[-window:]
    if len(last) < window or not all(holds(x) for x in last):
        return QUIET
    return Check(True, _mean(last), bound, f"{what} at each of the last {window} steps")


def check_held_at_least(xs: list, window: int, min_value: float) -> Check:
    """Each of the last `window` values >= min_value: a condition that held `window` steps in a row."""
    return _held(xs, window, lambda x: x >= min_value, min_value, f">= {min_value:g}")


def check_held_at_most(xs: list, window: int, max_value: float) -> Check:
    """Each of the last `window` values <= max_value: a condition that held `window` steps in a row."""
    return _held(xs, window, lambda x: x <= max_value, max_value, f"<= {max_value:g}")


def check_below_start(xs: list, reward: list = (), truncated: list = (), gold: list = (), *, window: int,
                      min_ratio: float, min_value: float, learning_z: float = math.inf,
                      max_truncated: float = 0.9) -> Check:
    """Mean of the last `window` values < max(min_value, min_ratio × mean of the first `window` values).

    Relative to the run's own start, because absolute diversity depends on the task (arithmetic answers
    reuse a dozen tokens). Needs 2 * window values. Given the reward and truncated-share histories, quiet while
    the run is learning (_learning): a policy that converges onto one answer template the reward pays for, answers
    that end, reuses few n-grams by design (the same words around a different number); a collapse without a reward
    gain, or onto output that runs to the token limit, still fires.
    """
    if len(xs) < 2 * window:
        return QUIET
    floor = max(min_value, min_ratio * _mean(xs[:window]))
    m = _mean(xs[-window:])
    if not m < floor:
        return QUIET
    res = Check(True, m, floor, f"mean of last {window} values {m:.4g} < {floor:.4g} "
                                f"({min_ratio:g} x the first {window}: {_mean(xs[:window]):.4g})")
    return _unless_learning(res, reward, truncated, gold, learning_z, max_truncated)


def check_falling(xs: list, window: int, min_drop: float, min_z: float) -> Check:
    """Mean of the last `window` values is below the mean of the `window` before it.

    The drop must exceed min_drop (absolute) and min_z standard errors (noise measured over the
    last NOISE_SPAN windows), so a noisy plateau does not fire on every dip. Needs 2 * window values.
    """
    if len(xs) < 2 * window:
        return QUIET
    before, after = xs[-2 * window : -window], xs[-window:]
    fired, drop = _significant_drop(before, after, xs[-NOISE_SPAN * window :], min_drop, min_z)
    if fired:
        detail = f"window mean fell by {drop:.4g} ({_mean(before):.4g} -> {_mean(after):.4g})"
        return Check(True, _mean(after), _mean(before) - min_drop, detail)
    return QUIET


def check_fell_from_start(xs: list, window: int, min_drop: float, min_z: float) -> Check:
    """Mean of the last `window` values is below the mean of the first `window` values.

    Same drop test as check_falling; needs 2 * window values so the windows do not overlap.
    """
    if len(xs) < 2 * window:
        return QUIET
    first, last = xs[:window], xs[-window:]
    fired, drop = _significant_drop(first, last, xs[-NOISE_SPAN * window :], min_drop, min_z)
    if fired:
        detail = f"fell by {drop:.4g} since the start ({_mean(first):.4g} -> {_mean(last):.4g})"
        return Check(True, _mean(last), _mean(first) - min_drop, detail)
    return QUIET


def check_drift(xs: list, window: int, max_rel_change: float) -> Check:
    """Ratio r = mean(last window) / mean(first window) leaves [1/(1+c), 1+c], c = max_rel_change.

    With c = 1.0 it fires when the mean has doubled or halved. The bound is symmetric in log
    space: growing by x(1+c) and shrinking by /(1+c) count alike. Needs 2 * window values.
    """
    if len(xs) < 2 * window:
        return QUIET
    base, now = _mean(xs[:window]), _mean(xs[-window:])
    if not base > 0:
        return QUIET
    ratio, limit = now / base, 1 + max_rel_change
    if ratio > limit or ratio < 1 / limit:
        bound = limit if ratio > limit else 1 / limit
        return Check(True, ratio, bound, f"window mean {now:.4g} vs {base:.4g} at the start (x{ratio:.3g})")
    return QUIET


def check_length_drift(length: list, terminated: list = (), reward: list = (), truncated: list = (), gold: list = (),
                       calls: list = (), *, window: int, max_rel_change: float, learning_z: float = math.inf,
                       max_truncated: float = 0.9, min_new_calls: float = 0.5) -> Check:
    """Response length far from the start (check_drift's ratio, c = max_rel_change), judged by direction:

    - longer: the mean length of all completions grew x(1+c): length hacking (a reward that pays for length) or
      EOS lost; answers that grow run into the token limit. Fires unless the policy now makes `min_new_calls` more
      tool calls per episode than at the start (`calls`, tools/call_frequency, with --tools), or its calls grew by
      at least the length's factor: the calls it writes are the growth.
    - shorter: the length of the completions that ended with EOS (`terminated`, TRL's
      completions/mean_terminated_length; the mean length where it is not logged) fell /(1+c). Truncated answers
      count at the token limit in the mean, so a policy whose cut-off answers start to finish shortens the mean
      without any answer getting shorter: the finished ones are the answers' length. Quiet while the run is
      learning (_learning: the reward rose beyond its noise and the answers end): shorter answers that score
      better are the policy learning a concise answer. A shortening without a reward gain (answers collapsing to a
      few tokens, EOS emitted too early) still fires.
    """
    grown = check_drift(length, window, max_rel_change)
    if grown.fired and grown.value > 1:
        start, now = (_mean(calls[:window]), _mean(calls[-window:])) if len(calls) >= 2 * window else (0.0, 0.0)
        tooled = now - start >= min_new_calls or (start > 0 and now / start >= grown.value)
        return QUIET if tooled else grown
    finished = len(terminated) >= 2 * window and _finite(terminated[:window]) and _finite(terminated[-window:])
    key, xs = ("completions/mean_terminated_length", terminated) if finished else ("", length)
    shrunk = check_drift(xs, window, max_rel_change)
    if not (shrunk.fired and shrunk.value < 1):
        return QUIET
    what = "finished answers' " if finished else ""
    res = shrunk._replace(detail=f"{what}{shrunk.detail}", metric=key)
    return _unless_learning(res, reward, truncated, gold, learning_z, max_truncated)


def check_diverging(proxy: list, gold: list, window: int, min_slope: float, min_z: float) -> Check:
    """Over the last `window` paired points, proxy slope > min_slope while gold slope < -min_slope.

    Slopes are least squares per logged point; each must also be min_z standard errors from 0.
    """
    if len(gold) < window or window < 3:
        return QUIET
    sp, ep = _slope(proxy[-window:])
    sg, eg = _slope(gold[-window:])
    if sp > min_slope and sg < -min_slope and sp > min_z * ep and -sg > min_z * eg:
        detail = f"proxy reward slope {sp:+.3g}/point while gold_reward slope {sg:+.3g}/point over {window} points"
        return Check(True, sg, -min_slope, detail)
    return QUIET


def check_heldout_hacking(gold: list, proxy: list, problems: list, kl: list, window: int, min_z: float,
                          min_rise: float) -> Check:
    """Held-out over-optimisation: at the latest evaluation the held-out gold (greedy pass rate on a fixed set of
    n problems) is below its value at the first evaluation by more than min_z standard errors,
    SE = sqrt((g₀(1−g₀) + g(1−g)) / n), while the proxy (the reward model's mean score of the same greedy
    answers) is above its first value by more than min_rise. Greedy answers on a fixed set make both series
    low-noise, so the latest evaluation is judged alone. Series are aligned on evaluation steps (all of them
    kept); the first one is the evaluation before training."""
    if len(gold) < 2 or not problems or not problems[-1] > 0:
        return QUIET
    g0, g, p0, p, n = gold[0], gold[-1], proxy[0], proxy[-1], problems[-1]
    se = math.sqrt(max(g0 * (1 - g0) + g * (1 - g), 1e-12) / n)
    if g0 - g > min_z * se and p - p0 > min_rise:
        detail = (f"held-out gold {g0:.3g} -> {g:.3g} ({(g - g0) / se:+.1f} SE on {n:g} problems) while the proxy "
                  f"reward of the same answers rose {p0:.3g} -> {p:.3g}"
                  f"{f'; KL {kl[-1]:.3g}' if math.isfinite(kl[-1]) else ''}")
        return Check(True, g, g0 - min_z * se, detail)
    return QUIET


def check_heldout_degradation(gold: list, problems: list, window: int, min_z: float, vs_best: float) -> Check:
    """Held-out quality fell beyond its sampling noise, whatever the proxy reward does: the latest held-out pass
    rate g (on n problems) is below the reference r — the best earlier evaluation (vs_best = 1) or the first one
    (vs_best = 0) — by more than

        min_z · sqrt(p̄(1 − p̄) / n) · √2,   p̄ = (r + g) / 2

    the standard error of the difference of two pass rates on n problems each (the pooled two-proportion test).
    The threshold scales with the held-out set: on 200 problems at p̄ 0.4, 2 SE is 0.098; on 1,000, 0.044."""
    if len(gold) < 2 or not problems or not problems[-1] > 0:
        return QUIET
    g, n = gold[-1], problems[-1]
    earlier = _finite(gold[:-1])
    if not earlier or not math.isfinite(g):
        return QUIET
    ref = max(earlier) if vs_best else earlier[0]
    p = (ref + g) / 2
    se = math.sqrt(max(2 * p * (1 - p), 1e-12) / n)
    if ref - g > min_z * se:
        which = f"the best earlier evaluation ({ref:.3g})" if vs_best else f"the first evaluation ({ref:.3g})"
        detail = f"held-out pass rate {g:.3g} is {(ref - g) / se:.1f} SE below {which} on {n:g} problems"
        return Check(True, g, ref - min_z * se, detail)
    return QUIET


# ---------------------------------------------------------------------------------------------
# default rules

# The decoder's sampling log-probs against the trainer's (rollout/logp_abs_diff, mean |Δ log p| per token) that the
# numeric precision explains: fp32 (CPU) decodes with other kernels but the same arithmetic, measured ~1e-6; in bf16
# (one H200) the gap grows with the policy's entropy: 4-5e-3 on a random-weight 135M model, 0.04 on SmolLM2-135M at
# 2 nats/token falling to ~5e-3 as it sharpens. A ceiling at 2.5x the largest healthy bf16 value, and a jump test:
# a stale copy shows as a step change (x18 over the previous median at its first stale step on the GPU; healthy runs
# move by at most x2.6 between steps), above a floor of a fifth of the ceiling. FP8 rollouts (--rollout-precision fp8:
# E4M3 weights and activations against the bf16 trainer, one H100) sit higher by construction: 0.17 on SmolLM2-135M
# at the start, falling to 0.13 (bf16 rollouts of the same runs: 0.04 -> 0.02); the same 2.5x over it.
MISMATCH_TOLERANCE = {"fp32": 1e-3, "16-bit": 0.1, "fp8": 0.4}
MISMATCH_JUMP = 5.0


KL_REMEDY = {"lr": 0.5, "kl": 2.0}  # the policy drifts too far, too fast: smaller steps, a stronger KL leash
# the sharpening rules (entropy, distinct-n, shorter answers) also read these, to tell a run that is learning (_learning)
SHARPENING = ("reward", "completions/clipped_ratio", "gold_reward")
# z 2: a rise a flat reward shows by chance in ~2 % of its windows (a missed or later warning at worst, not a false
# one); 0.9: a run with nine answers in ten cut off at the token limit is not converging onto answers that end
LEARNING = {"learning_z": 2.0, "max_truncated": 0.9}


def mismatch_tolerance(precision: str, rollout_precision: str = "auto") -> float:
    """rollout_mismatch's default threshold for a run's --precision (fp32, bf16, bf16-mixed, bf16-pure, fp16) and
    --rollout-precision (auto: the compute dtype's; fp8)."""
    if rollout_precision == "fp8":
        return MISMATCH_TOLERANCE["fp8"]
    return MISMATCH_TOLERANCE["fp32" if precision in ("fp32", "auto", "") else "16-bit"]


def default_rules(precision: str = "fp32", rollout_precision: str = "auto") -> list:
    """The default rule set (fresh objects; names are public API and used as override keys). `precision` and
    `rollout_precision` set the thresholds that depend on them (rollout_mismatch)."""
    mismatch = mismatch_tolerance(precision, rollout_precision)
    return [
        Rule("nan", "loss", check_nonfinite, "stop", 1, extra=("grad_norm",),
             message="NaN/inf in loss or grad_norm: most often a learning rate too high for this model and data "
                     "(or an overflow in 16-bit precision). Lower --lr, keep --grad-clip on, check the data and "
                     "reward for extreme values."),
        Rule("grad_explode", "grad_norm", check_spike, "warn", 20,
             params={"factor": 10.0, "max_value": 1e4, "min_history": 5, "skip_zero": True},
             message="Gradient norm spike: LR too high or a bad batch. Lower the LR, clip gradients, "
                     "check for extreme rewards/advantages."),
        # the median of the last 3: fires once 2 of 3 steps are over the limit (a sustained rise, as soon as it holds;
        # a 10-step mean waited 13-14 steps on a KL rising from 0); one jump is kl_spike's. 0.5 nats/token is ~8 nats
        # on a 16-token answer, 4x the adaptive controller's target per episode; healthy runs stay under 0.06.
        Rule("kl_high", "kl", check_median_above, "warn", 3, params={"max_value": 0.5}, remedy=KL_REMEDY,
             message="KL to the reference is high: the policy is drifting away. "
                     "Raise the KL coefficient (or lower the KL target), lower the LR."),
        Rule("kl_spike", "kl", check_spike, "warn", 10, remedy=KL_REMEDY,
             params={"factor": 5.0, "max_value": math.inf, "min_history": 5, "min_value": 0.2},
             message="KL to the reference jumped in one step: an update moved the policy far (often once an "
                     "adaptive KL coefficient has decayed). Lower the LR, use fewer epochs per batch, or put a "
                     "floor under the KL coefficient."),
        # window 20 (not 10) and min_z 3.5: on a noisy 300-step plateau this warns in ~4% of runs
        # (window 10, z 3: ~30%) and still catches a 2-sigma drop within ~10 steps.
        Rule("reward_falling", "reward", check_falling, "warn", 20,
             params={"min_drop": 0.0, "min_z": 3.5},
             message="Mean reward is falling: LR too high, reward hacking or over-optimisation. "
                     "Lower the LR, raise the KL coefficient, stop early (keep the best checkpoint)."),
        # a run that cannot learn: stopped after `window` steps in a row, and judged over the whole run at its end
        # when it was shorter (a 3-step run whose reward failed on every row is not "complete")
        Rule("reward_errors", "rewards/errors", check_held_at_least, "stop", 5, params={"min_value": 1.0}, remedy={},
             at_end=True,
             message="The reward failed on every sample (it raised, returned NaN / a non-number or ran past "
                     "--reward-timeout): nothing is learned. Call the function by hand on one data row, "
                     "fn(prompt, completion, **row) (batched: fn(prompts=[...], completions=[...], **columns as "
                     "lists)), fix it and rerun (--on-reward-error fail stops at the first failure and shows the "
                     "completion)."),
        # window 50: with 16 groups a step, 50 steps without signal are 800 groups without one success (or failure)
        # a run shorter than the window only warns: 2 steps of a task the model already solves (every group all
        # right) are a smoke test that passed, not a run that cannot learn
        Rule("no_signal", "signal_frac", check_held_at_most, "stop", 50, params={"max_value": 0.0}, at_end=True,
             short_run="warn", remedy={},
             message="No sample carried a training signal: within every group the rewards were equal (all wrong, "
                     "all right, or a constant reward), so every advantage is 0 and the policy does not change. "
                     "Check the start model's pass@k on the task (align eval): start from a stronger (SFT) model "
                     "or use an easier task, more --num-generations, or a reward that gives partial credit."),
        # relative to the run's start (its level depends on task and model): the last 5 steps below 0.8x the first
        # 10 and still falling fast (> 10 % and > 4 SE below the 5 before: healthy sharpening is slow and within its
        # noise), or under the floor 0.1 from a start above 0.2 (0.1 / floor_ratio). On the benchmark's collapses it
        # fires 10 steps after the fall begins (the old "10-step mean < 0.1": 27-29); no healthy run fired, though
        # SFT-start GRPO sat at 0.73x.
        # quiet while the run is learning (_learning: the reward up beyond its noise, z >= 2, and the answers end: at
        # most 9 in 10 cut off, no more than at the start): a policy sharpening onto the answers the reward pays for
        Rule("entropy_collapse", "entropy", check_collapse, "warn", 5, extra=SHARPENING,
             params={"ref_window": 10, "max_ratio": 0.8, "min_fall": 0.1, "min_z": 4.0, "min_value": 0.1,
                     "floor_ratio": 0.5, **LEARNING},
             message="Policy entropy collapsed: the model is becoming deterministic and stops exploring. "
                     "Raise the sampling temperature, add an entropy bonus, lower the LR, train fewer steps."),
        Rule("clip_high", "clip_ratio", check_above, "warn", 10, params={"max_value": 0.3},
             message="Clip fraction is high: policy updates are too large. "
                     "Lower the LR, use fewer PPO epochs per batch, or a smaller clip epsilon."),
        # longer: always; shorter (the finished answers): only while the run is not learning
        Rule("length_drift", "completions/mean_length", check_length_drift, "warn", 10,
             extra=("completions/mean_terminated_length", *SHARPENING, "tools/call_frequency"),
             params={"max_rel_change": 1.0, **LEARNING},
             message="Response length drifted far from the start: length hacking or EOS lost (longer), answers "
                     "collapsing without a reward gain (shorter). Add a length penalty, check EOS/stop-token "
                     "handling and max_new_tokens truncation."),
        Rule("low_distinct_1", "distinct_1", check_below_start, "warn", 10, extra=SHARPENING,
             params={"min_ratio": 0.5, "min_value": 0.0, **LEARNING},
             message="Low distinct-1 (unigram diversity): mode collapse. "
                     "Raise the sampling temperature, lower the LR, raise the KL coefficient."),
        Rule("low_distinct_2", "distinct_2", check_below_start, "warn", 10, extra=SHARPENING,
             params={"min_ratio": 0.5, "min_value": 0.0, **LEARNING},
             message="Low distinct-2 (bigram diversity): mode collapse. "
                     "Raise the sampling temperature, lower the LR, raise the KL coefficient."),
        Rule("chosen_logp_falling", "logps/chosen", check_fell_from_start, "warn", 10,
             params={"min_drop": 10.0, "min_z": 3.5},
             message="Log-likelihood of the chosen responses is falling (known DPO failure: both chosen "
                     "and rejected likelihoods fall). Lower the learning rate or raise beta, add an SFT "
                     "(NLL on chosen) term."),
        Rule("reward_hacking", "reward", check_diverging, "warn", 20, extra=("gold_reward",), aligned=True,
             remedy=KL_REMEDY, substitutes=(("reward", "proxy_reward"),),
             params={"min_slope": 1e-3, "min_z": 2.0},
             message="Proxy reward rises while gold reward falls: reward hacking. "
                     "Raise the KL coefficient, improve the reward model (or the judge's rubric), stop early."),
        # window: every evaluation is kept (the check compares the latest with the first)
        Rule("reward_hacking_heldout", "eval/pass@1/greedy", check_heldout_hacking, "warn", 100_000,
             extra=("eval/reward", "eval/problems", "eval/kl"), aligned=True, remedy=KL_REMEDY,
             params={"min_z": 2.0, "min_rise": 0.05},
             message="The reward model's (or judge's) score of held-out answers rises while their verified "
                     "correctness falls: over-optimisation of the learned reward. Stop here (the last evaluation "
                     "before it is the model to keep), raise the KL coefficient or lower the KL target, improve "
                     "the reward model or the judge."),
        # every evaluation is kept: the check compares the latest with the best (or first) one
        Rule("heldout_degradation", "eval/pass@1/greedy", check_heldout_degradation, "warn", 100_000,
             extra=("eval/problems",), aligned=True, params={"min_z": 2.0, "vs_best": 1.0}, remedy=KL_REMEDY,
             message="Held-out quality fell beyond its sampling noise, whatever the training reward says: the "
                     "policy is getting worse at the task (over-optimisation, forgetting, too large a step). Keep "
                     "the best evaluation's model (--on-alarm stop), lower the LR, raise the KL coefficient."),
        Rule("rollout_mismatch", "rollout/logp_abs_diff", check_spike, "warn", 10, remedy={},
             params={"max_value": mismatch, "factor": MISMATCH_JUMP, "min_history": 3, "min_value": mismatch / 5},
             message="The decoder's sampling log-probs differ from the trainer's by more than numeric precision "
                     "explains: the rollouts come from another policy than the one trained (a stale or wrongly "
                     "loaded decoder weight copy, a sampling bug). Check the weight refresh before each rollout; "
                     "--tis-cap 2 corrects the gradient for a small, real mismatch."),
        # --tools: a tool whose every call fails (broken, hanging past its timeout, or the policy's calls all
        # malformed), most calls failing, episodes that run into --max-turns (a policy looping on its tool), and
        # a policy giving up its tools while the reward falls
        Rule("tool_broken", "tools/failure_frequency", check_held_at_least, "stop", 5, params={"min_value": 1.0},
             remedy={},
             message="Every tool call failed for 5 steps in a row: the tool is broken (it raises, runs past its "
                     "timeout or returns what is not text) or every call the policy writes is malformed. Read the "
                     "transcripts in eval_samples.jsonl, call the tool by hand on one of them, fix it and rerun."),
        Rule("tool_errors_high", "tools/failure_frequency", check_median_above, "warn", 10, params={"max_value": 0.5},
             remedy={},
             message="Most tool calls fail: the policy writes calls the tool cannot answer (look at the "
                     "transcripts), or the tool fails on valid ones. Start from a model that has seen well-formed "
                     "calls (SFT on tool demonstrations) or fix the tool."),
        Rule("turn_limit", "episodes/stop/max_turns", check_median_above, "warn", 10, params={"max_value": 0.5},
             remedy={},
             message="Most episodes end at --max-turns: the policy keeps calling tools instead of answering (a "
                     "loop its reward does not punish). Give a final answer a reward the loop cannot earn, lower "
                     "--max-turns, or raise it if the task needs more calls."),
        Rule("tools_abandoned", "tools/call_frequency", check_abandoned, "warn", 10, extra=("reward",),
             params={"max_ratio": 0.5, "min_calls": 0.2},
             message="The policy stopped calling its tools while its reward fell: the tool's answers may be "
                     "wrong or cut by --max-tool-tokens, or tool errors cost more than answering alone. Check the "
                     "tool on the transcripts; lower the LR or stop early (keep the best checkpoint)."),
    ]


def _override(rule: Rule, opts: dict) -> Rule:
    """Return a copy of `rule` with the overrides in `opts` applied; bad keys/values -> UserError."""
    where = f"[monitor.{rule.name}]"
    if not isinstance(opts, dict):
        raise UserError(f"{where}: expected a table such as {{ enabled = false }}, got {opts!r}")
    changes, params = {}, dict(rule.params)
    for key, val in opts.items():
        is_number = isinstance(val, (int, float)) and not isinstance(val, bool)
        if key == "enabled" and isinstance(val, bool):
            changes[key] = val
        elif key in ("severity", "short_run") and val in SEVERITIES:
            changes[key] = val
        elif key == "window" and isinstance(val, int) and not isinstance(val, bool) and val >= 1:
            changes[key] = val
        elif key == "message" and isinstance(val, str):
            changes[key] = val
        elif key in params and is_number:
            params[key] = float(val)
        elif key in RULE_OPTIONS or key in params:
            expected = {"enabled": "true or false", "severity": " or ".join(map(repr, SEVERITIES)),
                        "short_run": " or ".join(map(repr, SEVERITIES)),
                        "window": "an integer >= 1", "message": "a string"}.get(key, "a number")
            raise UserError(f"{where} {key} = {val!r}: expected {expected}")
        else:
            known = ", ".join([*RULE_OPTIONS, *rule.params])
            raise UserError(f"{where}: unknown parameter {key!r}; known: {known}")
    return replace(rule, params=params, **changes)


def apply_overrides(rules: list, overrides: dict) -> list:
    """Apply a `[monitor]` TOML table {rule_name: {param: value}} to rules; returns new rules."""
    if not isinstance(overrides, dict):
        raise UserError(f"[monitor]: expected a table of rule names, got {overrides!r}")
    by_name = {r.name: r for r in rules}
    for name, opts in overrides.items():
        if name not in by_name:
            raise UserError(f"[monitor]: unknown rule {name!r}; known rules: {', '.join(by_name)}")
        by_name[name] = _override(by_name[name], opts)
    return [by_name[r.name] for r in rules]


def _as_float(v):
    """float(v) for numbers (incl. 0-d tensors); None for anything else (strings, None, bools)."""
    if isinstance(v, (bool, str)) or v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


class RLMonitor:
    """Feed it every step's metrics; it returns the health events that started this step."""

    def __init__(self, rules: list | None = None, overrides: dict | None = None, precision: str = "fp32"):
        self._defaults, self._overrides = rules is None, overrides or {}
        rules = default_rules(precision) if rules is None else [replace(r, params=dict(r.params)) for r in rules]
        if len({r.name for r in rules}) != len(rules):
            raise ValueError("RLMonitor: rule names must be unique")
        self.rules = apply_overrides(rules, overrides or {})
        self.history: dict[str, list[float]] = {}  # metric key -> values, in update order
        self.events: list[Event] = []
        self._paired: dict[str, list[tuple]] = {}  # aligned rule name -> rows of values
        self._firing: set[str] = set()  # rules that fired at their last evaluation

    def set_precision(self, precision: str, rollout_precision: str = "auto") -> None:
        """The run's precision and its rollouts' (--rollout-precision), once known (before the first update): the
        default rules' precision-dependent thresholds follow them; overrides still win."""
        if self._defaults:
            self.rules = apply_overrides(default_rules(precision, rollout_precision), self._overrides)

    def _series(self, rule: Rule, logged: dict) -> list | None:
        """The histories a rule checks this step, or None if the rule is inactive this step."""
        if rule.aligned:
            keys = rule.read(logged)
            if not all(k in logged for k in keys):
                return None
            rows = self._paired.setdefault(rule.name, [])
            rows.append(tuple(logged[k] for k in keys))
            del rows[: -rule.window]  # checks only look at the last window
            return [list(col) for col in zip(*rows)]
        keys = rule.read(self.history)
        if not any(k in logged for k in keys):
            return None
        return [self.history.get(k, []) for k in keys]

    def update(self, step: int, metrics: dict) -> list:
        """Record `metrics` (numeric values only) for `step`, run every rule, return new events.

        A rule is evaluated only on steps that log one of its keys. Debounce: a warn rule reports
        when its condition starts and again only after it has been quiet for at least one
        evaluation; stop rules report every time they fire.
        """
        logged = {k: x for k, v in metrics.items() if (x := _as_float(v)) is not None}
        for k, x in logged.items():
            self.history.setdefault(k, []).append(x)
        new = []
        for rule in self.rules:
            series = self._series(rule, logged) if rule.enabled else None
            if series is None:
                continue
            res = rule.check(*series, window=rule.window, **rule.params)
            if not res.fired:
                self._firing.discard(rule.name)
                continue
            if rule.severity == "stop" or rule.name not in self._firing:
                new.append(Event(step, rule.name, rule.severity, res.metric or rule.read(logged)[0],
                                 res.value, res.threshold, rule.message, res.detail))
            self._firing.add(rule.name)
        self.events.extend(new)
        return new

    def end(self, step: int) -> list:
        """At the end of a run: the `at_end` rules judged once over the whole run when it was shorter than their
        window (a longer run's last window was judged at every step), at their `end_severity` (no_signal: a
        warning). Returns the new events."""
        new = []
        for rule in self.rules:
            series = [self.history.get(k, []) for k in rule.read(self.history)]
            if not (rule.enabled and rule.at_end and 0 < len(series[0]) < rule.window):
                continue
            res = rule.check(*series, window=len(series[0]), **rule.params)
            if res.fired:
                short = (f"; shorter than the rule's {rule.window}-step window: a warning, not a stop"
                         if rule.end_severity != rule.severity else "")
                new.append(Event(step, rule.name, rule.end_severity, res.metric or rule.metric, res.value,
                                 res.threshold, rule.message, f"{res.detail} (the whole run{short})"))
        self.events.extend(new)
        return new

    def state_dict(self) -> dict:
        """Everything the rules remember (histories, windows, events, which rules are firing), JSON-ready."""
        return {"history": self.history, "events": [asdict(e) for e in self.events],
                "paired": {k: [list(r) for r in rows] for k, rows in self._paired.items()},
                "firing": sorted(self._firing)}

    def load_state_dict(self, state: dict) -> None:
        self.history = {k: list(v) for k, v in state["history"].items()}
        self.events = [Event(**e) for e in state["events"]]
        self._paired = {k: [tuple(r) for r in rows] for k, rows in state["paired"].items()}
        self._firing = set(state["firing"])

    def should_stop(self, events: list | None = None) -> bool:
        """True if any of `events` (default: all events so far) has severity stop."""
        return any(e.severity == "stop" for e in (self.events if events is None else events))

    def summary(self) -> dict:
        """Event counts per rule and the step each rule first fired, e.g. for artifact.json."""
        counts, first = {}, {}
        for e in self.events:
            counts[e.rule] = counts.get(e.rule, 0) + 1
            first.setdefault(e.rule, e.step)
        return {"events": len(self.events), "counts": counts, "first_step": first, "stop": self.should_stop()}
