"""align.objectives: one registry per kind of objective. A new preference loss and a new advantage estimator,
defined here and nowhere else, become choices of `align dpo --loss` / `align grpo --advantage` (listed in --help,
accepted by the checks, a bad name still refused with the choices) and train the tiny model. Every registered
objective has a hand-value test (HAND_VALUES)."""

from __future__ import annotations

import ast
import json
import math
import re
import sys

import pytest
import torch

from align import objectives
from align.objectives.advantages import group_moments
from align.objectives.preference import Pairs
from tests.conftest import ROOT, parity_reward, small_data

EXP_LOSS, MEDIAN = "test-exp", "test-median"
CALLS: list[tuple] = []  # (kind, shape of the rewards) of every call of the test estimator


def exp_loss(pairs: Pairs, beta: float, *, label_smoothing: float = 0.0, gamma: float = 0.0):
    """The exponential preference loss of GPO (Tang et al. 2024, "Generalized Preference Optimization"):
    loss = exp(−βΔ), Δ the DPO margin of log-ratios; rewards β(log π − log π_ref)(y)."""
    c, r = pairs.log_ratios()
    return torch.exp(-beta * (c - r)), (beta * c).detach(), (beta * r).detach()


def median_advantages(rewards: torch.Tensor, valid=None, reduce=None) -> torch.Tensor:
    """A = r − the median of the group's rewards (a baseline robust to one outlier)."""
    CALLS.append(tuple(rewards.shape))
    return rewards - rewards.median(dim=1, keepdim=True).values


@pytest.fixture
def new_objectives():
    """The two test objectives, registered for one test (and removed after it)."""
    objectives.register("preference", EXP_LOSS, help="GPO's exponential loss exp(−βΔ)", needs_reference=True)(exp_loss)
    objectives.register("advantage", MEDIAN, help="r − the group's median")(median_advantages)
    CALLS.clear()
    yield
    objectives.unregister("preference", EXP_LOSS)
    objectives.unregister("advantage", MEDIAN)


def help_of(capsys, monkeypatch, *words) -> str:
    """`align WORDS --help` in this process, whitespace and box drawing folded."""
    from align.cli import app

    monkeypatch.setenv("COLUMNS", "4000")
    app().main([*words, "--help"], prog_name="align", standalone_mode=False)
    return re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", capsys.readouterr().out))


def refused(monkeypatch, capsys, tmp_path, *args) -> tuple[int, str]:
    """`align ARGS` in this process through the CLI's error handling: (exit code, what it printed)."""
    from align.cli import main
    from align.console import console

    monkeypatch.setattr(sys, "argv", ["align", *map(str, args), "--out", str(tmp_path / "never")])
    monkeypatch.setattr(console, "_width", 1000)
    with pytest.raises(SystemExit) as e:
        main()
    out = capsys.readouterr()
    assert not (tmp_path / "never").exists()
    return e.value.code, out.out + out.err


# ---- the registry


def test_registering_twice_or_an_unknown_kind_is_an_error_and_traits_have_defaults():
    with pytest.raises(ValueError, match="already registered"):
        objectives.register("advantage", "zscore")(median_advantages)
    with pytest.raises(ValueError, match="unknown kind"):
        objectives.register("reward", "x")(median_advantages)
    with pytest.raises(KeyError, match="registered: zscore, mean"):
        objectives.get("advantage", "nope")
    assert objectives.get("preference", "simpo").needs_reference is False
    assert objectives.get("preference", "sigmoid").needs_reference is True
    assert objectives.get("policy_loss", "reinforce").on_policy and not objectives.get("policy_loss", "clip").on_policy
    assert [e.name for e in objectives.entries("preference", needs_reference=False)] == ["simpo", "orpo"]


def test_the_catalog_lists_the_built_in_entries_as_registered():
    """--help and the checks read align.objectives.catalog (no torch); the registry, filled by the modules, must
    say the same: every built-in entry's name, summary and traits, in registration order."""
    from align.objectives import catalog, registry

    registry.load()
    live = {kind: tuple((e.name, e.help, e.traits) for e in found.values())
            for kind, found in registry.REGISTRIES.items()}
    listed = {kind: tuple((n, h, {**registry.TRAITS.get(kind, {}), **t}) for n, h, t in entries)
              for kind, entries in catalog.BUILTIN.items()}
    assert {k: v[: len(listed.get(k, ()))] for k, v in live.items()} == {k: listed.get(k, ()) for k in live}
    assert catalog.LOSS_AGGREGATIONS == objectives.policy.LOSS_AGGREGATIONS


def test_choices_list_the_catalog_without_importing_torch():
    """A fresh interpreter: the choices of `align grpo --loss` and their summaries come from the catalog, and a
    plug-in registered beside them is listed after them; torch is never imported."""
    code = ("import sys\nfrom align import objectives\n"
            "print(list(objectives.Choices('policy_loss')))\n"
            "print(objectives.Choices('preference', needs_reference=False).describe())\n"
            "assert 'torch' not in sys.modules\n")
    out = __import__("subprocess").run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                                       check=True).stdout.splitlines()
    assert out == ["['clip', 'cispo', 'gspo', 'reinforce']",
                   "simpo (no reference: β·mean log-prob reward with margin --simpo-gamma; SimPO uses β ~2), orpo (no "
                   "reference: chosen NLL + β · odds-ratio term)."]


def test_the_old_flags_are_aliases_of_registered_policy_losses():
    from align.errors import UserError
    from stages.grpo import GRPOConfig

    assert GRPOConfig(reinforce=True).policy_loss == "reinforce"
    assert GRPOConfig(ratio="sequence").policy_loss == "gspo"
    assert GRPOConfig(loss="cispo").policy_loss == "cispo"
    GRPOConfig(loss="gspo", ratio="sequence").validate()
    GRPOConfig(reinforce=True, loss="reinforce").validate()
    with pytest.raises(UserError, match="--loss reinforce is on-policy without KL"):
        GRPOConfig(loss="reinforce", num_iterations=2).validate()
    with pytest.raises(UserError, match="--reinforce is on-policy without KL"):
        GRPOConfig(reinforce=True, beta=0.1).validate()


def test_choices_are_read_from_the_registry_when_checked(new_objectives):
    from stages.dpo import DPOConfig
    from stages.grpo import GRPOConfig

    DPOConfig(loss=EXP_LOSS).validate()
    GRPOConfig(advantage=MEDIAN).validate()
    assert not DPOConfig(loss=EXP_LOSS).reference_free
    objectives.unregister("advantage", MEDIAN)
    try:
        with pytest.raises(Exception, match=f"--advantage must be one of zscore, .*, reinforce\\+\\+, got '{MEDIAN}'"):
            GRPOConfig(advantage=MEDIAN).validate()
    finally:
        objectives.register("advantage", MEDIAN)(median_advantages)


# ---- acceptance: a new loss and a new estimator, defined in this file only


def test_new_objectives_are_listed_in_help(new_objectives, capsys, monkeypatch):
    dpo = help_of(capsys, monkeypatch, "dpo")
    assert f"{EXP_LOSS} (GPO's exponential loss exp(−βΔ))" in dpo and "sigmoid (DPO)" in dpo
    grpo = help_of(capsys, monkeypatch, "grpo")
    assert f"{MEDIAN} (r − the group's median)" in grpo and "rloo (leave-one-out baseline)" in grpo
    assert "gspo (one clipped length-normalised ratio per sequence" in grpo


def test_bad_names_are_refused_listing_the_new_choices(new_objectives, capsys, monkeypatch, tmp_path):
    code, out = refused(monkeypatch, capsys, tmp_path, "dpo", "--loss", "nope")
    assert code == 2 and "Traceback" not in out
    assert "--loss must be one of sigmoid, ipo, ipo-mean, hinge, simpo, orpo, test-exp, kto, got 'nope'." in out
    code, out = refused(monkeypatch, capsys, tmp_path, "grpo", "--advantage", "nope")
    assert code == 2 and f"--advantage must be one of zscore, mean, batch, rloo, reinforce++, {MEDIAN}, got 'nope'." in out


def read_metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_new_preference_loss_trains(new_objectives, single_process, tiny_model_dir, tmp_path):
    """At step 1 the policy is its reference (Δ = 0): the loss is exp(0) = 1 exactly; on the same 4 pairs every
    step it falls and the reward margin grows."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from stages.dpo import DPOConfig, run

    pairs = tmp_path / "four.jsonl"
    pairs.write_text("".join(small_data()["prefs"].read_text().splitlines(keepends=True)[:4]))
    out = tmp_path / "dpo"
    cfg = DPOConfig(model=str(tiny_model_dir), data=str(pairs), eval_data="", pass_data="", out=str(out),
                    loss=EXP_LOSS, beta=0.5, max_steps=3, batch_size=4, lr=1e-3, warmup_steps=0, eval_every=0,
                    final_checkpoint=False)
    cfg.validate()
    try:
        run(cfg)
    finally:
        unset_hf_deepspeed_config()
    steps = [r for r in read_metrics(out) if "loss" in r]
    assert len(steps) == 3 and steps[0]["loss"] == pytest.approx(1.0, abs=1e-6)
    assert steps[-1]["loss"] < steps[0]["loss"] and steps[-1]["rewards/margins"] > steps[0]["rewards/margins"]
    assert json.loads((out / "artifact.json").read_text())["status"] == "complete"


def test_a_new_advantage_estimator_trains(new_objectives, single_process, tiny_model_dir, tmp_path):
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from stages.grpo import GRPOConfig, run

    out = tmp_path / "grpo"
    cfg = GRPOConfig(model=str(tiny_model_dir), data=str(small_data()["arith"]), eval_data="", out=str(out),
                     advantage=MEDIAN, reward=[parity_reward()], max_steps=2, prompts_per_step=2, num_generations=4,
                     max_new_tokens=8, micro_batch_size=8, final_checkpoint=False)
    cfg.validate()
    try:
        run(cfg)
    finally:
        unset_hf_deepspeed_config()
    assert CALLS == [(2, 4), (2, 4)]  # once per step, on [prompts, generations]
    steps = [r for r in read_metrics(out) if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(math.isfinite(r["loss"]) for r in steps)
    assert json.loads((out / "artifact.json").read_text())["status"] == "complete"


# ---- every registered objective has a hand-value test

HAND_VALUES = {
    ("advantage", "zscore"): ["tests/test_rl.py::test_zscore_advantage_by_hand",
                              "tests/test_rl.py::test_group_advantages_with_a_skipped_sample_by_hand"],
    ("advantage", "mean"): ["tests/test_rl.py::test_mean_advantage_by_hand",
                            "tests/test_rl.py::test_group_advantages_with_a_skipped_sample_by_hand"],
    ("advantage", "batch"): ["tests/test_rl.py::test_batch_advantage_uses_the_batch_std",
                             "tests/test_rl.py::test_a_skipped_sample_takes_no_part_in_its_group"],
    ("advantage", "rloo"): ["tests/test_rl.py::test_rloo_advantage_leaves_each_sample_out_of_its_baseline",
                            "tests/test_rl.py::test_group_advantages_with_a_skipped_sample_by_hand"],
    ("advantage", "reinforce++"): [
        "tests/test_rl.py::test_reinforce_pp_whitens_over_the_valid_samples_of_the_whole_batch_by_hand"],
    ("policy_loss", "clip"): ["tests/test_rl.py::test_clipped_surrogate_by_hand"],
    ("policy_loss", "cispo"): ["tests/test_rl.py::test_cispo_by_hand_clips_the_detached_weight_not_the_gradient"],
    ("policy_loss", "gspo"): ["tests/test_rl.py::test_gspo_sequence_ratio_is_length_normalised_by_hand"],
    ("policy_loss", "reinforce"): ["tests/test_rl.py::test_reinforce_by_hand"],
    ("kl", "k1"): ["tests/test_rl.py::test_k1_and_k3_by_hand"],
    ("kl", "k3"): ["tests/test_rl.py::test_k1_and_k3_by_hand",
                   "tests/test_rl.py::test_k3_keeps_pulling_back_a_policy_far_ahead_of_the_reference"],
    ("preference", "sigmoid"): ["tests/test_pref_losses.py::test_dpo_hand_values"],
    ("preference", "ipo"): ["tests/test_pref_losses.py::test_dpo_hand_values",
                            "tests/test_pref_losses.py::test_ipo_on_summed_and_on_mean_log_probs"],
    ("preference", "ipo-mean"): ["tests/test_pref_losses.py::test_ipo_on_summed_and_on_mean_log_probs"],
    ("preference", "hinge"): ["tests/test_pref_losses.py::test_dpo_hand_values"],
    ("preference", "simpo"): ["tests/test_pref_losses.py::test_simpo_loss_by_hand_and_gradcheck"],
    ("preference", "orpo"): ["tests/test_pref_losses.py::test_orpo_loss_by_hand_and_gradcheck"],
    ("unpaired_preference", "kto"): ["tests/test_pref_losses.py::test_kto_loss_by_hand_and_gradcheck"],
    ("shaping", "overlong"): ["tests/test_rl.py::test_distinct_n_and_overlong_and_length_reward_by_hand",
                             "tests/test_objectives.py::test_grpo_adds_the_shaping_terms_to_its_rewards"],
    ("shaping", "length"): ["tests/test_rl.py::test_distinct_n_and_overlong_and_length_reward_by_hand",
                             "tests/test_objectives.py::test_grpo_adds_the_shaping_terms_to_its_rewards"],
}


def test_every_registered_objective_has_a_hand_value_test():
    """A new objective is its function and its test: this list names the test, and fails until it exists."""
    registered = {(e.kind, e.name) for e in objectives.entries(*objectives.registry.KINDS)}
    assert registered == set(HAND_VALUES), registered ^ set(HAND_VALUES)
    for tests in HAND_VALUES.values():
        for test in tests:
            path, name = test.split("::")
            defined = {n.name for n in ast.walk(ast.parse((ROOT / path).read_text())) if isinstance(n, ast.FunctionDef)}
            assert name in defined, test


def test_group_moments_by_hand():
    """The group statistics behind zscore, with a skipped sample: group [1, 2, (skipped 9), 6] has mean 3 and
    unbiased variance ((1−3)² + (2−3)² + (6−3)²) / 2 = 7, count 3."""
    mean, std, n = group_moments(torch.tensor([[1.0, 2.0, 9.0, 6.0]]), torch.tensor([[1, 1, 0, 1]]))
    assert (mean.item(), n.item()) == (3.0, 3.0) and std.item() == pytest.approx(math.sqrt(7))


def test_grpo_adds_the_shaping_terms_to_its_rewards():
    """--reward math --reward length --overlong-cache 4 with a budget of 10 tokens, on one group of three: a correct
    3-token answer, a wrong 8-token one and a correct one truncated at 10 tokens (it counts as 11).
    math: 1, 0, 1. Overlong (0 up to 6 tokens, then (6 − n)/4, floored at −1): 0, −0.5, −1.
    Length (λ = 0.5 − (n − 3)/(10 − 3); a wrong answer gets min(0, λ)): 0.5, −5/7 + 0.5 = −0.2143, −0.5."""
    from align.rewards import parse_rewards
    from align.rollout.batch import Rollout
    from align.rollout.generation import Completion
    from stages.grpo import GRPO, GRPOConfig

    algo = object.__new__(GRPO)  # score() needs the config and the reward functions only
    algo.cfg = GRPOConfig(reward=["math", "length"], max_new_tokens=10, overlong_cache=4)
    algo.reward_fns, algo.rm = parse_rewards(algo.cfg.reward), None
    done = [Completion([1], [5] * 3, "#### 2", True), Completion([1], [5] * 8, "#### 3", True),
            Completion([1], [5] * 10, "#### 2", False)]
    r = Rollout([{"prompt": "1 + 1?", "answer": "2"}], done, 3)
    algo.score(r)
    want = [1 + 0 + 0.5, 0 - 0.5 + (0.5 - 5 / 7), 1 - 1 - 0.5]
    torch.testing.assert_close(r.rewards, torch.tensor([want]))
    assert r.parts["math"] == [1.0, 0.0, 1.0] and r.valid.tolist() == [[1.0, 1.0, 1.0]]
