"""Every stage, run for a few steps with its options at distinctive non-default values, gives the figures stored
in tests/fixtures/golden/ (tests/golden.py: what is compared, and how to regenerate after an intended change)."""

import json

import pytest

from tests import golden


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return golden.inputs(tmp_path_factory.mktemp("golden_inputs"))


@pytest.mark.parametrize("name", list(golden.RUNS))
def test_a_short_run_gives_the_stored_figures(name, files, tmp_path, single_process):
    want = json.loads((golden.GOLDEN / f"{name}.json").read_text())
    got = golden.run(name, files, tmp_path / name)
    diff = golden.differences(want, got)
    assert not diff, (f"{name}: {len(diff)} figures differ from tests/fixtures/golden/{name}.json (an intended change "
                      f"of behaviour: `python -m tests.golden --update {name}`, and say why in the commit):\n"
                      + "\n".join(diff[:20]))


def test_the_comparison_sees_a_changed_figure_and_a_missing_one():
    want = {"steps": [{"loss": 1.0, "kl": 0.5}], "answers": ["12"], "weights": {"w": [1.0, 2.0, 3.0]}}
    assert golden.differences(want, json.loads(json.dumps(want))) == []
    assert golden.differences(want, {**want, "steps": [{"loss": 1.0 + 5e-5, "kl": 0.5}]}) == []  # rounding
    assert golden.differences(want, {**want, "steps": [{"loss": 1.001, "kl": 0.5}]}) == ["steps[0].loss: 1.001, stored 1.0"]
    assert golden.differences(want, {**want, "steps": [{"loss": 1.0}]}) == ["steps[0].kl: missing"]
    assert golden.differences(want, {**want, "answers": ["13"]}) == ["answers[0]: '13', stored '12'"]
    assert golden.differences(want, {**want, "weights": {}}) == ["weights.w: missing"]
    # a weight's signed sums within REL·‖w‖ (‖w‖ = √2 here), its Σw² within REL
    assert golden.differences(want, {**want, "weights": {"w": [1.0001, 2.0, 3.0001]}}) == []
    assert golden.differences(want, {**want, "weights": {"w": [1.001, 2.0, 3.0]}}) == ["weights.w[0]: 1.001, stored 1.0"]
    assert golden.differences(want, {**want, "weights": {"w": [1.0, 2.0004, 2.999]}}) == [
        "weights.w[1]: 2.0004, stored 2.0", "weights.w[2]: 2.999, stored 3.0"]


def test_dpo_implicit_rewards_are_compared_at_their_log_probs_rounding_and_a_tie_accuracy_not_at_all():
    step0 = {"logps/chosen": -100.0, "rewards/chosen": 0.0, "rewards/rejected": 0.0, "rewards/margins": 0.0,
             "rewards/accuracies": 0.0, "loss": 0.693}
    noise = {**step0, "rewards/chosen": 3e-8, "rewards/margins": 5e-8, "rewards/accuracies": 0.25}
    assert golden.differences(step0, noise) == []  # policy = reference: every pair a tie, its sign is rounding
    later = {**step0, "rewards/chosen": 0.2, "rewards/rejected": 0.1, "rewards/margins": 0.1, "rewards/accuracies": 0.5}
    assert golden.differences(later, {**later, "rewards/margins": 0.10005}) == []  # 1e-6·|logp| = 1e-4
    assert golden.differences(later, {**later, "rewards/margins": 0.1003}) == ["rewards/margins: 0.1003, stored 0.1"]
    assert golden.differences(later, {**later, "rewards/accuracies": 0.75}) == ["rewards/accuracies: 0.75, stored 0.5"]
    assert golden.differences(step0, {**noise, "loss": 0.7}) == ["loss: 0.7, stored 0.693"]
    ev = {"eval/logps/chosen": -100.0, "eval/rewards/margins": 0.0066498}
    assert golden.differences(ev, {**ev, "eval/rewards/margins": 0.0066452}) == []
    assert golden.differences(ev, {**ev, "eval/rewards/margins": 0.0068}) == [
        "eval/rewards/margins: 0.0068, stored 0.0066498"]
