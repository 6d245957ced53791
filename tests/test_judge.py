"""LLM judges (align.judge): the pointwise score is the expectation of the score labels under the judge's
next-token distribution, computed here by hand from the model's own logits; pairwise preferences average both
orders, so a position-biased judge scores identical answers 0.5; a rubric whose end merges with a label is refused."""

from __future__ import annotations

import math

import pytest
import torch

from align.errors import UserError
from align.judge import PAIR_RUBRIC, RUBRIC, Judge, both_orders, expected_score, fill, first_preferred


def test_expected_score_and_pairwise_by_hand():
    z = torch.full((2, 6), -1e9)
    # labels are tokens 4, 1, 3 (scores 0, 1, 2): probabilities 1/4, 1/4, 1/2 -> (0/4 + 1/4 + 2/2) / 2 = 0.625
    z[0, [4, 1, 3]] = torch.tensor([0.0, 0.0, math.log(2.0)])
    z[1, [4, 1, 3]] = torch.tensor([5.0, -5.0, -5.0])  # nearly all on the lowest label
    got = expected_score(z, [4, 1, 3])
    assert got[0].item() == pytest.approx(0.625) and got[1].item() == pytest.approx(0.0, abs=1e-4)
    v = torch.tensor([[2.0, 0.5, 9.0]])  # A = token 0, B = token 1: sigma(1.5); the other token is ignored
    assert first_preferred(v, 0, 1).item() == pytest.approx(1 / (1 + math.exp(-1.5)))
    assert both_orders(torch.tensor(0.8), torch.tensor(0.8)).item() == pytest.approx(0.5)  # first position favoured
    assert both_orders(torch.tensor(0.9), torch.tensor(0.3)).item() == pytest.approx(0.8)
    assert fill("{prompt} {x} {completion}", prompt="a {b}", completion="c") == "a {b} {x} c"


def load(tiny_model_dir):
    from align.models import load_causal_lm, load_tokenizer, resolve

    source = resolve(str(tiny_model_dir))
    tok = load_tokenizer(source)
    return load_causal_lm(source, tok, torch.float32, seed=0).eval(), tok


def test_a_tiny_judge_scores_the_expectation_of_its_own_logits(tiny_model_dir):
    """Batched with left padding, each score equals the expectation computed from one unpadded forward of that
    text; identical answers are preferred 0.5 whatever the judge's position bias."""
    model, tok = load(tiny_model_dir)
    judge = Judge(model, tok, batch_size=2)
    prompts = ["Sort 3 1 2:", "What is 7 + 5?", "hi"]
    answers = ["1 2 3", "It is twelve, since 7 + 5 = 12.", "hello there"]
    got = judge.scores(prompts, answers)
    for p, a, s in zip(prompts, answers, got):
        ids = tok(judge.text(fill(RUBRIC, prompt=p, completion=a)), add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            z = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        probs = z[judge.score_ids].softmax(-1)
        assert s == pytest.approx(sum(k * probs[k].item() for k in range(10)) / 9, abs=1e-5)
    assert len(set(judge.score_ids)) == 10 and tok.decode(judge.score_ids) == "0123456789"
    same = judge.preferences(prompts, answers, answers)
    raw = first_preferred(judge.next_token_logits(
        [judge.text(fill(PAIR_RUBRIC, prompt=p, a=a, b=a)) for p, a in zip(prompts, answers)]), *judge.pair_ids)
    assert (raw - 0.5).abs().max() > 1e-3  # the random judge favours a position ...
    assert same == pytest.approx([0.5] * 3, abs=1e-6)  # ... which both orders cancel
    ab, ba = judge.preferences(prompts, answers, answers[::-1]), judge.preferences(prompts, answers[::-1], answers)
    assert [x + y for x, y in zip(ab, ba)] == pytest.approx([1.0] * 3, abs=1e-6)  # P(a > b) + P(b > a) = 1


def test_a_rubric_whose_end_merges_with_a_label_is_refused(tiny_model_dir):
    model, tok = load(tiny_model_dir)
    tok.chat_template = None  # the rubric read as plain text: its last character meets the label
    with pytest.raises(UserError, match="one token after the rubric's end"):
        Judge(model, tok, pair_rubric=PAIR_RUBRIC.rstrip("\n") + " Better: ")  # " A" is one token here
    Judge(model, tok)  # the shipped rubrics end with a newline: every label its own token


def test_reward_judge_model_scores_as_the_judge_and_its_rubric_is_checked(tiny_model_dir, tmp_path):
    """--reward judge:MODEL[:WEIGHT] is a batched reward giving the Judge's pointwise scores (chat prompts read as
    their messages); --judge-rubric replaces the rubric, and one without {completion} is refused before a run."""
    from align.judge import load
    from align.rewards import call_rewards, parse_rewards
    from stages.grpo_config import GRPOConfig

    (r,) = parse_rewards([f"judge:{tiny_model_dir}:0.5"])
    assert (r.name, r.weight, r.batched) == ("judge", 0.5, True)
    rows = [{"prompt": "Sort 3 1 2:"}, {"prompt": [{"role": "user", "content": "What is 7 + 5?"}]}]
    completions = ["1 2 3", "12"]
    got = call_rewards(r, rows[:1], completions[:1]) + call_rewards(r, rows[1:], completions[1:])
    judge = load(str(tiny_model_dir))
    assert got == pytest.approx(judge.scores(["Sort 3 1 2:", "user: What is 7 + 5?"], completions), abs=1e-6)
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("Is this answer short?\n{completion}\nOne digit, 0 to 9:\n")
    cfg = GRPOConfig(model=str(tiny_model_dir), reward=[f"judge:{tiny_model_dir}"], judge_rubric=str(rubric))
    cfg.validate()
    (own,) = parse_rewards(cfg.reward, judge_rubric=cfg.rubric())
    assert call_rewards(own, rows[:1], ["1 2 3"]) == pytest.approx(
        Judge(judge.model, judge.tok, rubric=rubric.read_text()).scores(["Sort 3 1 2:"], ["1 2 3"]), abs=1e-6)
    rubric.write_text("Is this answer short? {answer}\n")
    with pytest.raises(UserError, match="no {completion}"):
        GRPOConfig(model=str(tiny_model_dir), reward=[f"judge:{tiny_model_dir}"], judge_rubric=str(rubric)).validate()
