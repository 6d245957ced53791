"""LLM judges (align.judge): the pointwise score is the expectation of the score labels under the judge's
next-token distribution, computed here by hand from the model's own logits; pairwise preferences average both
orders, so a position-biased judge scores identical answers 0.5; a rubric whose end merges with a label is refused.
What the stages take from it: the samples' ranks, the proxy and gold RLMonitor watches, the --reward spec's model."""

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


def test_a_judge_that_always_answers_a_prefers_neither_answer(tiny_model_dir):
    """A toy judge with a strong position bias (the tiny model, its output row of "A" pushed along its hidden state
    at the verdict: it answers A, the first position, whatever it reads) scores identical answers 0.5 exactly,
    and any two answers 0.5 too: asked in both orders, always-A is no preference."""
    model, tok = load(tiny_model_dir)
    judge = Judge(model, tok)
    prompts, a, b = ["Sort 3 1 2:", "hi", "What is 7 + 5?"], ["1 2 3", "hello", "12"], ["3 2 1", "bye", "13"]
    texts = [judge.text(fill(PAIR_RUBRIC, prompt=p, a=x, b=y)) for p, x, y in zip(prompts, a, b)]
    with torch.no_grad():
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        h = torch.stack([model(input_ids=torch.tensor([i]), output_hidden_states=True).hidden_states[-1][0, -1]
                         for i in ids]).mean(0)
        model.get_output_embeddings().weight[judge.pair_ids[0]] += 40 * h / h.norm() ** 2
    raw = first_preferred(judge.next_token_logits(texts + [judge.text(fill(PAIR_RUBRIC, prompt=p, a=y, b=x))
                                                           for p, x, y in zip(prompts, a, b)]), *judge.pair_ids)
    assert raw.min() > 0.99  # "A" in either order
    assert judge.preferences(prompts, a, a) == pytest.approx([0.5] * 3, abs=1e-6)
    assert judge.preferences(prompts, a, b) == pytest.approx([0.5] * 3, abs=0.01)


def test_what_the_stages_take_from_the_judge(tiny_model_dir):
    """rank_samples: two samples pairwise, a pair's scores P(a > b) and 1 - P(a > b); more samples pointwise, the
    expected scores. watched: the judge's (and a reward model's) values are the proxy, every other function's the
    gold, each the mean over the functions that scored a sample; nothing without both. judge_model: the MODEL of
    --reward judge:MODEL[:WEIGHT]."""
    from align.judge import judge_model, rank_samples, watched
    from align.rewards import RewardFn

    model, tok = load(tiny_model_dir)
    judge = Judge(model, tok)
    prompts, texts = ["Sort 3 1 2:"] * 2 + ["hi"] * 2, ["1 2 3", "3 2 1", "hello", "bye"]
    p = judge.preferences(prompts[::2], texts[::2], texts[1::2])
    assert rank_samples(judge, prompts, texts, 2).tolist() == pytest.approx([p[0], 1 - p[0], p[1], 1 - p[1]])
    assert rank_samples(judge, prompts[:3], texts[:3], 3).tolist() == pytest.approx(judge.scores(prompts[:3], texts[:3]))
    fns = [RewardFn("judge", 0.5, print, True), RewardFn("math", 1.0, print), RewardFn("f.g", 0.0, print, True),
           RewardFn("length", 1.0, None)]
    parts = [{"errors": 0.0, "judge": 0.8, "math": 1.0, "f.g": 0.0}, {"errors": 1.0},
             {"errors": 0.0, "judge": 0.2, "math": 0.0}, {"errors": 0.0, "judge": 0.4, "reward_model": -1.0}]
    assert watched(fns, parts) == {"proxy_reward": [0.8, 0.2, 0.4], "gold_reward": [0.5, 0.0]}
    assert watched(fns, parts, reward_model=True)["proxy_reward"] == pytest.approx([0.8, 0.2, -0.3])
    assert watched(fns[:1], parts) == {} and watched(fns[1:], parts) == {}
    assert watched(fns[1:], parts, reward_model=True) == {"proxy_reward": [-1.0], "gold_reward": [0.5, 0.0]}
    assert judge_model(["math", "judge:runs/j:0.5", "judge:other"]) == "runs/j" and judge_model(["math"]) == ""
