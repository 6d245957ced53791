"""RLMonitor: every default rule fires on a synthetic failure and stays quiet on a healthy run."""

import json
import math
import random
from pathlib import Path

import pytest

from align.errors import UserError
from align.monitor import Event, RLMonitor, Rule, check_above, default_rules


def feed(stream, monitor=None):
    """Run a list of per-step metric dicts (step = index) through a monitor; return it."""
    monitor = monitor or RLMonitor()
    for step, metrics in enumerate(stream):
        monitor.update(step, metrics)
    return monitor


def fired(monitor, rule):
    """(step, severity) of every event of `rule`."""
    return [(e.step, e.severity) for e in monitor.events if e.rule == rule]


def healthy_stream(n=300, seed=0):
    """A realistic, healthy RL run: noisy metrics, reward rising then plateauing, KL creeping up."""
    rng = random.Random(seed)
    rows = []
    for s in range(n):
        t = s / n
        reward = 0.8 * min(1.0, 2 * t) + rng.gauss(0, 0.08)
        rows.append({
            "loss": 0.6 * math.exp(-2 * t) + 0.1 + rng.gauss(0, 0.05),
            "grad_norm": 2.0 * math.exp(rng.gauss(0, 0.4)),
            "kl": 0.15 * t + abs(rng.gauss(0, 0.02)),
            "reward": reward,
            "gold_reward": 0.9 * reward + rng.gauss(0, 0.05),
            "entropy": 1.2 - 0.5 * t + rng.gauss(0, 0.05),
            "clip_ratio": max(0.0, 0.08 + rng.gauss(0, 0.03)),
            "completions/mean_length": 180 + 60 * t + rng.gauss(0, 15),
            "distinct_1": 0.45 + rng.gauss(0, 0.03),
            "distinct_2": 0.75 + rng.gauss(0, 0.03),
            "logps/chosen": -250 + 5 * t + rng.gauss(0, 8),
            "rewards/errors": float(rng.random() < 0.02),  # a reward failing now and then
            "signal_frac": 0.0 if rng.random() < 0.2 else rng.uniform(0.1, 0.6),  # steps without signal happen
            "learning_rate": 1e-6,
        })
    return rows


def flat_then(key, before, after, n_before=20, n_after=20):
    return [{key: before}] * n_before + [{key: after}] * n_after


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_run_is_silent(seed):
    m = feed(healthy_stream(seed=seed))
    assert m.events == []
    assert m.summary() == {"events": 0, "counts": {}, "first_step": {}, "stop": False}


def test_every_default_rule_is_covered():
    names = [r.name for r in default_rules()]
    assert names == ["nan", "grad_explode", "kl_high", "kl_spike", "reward_falling", "reward_errors", "no_signal", "entropy_collapse", "clip_high",
                     "length_drift", "low_distinct_1", "low_distinct_2", "chosen_logp_falling", "reward_hacking",
                     "reward_hacking_heldout", "heldout_degradation", "rollout_mismatch", "tool_broken",
                     "tool_errors_high", "turn_limit", "tools_abandoned"]


# --- one firing stream per rule ----------------------------------------------------------------


def test_nan_loss_stops():
    m = feed([{"loss": 1.0, "grad_norm": 1.0}] * 10 + [{"loss": float("nan"), "grad_norm": 1.0}])
    assert fired(m, "nan") == [(10, "stop")]
    assert m.should_stop(m.events) and m.should_stop()
    e = m.events[0]
    assert e.metric == "loss" and math.isnan(e.value)
    json.dumps(e.to_dict(), allow_nan=False)  # strict JSON for artifact.json


def test_inf_grad_norm_stops_and_stop_always_fires():
    m = feed([{"loss": 1.0, "grad_norm": 1.0}] * 5 + [{"loss": 1.0, "grad_norm": float("inf")}] * 2)
    assert fired(m, "nan") == [(5, "stop"), (6, "stop")]  # no debounce for stop
    assert m.events[0].metric == "grad_norm"


def test_grad_explode():
    stream = [{"grad_norm": 1.0 + 0.01 * (s % 3)} for s in range(30)] + [{"grad_norm": 50.0}]
    assert fired(feed(stream), "grad_explode") == [(30, "warn")]


def test_grad_explode_needs_history_but_max_value_always_applies():
    assert fired(feed([{"grad_norm": 1.0}] * 3 + [{"grad_norm": 50.0}]), "grad_explode") == []
    assert fired(feed([{"grad_norm": 2e4}]), "grad_explode") == [(0, "warn")]


def test_kl_high():
    # the median of the last 3 crosses 0.5 once 2 of them are at 2.0: steps 20 and 21
    assert fired(feed(flat_then("kl", 0.05, 2.0)), "kl_high") == [(21, "warn")]


def test_kl_high_fires_on_a_sustained_rise_within_a_step_of_the_limit():
    """KL rising 0.04 per step from 0 (the KL blow-up of the benchmark's GRPO at lr 3e-3 rises ~0.05 per step): the
    median of the last 3 is the middle value, 0.04 * (s - 1) > 0.5 from step 14 (steps 13-14 are 0.52 and 0.56);
    the old 10-step mean passed 0.5 only at step 17 (mean of 0.32 .. 0.68)."""
    assert fired(feed([{"kl": 0.04 * s} for s in range(30)]), "kl_high") == [(14, "warn")]


def test_kl_high_ignores_a_single_spike_and_a_high_but_short_start():
    spike = [{"kl": 0.05}] * 20 + [{"kl": 3.0}] + [{"kl": 0.05}] * 10
    m = feed(spike)
    assert fired(m, "kl_high") == [] and fired(m, "kl_spike") == [(20, "warn")]
    assert fired(feed([{"kl": 2.0}] * 2), "kl_high") == []  # fewer than 3 values: no median yet


def test_kl_spike_fires_on_a_jump_that_the_window_mean_misses():
    # the default PPO chain's per-token KL: ~0.06 for 40 steps, then 0.586 at the last step
    stream = [{"kl": 0.05 + 0.01 * (s % 3)} for s in range(40)] + [{"kl": 0.586}]
    m = feed(stream)
    assert fired(m, "kl_spike") == [(40, "warn")] and fired(m, "kl_high") == []
    assert m.events[0].threshold == pytest.approx(5 * 0.06)


def test_kl_spike_ignores_small_values_and_needs_history():
    tiny = [{"kl": 0.01}] * 20 + [{"kl": 0.15}]  # 15 x the median, but under min_value 0.2
    assert fired(feed(tiny), "kl_spike") == []
    assert fired(feed([{"kl": 0.01}] * 3 + [{"kl": 5.0}]), "kl_spike") == []  # 3 < min_history


def test_grad_explode_leaves_steps_without_an_update_out_of_its_median():
    """GRPO steps whose groups all lack signal have grad_norm exactly 0: not a baseline. Five of them, then 0.3:
    quiet (the median would be 0, any update "10x" it); with 5 real steps of ~0.3 before, 4.0 fires (> 10 x 0.3)."""
    assert fired(feed([{"grad_norm": 0.0}] * 5 + [{"grad_norm": 0.3}]), "grad_explode") == []
    mixed = [{"grad_norm": 0.0}, {"grad_norm": 0.3}] * 5 + [{"grad_norm": 4.0}]
    m = feed(mixed)
    assert fired(m, "grad_explode") == [(10, "warn")] and m.events[0].threshold == pytest.approx(3.0)


def test_reward_falling():
    # steady decline after a plateau, noise-free: window 20 vs the 20 before it
    stream = [{"reward": 1.0 if s < 30 else 1.0 - 0.05 * (s - 29)} for s in range(60)]
    assert fired(feed(stream), "reward_falling") == [(39, "warn")]


def test_reward_falling_noisy_collapse():
    rng = random.Random(0)
    stream = [{"reward": (0.8 if s < 100 else 0.5) + rng.gauss(0, 0.05)} for s in range(140)]
    assert fired(feed(stream), "reward_falling") == [(105, "warn")]  # 6 steps after the collapse


def test_reward_falling_needs_two_full_windows():
    stream = [{"reward": 1.0}] * 20 + [{"reward": 0.0}] * 19  # 39 points < 2 * window
    assert fired(feed(stream), "reward_falling") == []


def test_entropy_collapse():
    """Entropy 1.0 for 20 steps, then falling 0.1 per step (0.9 at step 20): the mean of the last 5 at step 24 is 0.7,
    below 0.8 × the first 10 steps' mean (1.0; at step 23 it is 0.8, not below), 0.3 below the 5 steps before it
    (> 10 % of them) and 14.7 standard errors of the step noise (successive differences over the last 25 steps,
    five of −0.1): fires at step 24, once."""
    stream = [{"entropy": 1.0}] * 20 + [{"entropy": 1.0 - 0.1 * (k + 1)} for k in range(9)]
    m = feed(stream)
    assert fired(m, "entropy_collapse") == [(24, "warn")]
    assert m.events[0].value == pytest.approx(0.7) and m.events[0].threshold == pytest.approx(0.8)


def test_entropy_collapse_is_relative_to_the_start():
    """The untrained model's 6.2 nats/token falling 10 % a step from step 12 fires at step 16 (mean of the last 5,
    4.57 < 0.8 × 6.2; step 15: 5.08), long before any absolute floor; an SFT model's answers at ~0.04 nats/token
    from the start (below the floor 0.1, noisy) never fire: nothing fell."""
    fall = [{"entropy": 6.2 if s < 12 else 6.2 * 0.9 ** (s - 11)} for s in range(40)]
    assert fired(feed(fall), "entropy_collapse") == [(16, "warn")]
    rng = random.Random(0)
    low = [{"entropy": max(0.0, 0.04 + rng.gauss(0, 0.01))} for _ in range(300)]
    assert fired(feed(low), "entropy_collapse") == []


def test_entropy_collapse_needs_a_fall_still_going_or_the_floor():
    """Below 0.8 × the start but settled (the last 5 no lower than the 5 before): quiet above the floor 0.1, fires
    below it once below half the start too; a noisy decline to half the start over 300 steps (a policy sharpening as
    it learns) stays quiet."""
    from align.monitor import check_collapse

    params = {"window": 5, "ref_window": 10, "max_ratio": 0.8, "min_fall": 0.1, "min_z": 4.0, "min_value": 0.1,
              "floor_ratio": 0.5}
    assert not check_collapse([1.0] * 10 + [0.5] * 10 + [0.2] * 12, **params).fired
    settled = check_collapse([1.0] * 10 + [0.5] * 10 + [0.09] * 12, **params)
    assert settled.fired and "floor" in settled.detail
    # an SFT model's ~0.12 nats/token settling at 0.095: under the floor and 0.8 x its start, not halved: quiet
    assert not check_collapse([0.12] * 10 + [0.095] * 12, **params).fired
    # a start near-greedy (0.15 < 0.1 / 0.5: a policy RL already sharpened) halved slowly into the floor: quiet on
    # the floor path; from 0.25 (above 0.2) the same settling fires; a fast fall from 0.15 still fires
    assert not check_collapse([0.15] * 10 + [0.1] * 5 + [0.07] * 10, **params).fired
    assert check_collapse([0.25] * 10 + [0.1] * 5 + [0.07] * 10, **params).fired
    assert check_collapse([0.15] * 10 + [0.12] * 5 + [0.03] * 5, **params).fired
    assert not check_collapse([1.0] * 10 + [0.01] * 4, **params).fired  # fewer than ref_window + window values
    assert check_collapse([1.0] * 10 + [0.01] * 5, **params).fired
    rng = random.Random(1)
    slow = [{"entropy": 1.0 - 0.5 * s / 300 + rng.gauss(0, 0.05)} for s in range(300)]
    assert fired(feed(slow), "entropy_collapse") == []


def test_thresholds_are_strict_at_the_boundary():
    """A window mean exactly at a threshold does not fire (values exact in binary: 0.5, 0.125)."""
    assert fired(feed([{"kl": 0.5}] * 30), "kl_high") == []  # median 0.5, not > 0.5
    assert fired(feed([{"kl": 0.5}] * 28 + [{"kl": 0.5078125}] * 2), "kl_high") == [(29, "warn")]
    # a window mean (check_above: clip_high's, rollout_mismatch's)
    def mean_above():
        return RLMonitor(rules=[Rule("mean_above", "kl", check_above, "warn", 10, params={"max_value": 0.5})])

    assert fired(feed([{"kl": 0.5}] * 30, mean_above()), "mean_above") == []  # mean 0.5, not > 0.5
    assert fired(feed([{"kl": 0.5}] * 29 + [{"kl": 0.5078125}], mean_above()), "mean_above") == [(29, "warn")]
    # entropy: 1.0 for 10 steps, then 0.75 (exactly max_ratio 0.75 x the start: quiet) or 0.7421875 (fires at step
    # 14, once the last 5 are all below it and the fall from the 5 before shows)
    ratio = {"entropy_collapse": {"max_ratio": 0.75}}
    assert fired(feed(flat_then("entropy", 1.0, 0.75, 10, 20), RLMonitor(overrides=ratio)), "entropy_collapse") == []
    assert fired(feed(flat_then("entropy", 1.0, 0.7421875, 10, 20), RLMonitor(overrides=ratio)),
                 "entropy_collapse") == [(14, "warn")]


def test_clip_high():
    assert fired(feed(flat_then("clip_ratio", 0.1, 0.9)), "clip_high") == [(22, "warn")]


def test_length_drift_growing_and_shrinking():
    key = "completions/mean_length"
    # doubling: (7 * 250 + 3 * 100) / 10 = 205 > 2 x 100
    assert fired(feed(flat_then(key, 100.0, 250.0)), "length_drift") == [(26, "warn")]
    # halving: (9 * 40 + 1 * 100) / 10 = 46 < 100 / 2
    assert fired(feed(flat_then(key, 100.0, 40.0)), "length_drift") == [(28, "warn")]


def test_low_diversity():
    m = feed([{"distinct_1": 0.6, "distinct_2": 0.8}] * 20 + [{"distinct_1": 0.05, "distinct_2": 0.1}] * 20)
    # relative to the run's start: first-window means 0.6 / 0.8 -> floors 0.3 / 0.4.
    # step 25 (values 16..25): (4 * 0.6 + 6 * 0.05) / 10 = 0.27 < 0.3 and (4 * 0.8 + 6 * 0.1) / 10 = 0.38 < 0.4;
    # step 24: (5 * 0.6 + 5 * 0.05) / 10 = 0.325, (5 * 0.8 + 5 * 0.1) / 10 = 0.45: not yet.
    assert fired(m, "low_distinct_1") == [(25, "warn")]
    assert fired(m, "low_distinct_2") == [(25, "warn")]


def test_low_diversity_is_judged_against_the_start_not_the_previous_window():
    """distinct-1 at 0.6, 0.4, then 0.25 (10 steps each): the floor stays 0.5 x the first window = 0.3. Step 26's
    window (steps 17..26) is 3 x 0.4 + 7 x 0.25: mean 0.295 < 0.3; step 25's, 4 x 0.4 + 6 x 0.25: 0.31. Against the
    window before it (floor 0.5 x 0.46 = 0.23 at step 26) it would never fire."""
    stream = [{"distinct_1": 0.6}] * 10 + [{"distinct_1": 0.4}] * 10 + [{"distinct_1": 0.25}] * 10
    assert fired(feed(stream), "low_distinct_1") == [(26, "warn")]


# --- a policy sharpening as it learns vs. a collapse -------------------------------------------------------------

SHARPENING_RULES = {"entropy_collapse", "length_drift", "low_distinct_1", "low_distinct_2"}
NO_LEARNING_GATE = {name: {"learning_z": math.inf} for name in SHARPENING_RULES}  # the rules as they were
REAL_RUNS = Path(__file__).resolve().parent / "fixtures/real_runs"  # recorded GPU runs (benchmarks/real_model.py)


def sharpening_stream(gain=0.095, truncated=(0.65, 0.0), finished=(33.0, 13.5), n=100, max_new=64, seed=0):
    """GRPO converging onto one answer template, shaped like the stored real-model runs: with progress p (a logistic
    centred on step 40, 6 steps wide) the entropy falls 1.8 -> 0.1, distinct-1 0.15 -> 0.012, distinct-2 0.45 -> 0.06,
    the reward rises 0.005 -> 0.005 + gain, the truncated share and the finished answers' length go from -> to, and
    the mean length is truncated·max_new + (1 − truncated)·finished (NaN finished length when none end). Noisy."""
    rng = random.Random(seed)
    rows = []
    for s in range(n):
        p = 1 / (1 + math.exp(-(s - 40) / 6))
        cut = min(1.0, max(0.0, truncated[0] + (truncated[1] - truncated[0]) * p + rng.gauss(0, 0.03)))
        done = finished[0] + (finished[1] - finished[0]) * p + rng.gauss(0, 1.0)
        rows.append({"entropy": 1.8 - 1.7 * p + rng.gauss(0, 0.05),
                     "reward": max(0.0, 0.005 + gain * p + rng.gauss(0, 0.005 + 0.015 * p)),
                     "completions/clipped_ratio": cut,
                     "completions/mean_terminated_length": done if cut < 1 else math.nan,
                     "completions/mean_length": cut * max_new + (1 - cut) * (done if cut < 1 else 0.0),
                     "distinct_1": 0.15 - 0.138 * p + rng.gauss(0, 0.008),
                     "distinct_2": 0.45 - 0.39 * p + rng.gauss(0, 0.02)})
    return rows


def first_events(monitor):
    """{rule: step of its first event}."""
    first = {}
    for e in monitor.events:
        first.setdefault(e.rule, e.step)
    return first


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_policy_sharpening_while_the_reward_rises_on_answers_that_end_raises_nothing(seed):
    """The case the rules used to fire on: entropy, distinct-n and the answers' length all fall as the policy
    converges onto one template, while the reward rises and the cut-off answers start to finish. Without the learning
    test the four rules fire (entropy first, at step ~34, as the fall is fastest); with it, no rule fires."""
    stream = sharpening_stream(seed=seed)
    assert feed(stream).events == []
    ungated = first_events(feed(stream, RLMonitor(overrides=NO_LEARNING_GATE)))
    assert set(ungated) == SHARPENING_RULES and 30 <= ungated["entropy_collapse"] <= 40


def test_the_same_sharpening_without_a_reward_gain_fires():
    """Entropy and diversity lost, and the finished answers shortened, with the reward flat: exploration spent for
    nothing. Every sharpening rule fires, entropy_collapse where it fired without the learning test."""
    m = feed(sharpening_stream(gain=0.0))
    first = first_events(m)
    assert set(first) == SHARPENING_RULES
    assert first["entropy_collapse"] == first_events(feed(sharpening_stream(), RLMonitor(overrides=NO_LEARNING_GATE)))[
        "entropy_collapse"]
    assert all("did not rise beyond its noise" in e.detail for e in m.events)
    (length,) = [e for e in m.events if e.rule == "length_drift"][:1]
    assert length.metric == "completions/mean_terminated_length"  # judged on the answers that ended


def test_a_collapse_onto_answers_that_run_to_the_token_limit_fires_while_the_reward_rises():
    """The benchmark's reward paid per "7": the untrained model's answers never end (truncated share 1.0), the
    reward rises as the policy repeats one token to the limit. The reward gain does not excuse it."""
    m = feed(sharpening_stream(truncated=(1.0, 1.0)))
    first = first_events(m)
    assert {"entropy_collapse", "low_distinct_1", "low_distinct_2"} <= set(first) and 30 <= first["entropy_collapse"] <= 40
    assert "ran to the token limit" in m.events[0].detail


def test_answers_that_stop_ending_are_not_learning():
    """From answers that end (an SFT start) into a loop: the truncated share grows 0 -> 0.6, below the 0.9 of
    "nearly all", but it grew: the sharpening rules fire although the reward rises."""
    m = feed(sharpening_stream(truncated=(0.0, 0.6), finished=(14.0, 14.0)))
    first = first_events(m)
    assert {"entropy_collapse", "low_distinct_1", "low_distinct_2"} <= set(first)
    assert "grew (" in [e for e in m.events if e.rule == "entropy_collapse"][0].detail


def test_the_gold_reward_is_the_evidence_of_learning_where_it_is_logged():
    """PPO against a reward model that pays for confidence: the proxy rises as the policy sharpens, the verifier's
    gold reward stays flat. Judged on the gold reward the sharpening rules fire; with the gold rising too, quiet."""
    stream = sharpening_stream()
    rng = random.Random(5)
    flat_gold = [{**row, "gold_reward": 0.3 + rng.gauss(0, 0.02)} for row in stream]
    m = feed(flat_gold)
    assert set(first_events(m)) == SHARPENING_RULES
    assert all("the gold reward did not rise" in e.detail for e in m.events)
    assert feed([{**row, "gold_reward": row["reward"]} for row in stream]).events == []


def test_learning_needs_the_reward_and_the_truncated_share():
    """check_collapse with the reward alone (a stage that does not log the truncated share) cannot tell a loop from a
    template: it fires; with both series it is quiet; with neither (the old call) it fires."""
    from align.monitor import check_collapse

    params = {"window": 5, "ref_window": 10, "max_ratio": 0.8, "min_fall": 0.1, "min_z": 4.0, "min_value": 0.1,
              "floor_ratio": 0.5, "learning_z": 2.0, "max_truncated": 0.9}
    entropy = [1.0] * 20 + [0.5] * 5
    reward = [0.0, 0.01] * 10 + [0.5] * 5  # up 0.5, step noise ~0.007
    assert not check_collapse(entropy, reward, [0.2] * 25, **params).fired
    assert check_collapse(entropy, reward, [], **params).fired
    assert check_collapse(entropy, **params).fired
    assert check_collapse(entropy, [0.0, 0.01] * 12 + [0.0], [0.2] * 25, **params).fired  # no reward gain
    assert check_collapse(entropy, reward, [0.95] * 25, **params).fired  # nearly every answer cut off


def test_length_drift_judges_a_shortening_on_the_finished_answers():
    """Mean length 54 -> 14 only because cut-off answers (64 tokens) start to finish at their usual 14 tokens: no
    answer got shorter, quiet even with a flat reward; the finished answers themselves halving with a flat reward
    fires (on their series), and is quiet while the reward rises; a growth fires whatever the reward does."""
    from align.monitor import check_length_drift

    params = {"window": 10, "max_rel_change": 1.0, "learning_z": 2.0, "max_truncated": 0.9}
    flat, rising = [0.1, 0.12] * 15, [0.1, 0.12] * 5 + [0.5, 0.52] * 10
    cut = [0.8] * 10 + [0.0] * 20
    mean = [c * 64 + (1 - c) * 14 for c in cut]
    assert not check_length_drift(mean, [14.0] * 30, flat, cut, **params).fired
    assert check_length_drift(mean, [], flat, cut, **params).fired  # without the finished length: the mean halved
    shorter = [30.0] * 10 + [12.0] * 20
    res = check_length_drift(shorter, shorter, flat, [0.0] * 30, **params)
    assert res.fired and res.metric == "completions/mean_terminated_length" and res.value == pytest.approx(0.4)
    assert not check_length_drift(shorter, shorter, rising, [0.0] * 30, **params).fired
    longer = [15.0] * 10 + [48.0] * 20
    assert check_length_drift(longer, longer, rising, [0.0] * 10 + [1.0] * 20, **params).fired


@pytest.mark.parametrize("run,precision,collapse_at", [
    ("seed0-metrics.jsonl", "fp32", (30, 36)), ("seed1-metrics.jsonl", "fp32", (30, 36)),
    ("seed2-metrics.jsonl", "fp32", (30, 36)),
    # recorded after the rules were set, on other data and seeds, held-out pass@1 every 10 steps, bf16
    ("fresh/rA-seed3-metrics.jsonl", "bf16-pure", (10, 20)), ("fresh/rB-seed4-metrics.jsonl", "bf16-pure", (10, 20))])
def test_the_stored_real_model_grpo_runs_raise_no_event(run, precision, collapse_at):
    """SmolLM2-135M-Instruct GRPO on reasoning-gym basic_arithmetic (tests/fixtures/real_runs; held-out greedy pass@1
    0.07 -> 0.41-0.43, and in the two later runs 0.115 -> 0.725 and 0.055 -> 0.395) replayed step by step through the
    default rules: no event of any rule (the held-out ones and rollout_mismatch included). Without the learning test
    the four sharpening rules fire on every run."""
    steps = {}
    for line in (REAL_RUNS / run).read_text().splitlines():
        row = json.loads(line)
        steps.setdefault(row.pop("step"), {}).update(row)
    monitors = RLMonitor(), RLMonitor(overrides=NO_LEARNING_GATE)
    for m in monitors:
        m.set_precision(precision)
        for step in sorted(steps):
            m.update(step, steps[step])
        m.end(max(steps))
    assert monitors[0].events == []
    first = first_events(monitors[1])
    assert set(first) == SHARPENING_RULES and collapse_at[0] <= first["entropy_collapse"] <= collapse_at[1]


@pytest.mark.parametrize("task,heldout", [("add", (0.555, 0.70, 0.755)), ("aiw", (0.23, 0.965, 1.0))])
def test_the_pretrained_recipes_grpo_stage_raises_no_event(task, heldout):
    """pipelines/pretrained.toml's GRPO stage when it ran after PPO (from the PPO policy, entropy ~0.15 nats/token
    at the start) on two tasks (tests/fixtures/real_runs/pretrained, one H200, bf16): held-out greedy pass@1 at
    steps 0/50/100 rose on both; replayed through the default rules, no event. The `add` run fired entropy_collapse's
    floor path (0.15 -> 0.05) at steps 21/38/47 before that path asked for a start above the floor / floor_ratio."""
    steps = {}
    for line in (REAL_RUNS / "pretrained" / f"{task}-grpo-metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        steps.setdefault(row.pop("step"), {}).update(row)
    assert tuple(round(steps[s]["eval/pass@1/greedy"], 3) for s in (0, 50, 100)) == heldout
    m = RLMonitor()
    m.set_precision("bf16-pure")
    for step in sorted(steps):
        m.update(step, steps[step])
    m.end(max(steps))
    assert m.events == []


def test_chosen_logp_falling():
    stream = [{"logps/chosen": -200.0 if s < 20 else -200.0 - 2.0 * (s - 19)} for s in range(60)]
    assert fired(feed(stream), "chosen_logp_falling") == [(29, "warn")]


def test_chosen_logp_falling_slowly_is_judged_against_the_start():
    """−0.5 per step from step 20: consecutive windows differ by only 5 (< min_drop 10), but at step 44 the last
    window (offsets 16..25 below the start, mean 20.5 · 0.5 = 10.25) is more than 10 below the first; at step 43
    it is 9.75."""
    stream = [{"logps/chosen": -200.0 if s < 20 else -200.0 - 0.5 * (s - 19)} for s in range(80)]
    assert fired(feed(stream), "chosen_logp_falling") == [(44, "warn")]


def test_reward_hacking():
    stream = [{"reward": 0.01 * s, "gold_reward": 0.01 * s if s < 30 else 0.3 - 0.01 * (s - 30)} for s in range(80)]
    m = feed(stream)
    assert fired(m, "reward_hacking") == [(42, "warn")]
    assert m.events[0].value < 0  # the gold slope


def test_reward_hacking_needs_the_gold_to_fall_faster_than_min_slope():
    """The proxy climbs 0.01 per step while the gold slips 0.0005 per step (exactly linear: zero standard
    error): a gold slope above −min_slope (−1e-3) is not hacking."""
    stream = [{"reward": 0.01 * s, "gold_reward": 0.5 - 0.0005 * s} for s in range(60)]
    assert fired(feed(stream), "reward_hacking") == []
    falling = [{"reward": 0.01 * s, "gold_reward": 0.5 - 0.002 * s} for s in range(60)]
    assert fired(feed(falling), "reward_hacking") == [(19, "warn")]  # the first full window of 20 points


def test_reward_hacking_pairs_only_steps_logging_both():
    # gold logged every 5th step only: the rule sees 20 paired points after 100 steps
    stream = [
        {"reward": 0.01 * s, **({"gold_reward": 0.5 - 0.01 * s} if s % 5 == 0 else {})} for s in range(150)
    ]
    assert fired(feed(stream), "reward_hacking") == [(95, "warn")]



def test_reward_hacking_reads_the_proxy_reward_where_a_run_logs_one():
    """A GRPO step whose reward holds a judge's score and a verifier's logs proxy_reward (the judge's part) and
    gold_reward: the rule reads proxy_reward in place of reward. Here the proxy climbs and the gold turns down at
    step 30 (test_reward_hacking's stream) while the total reward stays flat (the judge's rise paid for by the
    verifier's fall): the gaming shows against the proxy, not against the total; a run without proxy_reward is
    read on its reward as before."""
    def step(s):
        return {"reward": 0.5, "proxy_reward": 0.01 * s, "gold_reward": 0.01 * s if s < 30 else 0.3 - 0.01 * (s - 30)}

    m = feed([step(s) for s in range(80)])
    assert fired(m, "reward_hacking") == [(42, "warn")] and m.events[0].metric == "proxy_reward"
    total = [{k: v for k, v in step(s).items() if k != "proxy_reward"} for s in range(80)]
    assert fired(feed(total), "reward_hacking") == []  # the total alone: nothing rises
    m = feed([{"reward": r["proxy_reward"], "gold_reward": r["gold_reward"]} for r in map(step, range(80))])
    assert fired(m, "reward_hacking") == [(42, "warn")] and m.events[0].metric == "reward"


def test_heldout_hacking_by_hand():
    """gold 0.42 -> 0.33 on 200 problems: SE = sqrt((0.42·0.58 + 0.33·0.67) / 200) = 0.04808, a drop of 1.87 SE
    (quiet at min_z 2); 0.42 -> 0.31: SE 0.04782, 2.30 SE (fires) — only while the proxy rose > 0.05."""
    from align.monitor import check_heldout_hacking

    def check(g, p):
        return check_heldout_hacking([0.42, g], [0.2, p], [200.0, 200.0], [0.0, 1.5], window=1, min_z=2.0,
                                     min_rise=0.05)

    assert not check(0.33, 0.5).fired
    res = check(0.31, 0.5)
    assert res.fired and res.value == 0.31
    assert res.threshold == pytest.approx(0.42 - 2 * math.sqrt((0.42 * 0.58 + 0.31 * 0.69) / 200))
    assert "0.42 -> 0.31" in res.detail and "-2.3 SE" in res.detail and "KL 1.5" in res.detail
    assert not check(0.31, 0.24).fired  # the proxy did not rise: a policy getting worse, not reward hacking
    assert not check(0.55, 0.9).fired  # both up: healthy


def test_heldout_hacking_fires_at_the_first_evaluation_past_noise():
    """PPO's evaluations (every 5 steps, the first before training) fed with the training steps between them:
    the held-out gold slides from 0.42 by 1.5 points per evaluation while the proxy climbs; the rule fires at the
    first evaluation more than 2 SE below the start and not before, and never on the training steps."""
    stream = []
    for s in range(51):
        row = {"reward": 0.2 + 0.005 * s, "objective/kl": 0.02 * s} if s else {}
        if s % 5 == 0:
            k = s // 5
            row.update({"eval/pass@1/greedy": 0.42 - 0.015 * k, "eval/reward": 0.2 + 0.04 * k,
                        "eval/problems": 200.0, "eval/kl": 0.02 * s})
        stream.append(row)
    m = feed(stream)
    # 0.42 - 0.015k below 0.42 - 2·SE: k = 7 (0.315, SE 0.0479: 2.19 SE); k = 6 (0.33) is 1.87 SE
    assert fired(m, "reward_hacking_heldout") == [(35, "warn")]
    assert "KL 0.7" in m.events[0].detail
    healthy = [{**r, "eval/pass@1/greedy": 0.42 + 0.01 * (i // 5)} if "eval/problems" in r else r
               for i, r in enumerate(stream)]
    assert fired(feed(healthy), "reward_hacking_heldout") == []



# The default chain's PPO stage as it was at commit dd6650f (from the 1,500-step SFT model, against a 0.80-accurate
# scalar-head RM, 50 steps, lr 1e-4, adaptive KL, ptx 0.1), its held-out evaluations as recorded: (step, greedy pass@1 on 200
# problems, RM score of those answers, KL per episode). Held-out gold falls 0.42 -> 0.23 while the proxy climbs.
DEFAULT_CHAIN_PPO_EVALS = [(0, 0.42, 0.2148, 0.0), (5, 0.335, 0.2431, 0.1844), (10, 0.275, 0.2719, 0.3861),
                           (15, 0.23, 0.3858, 0.6298), (20, 0.24, 0.3661, 0.5173), (25, 0.32, 0.3445, 0.7405),
                           (30, 0.32, 0.4008, 0.5971), (35, 0.275, 0.3603, 0.9114), (40, 0.295, 0.5225, 3.5816),
                           (45, 0.28, 0.4693, 0.9879), (50, 0.29, 0.559, 0.6314)]


def test_heldout_hacking_fires_on_the_default_chain_ppo_within_ten_steps():
    """At step 5 the gold is 1.8 SE down and the proxy up only 0.03; at step 10 both are clear: it fires there,
    once (debounced while it stays true), and not on the same evaluations with the gold holding its start."""
    m = RLMonitor()
    for step, gold, proxy, kl in DEFAULT_CHAIN_PPO_EVALS:
        m.update(step, {"eval/pass@1/greedy": gold, "eval/reward": proxy, "eval/problems": 200.0, "eval/kl": kl})
    assert fired(m, "reward_hacking_heldout") == [(10, "warn")]
    assert "0.42 -> 0.275" in m.events[0].detail and "0.215 -> 0.272" in m.events[0].detail
    m = RLMonitor()
    for step, gold, proxy, kl in DEFAULT_CHAIN_PPO_EVALS:
        m.update(step, {"eval/pass@1/greedy": 0.42, "eval/reward": proxy, "eval/problems": 200.0, "eval/kl": kl})
    assert fired(m, "reward_hacking_heldout") == []


# The default chain's PPO stage now (commit 7aef21f: likelihood-head RM, 15 steps, lr 3e-5, fixed β 0.2, ptx 0.5),
# its held-out evaluations as recorded on seeds 0 and 1 (the proxy rises, and so does the gold); and a 15-step run
# at lr 1e-4 (seed 1) whose greedy pass@1 swung 0.395 -> 0.445 -> 0.365 at the same KL: noise, not hacking.
HEALTHY_CHAIN_PPO_EVALS = {
    "seed 0": [(0, 0.42, 0.0841, 0.0), (5, 0.425, 0.1697, 0.0664), (10, 0.425, 0.1566, 0.0381), (15, 0.455, 0.1726, 0.0892)],
    "seed 1": [(0, 0.395, 0.1363, 0.0), (5, 0.44, 0.1968, 0.034), (10, 0.44, 0.2289, 0.098), (15, 0.435, 0.2259, 0.135)],
    "lr 1e-4": [(0, 0.395, 0.136, 0.0), (5, 0.435, 0.188, 0.176), (10, 0.445, 0.197, 0.24), (15, 0.365, 0.199, 0.246)],
}


@pytest.mark.parametrize("rule", ["reward_hacking_heldout", "heldout_degradation"])
@pytest.mark.parametrize("run", list(HEALTHY_CHAIN_PPO_EVALS))
def test_heldout_rules_stay_silent_on_the_healthy_chain_ppo(run, rule):
    m = RLMonitor()
    for step, gold, proxy, kl in HEALTHY_CHAIN_PPO_EVALS[run]:
        m.update(step, {"eval/pass@1/greedy": gold, "eval/reward": proxy, "eval/problems": 200.0, "eval/kl": kl})
    assert fired(m, rule) == []


def test_a_reward_failing_on_every_row_stops_after_five_steps_in_a_row():
    errors = [1.0] * 4 + [0.9] + [1.0] * 5  # one step with a single good row restarts the count
    m = feed([{"rewards/errors": e} for e in errors])
    assert fired(m, "reward_errors") == [(9, "stop")] and m.should_stop()
    assert fired(feed([{"rewards/errors": 0.99}] * 100), "reward_errors") == []  # most rows failing: not a stop


def test_no_signal_stops_after_fifty_steps_in_a_row():
    m = feed([{"signal_frac": 0.0}] * 49 + [{"signal_frac": 0.01}] + [{"signal_frac": 0.0}] * 50)
    assert fired(m, "no_signal") == [(99, "stop")]
    assert "every advantage is 0" in m.events[0].message and "align eval" in m.events[0].message


def test_a_run_shorter_than_the_window_is_judged_as_a_whole_at_its_end():
    m = feed([{"signal_frac": 0.0, "rewards/errors": 1.0}] * 3)
    assert m.events == []  # three steps: neither window is full
    events = m.end(3)
    # a reward failing on every row is a bug a short run shows; no signal in 3 steps is no verdict on the run: a
    # warning (no_signal's short_run; a TOML override makes it a stop again)
    assert [(e.rule, e.severity, e.step) for e in events] == [("reward_errors", "stop", 3), ("no_signal", "warn", 3)]
    assert "each of the last 3 steps" in events[0].detail and "the whole run" in events[0].detail
    assert events[1].detail.endswith("(the whole run; shorter than the rule's 50-step window: a warning, not a stop)")
    assert m.events == events and m.should_stop()
    assert not m.should_stop(events[1:])
    strict = feed([{"signal_frac": 0.0}], RLMonitor(overrides={"no_signal": {"short_run": "stop"}})).end(1)
    assert [(e.severity, e.detail) for e in strict] == [("stop", "<= 0 at each of the last 1 steps (the whole run)")]
    assert feed([{"signal_frac": 0.0}] * 2 + [{"signal_frac": 0.25}]).end(3) == []  # one step taught something
    assert feed([{"loss": 1.0}] * 3).end(3) == []  # rules whose metric was never logged (SFT) stay silent
    assert feed([{"signal_frac": 0.0}], RLMonitor(overrides={"no_signal": {"enabled": False}})).end(1) == []
    warned = feed([{"signal_frac": 0.0}], RLMonitor(overrides={"no_signal": {"severity": "warn"}})).end(1)
    assert [e.severity for e in warned] == ["warn"]


# --- behaviour ----------------------------------------------------------------------------------


def test_debounce_reports_start_and_recurrence():
    stream = flat_then("kl", 0.05, 2.0) + [{"kl": 0.05}] * 30 + [{"kl": 2.0}] * 20
    m = feed(stream)
    assert fired(m, "kl_high") == [(21, "warn"), (71, "warn")]
    assert fired(m, "kl_spike") == [(20, "warn"), (70, "warn")]  # the jumps themselves, at once
    assert m.summary()["counts"] == {"kl_high": 2, "kl_spike": 2}
    assert m.summary()["first_step"] == {"kl_high": 21, "kl_spike": 20}


def test_steps_without_the_metric_do_not_clear_a_firing_rule():
    stream = flat_then("kl", 0.05, 2.0) + [{"loss": 1.0}] * 5 + [{"kl": 2.0}] * 5
    assert fired(feed(stream), "kl_high") == [(21, "warn")]


def test_update_returns_only_new_events():
    m = RLMonitor()
    for s in range(20):
        assert m.update(s, {"kl": 0.05}) == []
    assert [e.rule for e in m.update(20, {"kl": 2.0})] == ["kl_spike"]
    (event,) = m.update(21, {"kl": 2.0})
    assert isinstance(event, Event) and event.rule == "kl_high" and event.threshold == 0.5
    assert "KL coefficient" in event.message and "kl_high" in str(event)
    assert m.update(22, {"kl": 2.0}) == []
    assert not m.should_stop()


def test_absent_metrics_keep_rules_inactive():
    m = feed([{"loss": 1.0}] * 50 + [{"loss": 1.0, "other/thing": float("nan"), "note": "text"}])
    assert m.events == []
    assert set(m.history) == {"loss", "other/thing"}  # strings are not metrics


def test_overrides_change_threshold_severity_window_and_enable():
    stream = flat_then("kl", 0.05, 2.0)
    assert fired(feed(stream, RLMonitor(overrides={"kl_high": {"max_value": 5.0}})), "kl_high") == []
    m = feed(stream, RLMonitor(overrides={"kl_high": {"severity": "stop"}}))
    assert fired(m, "kl_high")[0] == (21, "stop") and m.should_stop()
    assert fired(feed(stream, RLMonitor(overrides={"kl_high": {"window": 1}})), "kl_high") == [(20, "warn")]
    assert fired(feed(stream, RLMonitor(overrides={"kl_high": {"enabled": False}})), "kl_high") == []
    m = feed([{"loss": float("nan")}], RLMonitor(overrides={"nan": {"severity": "warn"}}))
    assert fired(m, "nan") == [(0, "warn")] and not m.should_stop()


def test_overrides_do_not_leak_into_defaults_or_given_rules():
    rules = default_rules()
    RLMonitor(rules=rules, overrides={"kl_high": {"max_value": 9.0}})
    assert next(r for r in rules if r.name == "kl_high").params["max_value"] == 0.5
    assert RLMonitor().rules[2].params["max_value"] == 0.5


@pytest.mark.parametrize("overrides, key", [
    ({"kl_hgih": {"max_value": 1.0}}, "kl_hgih"),
    ({"kl_high": {"max_val": 1.0}}, "max_val"),
    ({"kl_high": {"severity": "error"}}, "severity"),
    ({"kl_high": {"window": 0}}, "window"),
    ({"kl_high": {"max_value": "high"}}, "max_value"),
    ({"kl_high": {"enabled": "no"}}, "enabled"),
    ({"kl_high": 1.0}, "kl_high"),
])
def test_bad_override_is_a_user_error(overrides, key):
    with pytest.raises(UserError, match=key):
        RLMonitor(overrides=overrides)


def test_custom_rules_replace_defaults():
    rule = Rule("reward_too_high", "reward", check_above, "stop", 1, "suspicious", {"max_value": 10.0})
    m = feed([{"reward": 1.0}, {"reward": 100.0}, {"loss": float("nan")}], RLMonitor(rules=[rule]))
    assert [(e.step, e.rule, e.severity) for e in m.events] == [(1, "reward_too_high", "stop")]


def test_numeric_values_are_accepted_in_any_number_type():
    class Scalar:  # stands in for a 0-d tensor
        def __float__(self):
            return 3.0

    m = RLMonitor()
    m.update(0, {"kl": Scalar(), "reward": 1, "flag": True, "none": None})
    assert m.history == {"kl": [3.0], "reward": [1.0]}


# --- held-out degradation and the rollout/trainer mismatch ------------------------------------------------------


def test_heldout_degradation_by_hand():
    """Best 0.445 on 200 problems, latest 0.365: p̄ 0.405, SE = sqrt(2·0.405·0.595/200) = 0.04909, a drop of 0.08 =
    1.63 SE (quiet at z 2); latest 0.34: p̄ 0.3925, SE 0.04884, 0.105 = 2.15 SE (fires). Against the first (0.395)
    the same 0.34 is 1.13 SE: quiet with vs_best 0. On 2,000 problems 0.365 is 5.2 SE down: the threshold is the
    held-out set's noise, not a constant."""
    from align.monitor import check_heldout_degradation

    def check(g, n=200.0, vs_best=1.0):
        return check_heldout_degradation([0.395, 0.445, g], [n] * 3, window=3, min_z=2.0, vs_best=vs_best)

    assert not check(0.365).fired
    res = check(0.34)
    assert res.fired and res.value == 0.34
    assert res.threshold == pytest.approx(0.445 - 2 * math.sqrt(2 * 0.3925 * 0.6075 / 200))
    assert "2.2 SE below the best earlier evaluation (0.445)" in res.detail
    assert not check(0.34, vs_best=0.0).fired
    assert check(0.365, n=2000.0).fired
    assert not check_heldout_degradation([0.4], [200.0], window=1, min_z=2.0, vs_best=1.0).fired  # one evaluation


def test_heldout_degradation_fires_without_a_proxy_gain():
    """The default chain's PPO evaluations with the proxy held flat: reward_hacking_heldout (which needs the proxy
    to rise) stays quiet, heldout_degradation fires at step 10 (0.42 -> 0.275: 3.0 SE; step 5's 0.335 is 1.75 SE)."""
    m = RLMonitor()
    for step, gold, _, kl in DEFAULT_CHAIN_PPO_EVALS:
        m.update(step, {"eval/pass@1/greedy": gold, "eval/reward": 0.2, "eval/problems": 200.0, "eval/kl": kl})
    assert fired(m, "heldout_degradation") == [(10, "warn")]
    assert fired(m, "reward_hacking_heldout") == []


def test_rollout_mismatch_threshold_follows_the_precision():
    """fp32: 1e-3 nats/token; 16-bit: 0.1 (a jump needs to clear a fifth of it). A user override wins over the
    precision's default."""
    stream = [{"rollout/logp_abs_diff": 2e-6}] * 3 + [{"rollout/logp_abs_diff": 0.01}]
    m = RLMonitor()
    m.set_precision("fp32")
    assert fired(feed(stream, m), "rollout_mismatch") == [(3, "warn")]
    m = RLMonitor()
    m.set_precision("bf16-pure")
    assert fired(feed(stream, m), "rollout_mismatch") == []
    m = RLMonitor(overrides={"rollout_mismatch": {"max_value": 0.005}})
    m.set_precision("bf16-pure")
    assert fired(feed(stream, m), "rollout_mismatch") == [(3, "warn")]


@pytest.mark.parametrize("run,fires_at", [("healthy-metrics.jsonl", None), ("stale-at-6-metrics.jsonl", 7)])
def test_rollout_mismatch_on_the_gpu_runs(run, fires_at):
    """benchmarks/monitor_gpu.sh on one H200 (bf16, the fast decoder, 135M shape): the healthy run's gap (4-5e-3) is
    quiet; the run whose decoder copy stops being refreshed after its 6th load fires at its first stale rollout
    (step 7: 0.089, 18x the previous median, under the 0.1 ceiling: the jump test finds it)."""
    m = RLMonitor()
    m.set_precision("bf16-pure")
    for line in (REAL_RUNS.parent / "monitor_gpu_runs" / run).read_text().splitlines():
        row = json.loads(line)
        m.update(row.pop("step"), row)
    assert [e.step for e in m.events if e.rule == "rollout_mismatch"][:1] == ([fires_at] if fires_at else [])
    assert all(e.rule == "rollout_mismatch" for e in m.events)


@pytest.mark.parametrize("run,rollout_precision", [("bf16-0", "auto"), ("fp8-0", "fp8")])
def test_fp8_rollouts_mismatch_is_within_their_rule(run, rollout_precision):
    """benchmarks/fp8_learning_gpu.sh on one H100 (SmolLM2-135M GRPO, 60 steps, seed 0): FP8 rollouts' gap to the
    bf16 trainer (0.17 falling to 0.13 nats/token) is quiet under the FP8 ceiling, as bf16 rollouts' (0.04) are under
    the 16-bit one; read with the 16-bit ceiling, the FP8 run fires at its first step."""
    text = (REAL_RUNS.parent / "fp8_runs" / f"{run}-metrics.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines()]

    def mismatch_events(rollout):
        m = RLMonitor()
        m.set_precision("bf16-pure", rollout)
        for row in rows:
            row = dict(row)
            m.update(row.pop("step"), row)
        return [e.step for e in m.events if e.rule == "rollout_mismatch"]
    assert mismatch_events(rollout_precision) == []
    if rollout_precision == "fp8":
        assert mismatch_events("auto")[:1] == [1]


def test_rollout_mismatch_jump_needs_history_and_the_floor():
    """A 16-bit gap that steps up 5x fires once it is above a fifth of the ceiling; a rise within the floor, or before
    three values of history, does not; a healthy real model's 0.04 at 2 nats/token is no alarm."""
    def run(values):
        m = RLMonitor()
        m.set_precision("bf16")
        return fired(feed([{"rollout/logp_abs_diff": v} for v in values], m), "rollout_mismatch")
    assert run([0.004] * 5 + [0.03]) == [(5, "warn")]
    assert run([0.002] * 5 + [0.015]) == []  # x7.5 but under the floor (0.02)
    assert run([0.004, 0.004, 0.03]) == []  # two values of history
    assert run([0.041, 0.039, 0.039, 0.040, 0.038, 0.028, 0.013, 0.006, 0.013, 0.005]) == []
    assert run([0.02] * 4 + [0.11]) == [(4, "warn")]  # the ceiling


# --- tools (--tools) -----------------------------------------------------------------------------


def tool_stream(n=60, seed=0, failures=0.05, max_turns=0.02, calls=(0.3, 1.0), reward=(0.1, 0.9)):
    """A run with the calculator: calls per episode and reward rising together (a policy learning its tool),
    a few failed calls and episodes cut at --max-turns."""
    rng = random.Random(seed)
    rows = []
    for s in range(n):
        t = min(1.0, 2 * s / n)
        rows.append({"reward": reward[0] + (reward[1] - reward[0]) * t + rng.gauss(0, 0.05),
                     "tools/call_frequency": max(0.0, calls[0] + (calls[1] - calls[0]) * t + rng.gauss(0, 0.05)),
                     "tools/failure_frequency": min(1.0, max(0.0, failures + rng.gauss(0, 0.03))),
                     "episodes/stop/max_turns": min(1.0, max(0.0, max_turns + rng.gauss(0, 0.02)))})
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_policy_learning_its_tool_raises_nothing(seed):
    assert feed(tool_stream(seed=seed)).events == []


def test_a_broken_tool_stops_after_five_steps_of_failed_calls():
    rows = tool_stream(n=20)
    for r in rows[8:]:
        r["tools/failure_frequency"] = 1.0
    assert fired(feed(rows), "tool_broken")[0] == (12, "stop")
    rows[10]["tools/failure_frequency"] = 0.9  # one step with an answer: not 5 in a row until step 15
    assert fired(feed(rows), "tool_broken")[0] == (15, "stop")


def test_most_calls_failing_warns_and_a_few_do_not():
    assert fired(feed(tool_stream(failures=0.7)), "tool_errors_high") == [(9, "warn")]
    assert fired(feed(tool_stream(failures=0.4)), "tool_errors_high") == []


def test_a_turn_limit_loop_warns():
    rows = tool_stream(n=40)
    for r in rows[20:]:
        r["episodes/stop/max_turns"] = 0.8
    assert fired(feed(rows), "turn_limit") == [(25, "warn")]


def test_giving_up_the_tool_warns_only_while_the_reward_falls():
    quit_tool = tool_stream(calls=(0.8, 0.1), reward=(0.6, 0.2))
    assert fired(feed(quit_tool), "tools_abandoned")
    # fewer calls while the reward rises: the policy learned it needs fewer (not a warning)
    assert fired(feed(tool_stream(calls=(0.8, 0.1), reward=(0.2, 0.8))), "tools_abandoned") == []


def test_answers_that_grow_by_the_tool_calls_the_policy_learned_are_not_length_drift():
    """With --tools, a policy that learns to call its tool writes the calls: its length doubles. That is not length
    hacking when the calls per episode rose with it; the same growth without more calls still warns."""
    rows = tool_stream(n=40, calls=(0.2, 1.0))
    for i, r in enumerate(rows):
        r["completions/mean_length"] = 15.0 if i < 20 else 31.0
    assert fired(feed(rows), "length_drift") == []
    for r in rows:
        r["tools/call_frequency"] = 0.2
    assert fired(feed(rows), "length_drift")
    # calls that grew by the length's factor (0.25 -> 0.7 a step, x2.8, length x2.1): quiet; by less: it warns
    for i, r in enumerate(rows):
        r["tools/call_frequency"] = 0.25 if i < 20 else 0.7
        r["completions/mean_length"] = 23.0 if i < 20 else 49.0
    assert fired(feed(rows), "length_drift") == []
    for i, r in enumerate(rows):
        r["tools/call_frequency"] = 0.25 if i < 20 else 0.4
    assert fired(feed(rows), "length_drift")
