"""Preference pairs ranked by an LLM judge (`align data make prefs --from-model M --judge J`, align.judge_pairs), a
judge's demonstrations (`align data make judge`), and pipelines/rlaif.toml: the chosen side is the one the judge
prefers (checked against Judge.preferences / Judge.scores called directly), both orders are asked (a toy judge
that favours a position), pairs under --judge-margin are dropped, the file reads as rm / dpo data, and the
pipeline's stages chain."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from align.errors import UserError
from align.judge import PAIR_RUBRIC, Judge, fill, first_preferred
from align.judge_pairs import (
    agreement,
    judge_pairs,
    keep,
    preference_margin,
    rank_scored,
    rank_two,
)
from stages.data_make import DataMakeConfig, run
from tests.conftest import ROOT, assert_user_error, run_align

RUBRIC_FILE = ROOT / "pipelines/rlaif_rubric.txt"


def _read(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def prompts_file(tmp_path, n: int = 12, answers: bool = False):
    """The first n digit_sort test prompts, {prompt} (the judge alone ranks) or {prompt, answer}."""
    rows = _read(ROOT / "data/digit_sort/test.jsonl")[:n]
    f = tmp_path / ("verifiable.jsonl" if answers else "prompts.jsonl")
    f.write_text("".join(json.dumps({k: r[k] for k in (("prompt", "answer") if answers else ("prompt",))}) + "\n"
                         for r in rows))
    return f


def make(out, **options) -> tuple[dict, list[dict]]:
    """`align data make prefs` with these options (checked as the CLI checks them): its summary and its rows."""
    cfg = DataMakeConfig(task="prefs", out=str(out), max_new_tokens=6, seed=1, **options)
    cfg.validate()
    return run(cfg), _read(out)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_ranking_and_margins_by_hand():
    assert preference_margin(0.75) == pytest.approx(0.5)
    assert rank_two("x", "y", 0.3) == pytest.approx(
        {"chosen": "y", "rejected": "x", "judge_prob": 0.7, "judge_margin": 0.4})
    assert rank_two("x", "y", 0.8)["chosen"] == "x"
    assert not keep(rank_two("x", "y", 0.5), 0.0) and not keep(rank_two("x", "y", 0.5 + 3e-8), 0.0)  # ties: no side
    assert keep({"judge_margin": 0.1}, 0.1) and not keep({"judge_margin": 0.0999}, 0.1)
    # the best against the two worst, worst first
    got = rank_scored(["a", "b", "c", "d"], [0.2, 0.9, 0.5, 0.1], k=2)
    assert [(p["chosen"], p["rejected"]) for p in got] == [("b", "d"), ("b", "a")]
    assert [p["judge_margin"] for p in got] == pytest.approx([0.8, 0.7])
    assert agreement([(True, False), (False, True), (True, True), (True, False)]) == (pytest.approx(2 / 3), 3)
    assert agreement([(True, True), (False, False)]) == (None, 0)


@pytest.fixture(scope="module")
def judge_of(tiny_model_dir):
    from align.judge import load

    return load(str(tiny_model_dir))


@pytest.fixture(scope="module")
def pairwise(tiny_model_dir, tmp_path_factory):
    """Two samples of 12 prompts from the tiny model, ranked by the tiny model as judge, every verdict kept."""
    tmp = tmp_path_factory.mktemp("pairwise")
    return make(tmp / "pairs.jsonl", from_model=str(tiny_model_dir), judge=str(tiny_model_dir),
                data=str(prompts_file(tmp)), samples=2, judge_margin=0.0) + (tmp,)


def test_pairwise_chosen_is_the_side_the_judge_prefers_in_both_orders(pairwise, judge_of, shipped_tokenizer):
    summary, pairs, _ = pairwise
    assert summary["ranker"] == "judge, pairwise" and "judge_agreement" not in summary  # no answers: no verifier
    assert len(pairs) == summary["prompts_with_pairs"] == 12 - summary["identical_samples"] >= 10
    assert all(set(p) == {"prompt", "chosen", "rejected", "judge_prob", "judge_margin"} for p in pairs)
    prompts, chosen, rejected = ([p[k] for p in pairs] for k in ("prompt", "chosen", "rejected"))
    p_cr, p_rc = judge_of.preferences(prompts, chosen, rejected), judge_of.preferences(prompts, rejected, chosen)
    assert all(p > 0.5 for p in p_cr)  # the chosen side is the preferred one ...
    assert p_cr == pytest.approx([p["judge_prob"] for p in pairs], abs=1e-5)  # ... with the judge's probability
    assert [2 * p - 1 for p in p_cr] == pytest.approx([p["judge_margin"] for p in pairs], abs=2e-5)
    assert [a + b for a, b in zip(p_cr, p_rc)] == pytest.approx([1.0] * len(pairs), abs=1e-5)
    # readable as `align rm train` / `align dpo` data; judge_margin is not the RM loss's `margin` column
    from align import data as D

    examples, report = D.preference_examples(shipped_tokenizer, D.load_rows(pairwise[2] / "pairs.jsonl",
                                                                             "preference"), 512)
    assert report["kept"] + report["dropped_empty"] == len(pairs) and report["kept"] >= len(pairs) - 1
    assert all(e["margin"] == 0.0 for e in examples)


def test_pairs_closer_than_the_margin_are_dropped(pairwise, tiny_model_dir):
    """The same samples with --judge-margin at the median margin: exactly the pairs at or above it are kept."""
    summary, pairs, tmp = pairwise
    m = sorted(p["judge_margin"] for p in pairs)[len(pairs) // 2]
    above = [p for p in pairs if p["judge_margin"] >= m]
    got, kept = make(tmp / "margin.jsonl", from_model=str(tiny_model_dir), judge=str(tiny_model_dir),
                     data=str(tmp / "prompts.jsonl"), samples=2, judge_margin=m)
    assert 0 < len(kept) == len(above) < len(pairs)
    assert [(p["prompt"], p["chosen"], p["rejected"]) for p in kept] == [
        (p["prompt"], p["chosen"], p["rejected"]) for p in above]
    assert got["judge_ties"] == len(pairs) - len(above) and got["judge_ranked"] == len(pairs)
    with pytest.raises(UserError, match=r"only 0 of 12 prompts had two samples the judge separated by "
                                        r"--judge-margin 1.0 or more \(\d+ ties dropped.*Lower --judge-margin"):
        make(tmp / "none.jsonl", from_model=str(tiny_model_dir), judge=str(tiny_model_dir),
             data=str(tmp / "prompts.jsonl"), samples=2, judge_margin=1.0)


def test_pointwise_scores_the_best_against_the_worst(tiny_model_dir, judge_of, tmp_path):
    """More than two samples: each one's expected score; the best against the --pairs-per-prompt worst."""
    texts = ["1 2 3", "0 1 2 3", "3 2 1", "banana", "1 2"]
    prompt = "Sort in ascending order: 3 1 2 0"
    scores = judge_of.scores([prompt] * len(texts), texts)
    (got,), counts = judge_pairs(judge_of, [prompt], [texts + ["1 2"]], k=2)  # a repeated text counts once
    order = sorted(range(len(texts)), key=lambda i: -scores[i])
    assert [(p["chosen"], p["rejected"]) for p in got] == [(texts[order[0]], texts[order[-1]]),
                                                           (texts[order[0]], texts[order[-2]])]
    assert [p["judge_margin"] for p in got] == pytest.approx(
        [scores[order[0]] - scores[order[-1]], scores[order[0]] - scores[order[-2]]], abs=1e-6)
    assert not counts["pairwise"] and counts["ranked"] == 2
    summary, pairs = make(tmp_path / "pw.jsonl", from_model=str(tiny_model_dir), judge=str(tiny_model_dir),
                          data=str(prompts_file(tmp_path, n=6)), samples=4, pairs_per_prompt=2, judge_margin=0.0)
    assert summary["ranker"] == "judge, pointwise" and len(pairs) > 6
    for p in pairs:
        c, r = judge_of.scores([p["prompt"]] * 2, [p["chosen"], p["rejected"]])
        assert (c, r) == pytest.approx((p["judge_chosen"], p["judge_rejected"]), abs=1e-5)
        assert p["judge_margin"] == pytest.approx(p["judge_chosen"] - p["judge_rejected"]) and p["judge_margin"] > 0


class PositionBiased(Judge):
    """A toy judge through the real Judge's rubric, both orders and verdict: it writes A with logit `bias` more
    than B whatever it reads, plus `per_char` per character of each answer (a taste for the longer one)."""

    def __init__(self, tok, bias: float, per_char: float):
        super().__init__(torch.nn.Linear(1, 1), tok, pair_rubric=RUBRIC_FILE.read_text())
        self.bias, self.per_char = bias, per_char

    def next_token_logits(self, texts):
        z = torch.zeros(len(texts), len(self.tok))
        for i, t in enumerate(texts):
            a, b = re.search(r"\nA: (.*)\nB: (.*)\nWhich answer", t, re.S).groups()
            z[i, self.pair_ids[0]] = self.bias + self.per_char * len(a)
            z[i, self.pair_ids[1]] = self.per_char * len(b)
        return z


def test_both_orders_cancel_a_judge_s_position_bias(shipped_tokenizer):
    prompts = ["Sort in ascending order: 3 1 2", "Sort in ascending order: 2 1"]
    blind = PositionBiased(shipped_tokenizer, bias=4.0, per_char=0.0)
    one_order = first_preferred(blind.next_token_logits([blind.text(fill(blind.pair_rubric, prompt=prompts[0],
                                                                          a="1 2", b="1 2 3"))]), *blind.pair_ids)
    assert one_order.item() == pytest.approx(sigmoid(4.0))  # asked once, it would pick the first answer
    kept, counts = judge_pairs(blind, prompts, [["1 2", "1 2 3"], ["1 2", "2 1"]], min_margin=0.0)
    assert kept == [[], []] and counts["ties"] == 2  # asked both ways: no preference at all
    tasteful = PositionBiased(shipped_tokenizer, bias=4.0, per_char=1.0)
    kept, _ = judge_pairs(tasteful, prompts, [["1 2", "1 2 3"], ["1 2 3", "1 2"]])
    p = 0.5 * (sigmoid(4.0 + 2) + 1 - sigmoid(4.0 - 2))  # P(longer > shorter), Δ = 2 characters
    for (pair,) in kept:  # the longer list in either position, not the first one
        assert (pair["chosen"], pair["rejected"]) == ("1 2 3", "1 2")
        assert (pair["judge_prob"], pair["judge_margin"]) == pytest.approx((p, 2 * p - 1))


EVEN = '''
def first_char_even(prompt, completion, **row):
    return float(bool(completion) and ord(completion[0]) % 2 == 0)
'''


def test_the_verifier_only_measures_the_judge(tmp_path, tiny_model_dir, shipped_tokenizer, monkeypatch):
    """With answers in --data the verifier grades the samples, and data make reports how often the judge's
    chosen side is the right one where they differ; the pairs are the judge's (the longer answer, here), with
    every pair under the margin dropped."""
    from align import judge as J

    toy = PositionBiased(shipped_tokenizer, bias=3.0, per_char=0.5)
    monkeypatch.setattr(J, "load", lambda model, **kw: toy)
    (tmp_path / "v.py").write_text(EVEN)
    summary, pairs = make(tmp_path / "pairs.jsonl", from_model=str(tiny_model_dir), judge="tiny", samples=2,
                          data=str(prompts_file(tmp_path, n=24, answers=True)), judge_margin=0.3,
                          verifier=f"{tmp_path / 'v.py'}:first_char_even")
    for p in pairs:  # the longer answer, by 5 characters or more: σ(3 + Δ/2) − σ(3 − Δ/2) ≥ 0.3 from Δ = 5
        d = len(p["chosen"]) - len(p["rejected"])
        assert d >= 5 and set(p) >= {"answer", "judge_prob"}
        assert p["judge_margin"] == pytest.approx(sigmoid(3 + d / 2) - sigmoid(3 - d / 2), abs=1e-6)
    assert summary["judge_ties"] == summary["judge_ranked"] - len(pairs) > 0
    right = [(ord(p["chosen"][0]) % 2 == 0, bool(p["rejected"]) and ord(p["rejected"][0]) % 2 == 0) for p in pairs]
    split = [c for c, r in right if c != r]
    assert summary["judge_agreement_pairs"] == len(split) > 0
    assert summary["judge_agreement"] == pytest.approx(sum(split) / len(split), abs=1e-4)
    # as an artifact (a pipeline's data stage): the judge is an input, the ranker; the verifier says its role
    art = tmp_path / "art"
    run(DataMakeConfig(task="prefs", out=str(art), max_new_tokens=6, seed=1, from_model=str(tiny_model_dir),
                       judge="tiny", samples=2, data=str(tmp_path / "verifiable.jsonl"), judge_margin=0.3,
                       verifier=f"{tmp_path / 'v.py'}:first_char_even"))
    record = json.loads((art / "artifact.json").read_text())
    assert record["inputs"]["judge"] == {"spec": "tiny"} and record["ranker"]["form"] == "pairwise"
    assert record["verifier"]["role"].startswith("measures") and _read(art / "data.jsonl") == pairs


def test_chat_template_renders_the_sampled_prompts(pairwise, tiny_model_dir):
    """--chat-template: the tokenizer's own template gives the same samples; another one other samples."""
    _, pairs, tmp = pairwise
    common = dict(from_model=str(tiny_model_dir), judge=str(tiny_model_dir), data=str(tmp / "prompts.jsonl"),
                  samples=2, judge_margin=0.0)
    own = ROOT / "data/tokenizer/chat_template.jinja"
    _, same = make(tmp / "own.jsonl", chat_template=str(own), **common)
    other = tmp / "other.jinja"
    other.write_text(own.read_text().replace("<|user|>", "User: "))
    _, changed = make(tmp / "other.jsonl", chat_template=str(other), **common)
    key = lambda rows: [(p["chosen"], p["rejected"]) for p in rows]
    assert key(same) == key(pairs) and key(changed) != key(pairs)


def test_judge_options_are_refused_with_the_flag_that_is_wrong(tmp_path, tiny_model_dir):
    proc = run_align("data", "make", "prefs", "--judge", tiny_model_dir, "--out", tmp_path / "x.jsonl")
    assert_user_error(proc, "--judge ranks the samples of --from-model")
    base = dict(task="prefs", from_model=str(tiny_model_dir), data="d.jsonl", judge=str(tiny_model_dir),
                out=str(tmp_path / "x.jsonl"))
    rubric = tmp_path / "r.txt"
    rubric.write_text("Rate it: {prompt} {completion}\n")
    for options, message, flag in [
        (dict(judge=""), "--judge-rubric goes with --judge", "judge_rubric"),
        (dict(max_samples=16), "--max-samples samples again", "max_samples"),
        (dict(pair_by="length"), "--pair-by length pairs right answers", "pair_by"),
        (dict(samples=2, pairs_per_prompt=2), "--pairs-per-prompt 2: two --samples make one pair", "pairs_per_prompt"),
        (dict(samples=2), r"--judge-rubric .*r.txt: it has no \{a\} or \{b\}", "judge_rubric"),
    ]:
        with pytest.raises(UserError, match=message) as e:
            DataMakeConfig(**{**base, "judge_rubric": str(rubric), **options}).validate()
        assert e.value.option == flag
    DataMakeConfig(**base, judge_rubric=str(rubric), samples=4).validate()  # a pointwise rubric for 4 samples
    with pytest.raises(UserError, match="--judge-margin goes with --judge"):
        DataMakeConfig(task="prefs", judge_margin=0.3).validate()
    with pytest.raises(UserError, match="--chat-template is --from-model's"):
        DataMakeConfig(task="prefs", chat_template=str(rubric)).validate()
    data = prompts_file(tmp_path, n=2)
    with pytest.raises(UserError, match=r"^--judge \S*nope: no such model"):
        run(DataMakeConfig(**{**base, "data": str(data), "judge": str(tmp_path / "nope"), "samples": 2}))
    with pytest.raises(UserError, match="--verifier exact: with --judge the verifier only measures"):
        run(DataMakeConfig(**{**base, "data": str(data), "verifier": "exact", "samples": 2}))


def test_a_rubric_the_judge_cannot_answer_is_refused_before_any_sampling(tmp_path, tiny_model_dir):
    """A judge without a chat template reads the rubric as plain text: one ending in a space merges with the label
    (" A" is one token), refused on the judge's tokenizer before --from-model (here no model at all) is read."""
    import shutil

    plain = tmp_path / "plain_judge"
    shutil.copytree(tiny_model_dir, plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    rubric = tmp_path / "r.txt"
    rubric.write_text("{prompt}\nA: {a}\nB: {b}\nBetter: ")
    cfg = DataMakeConfig(task="prefs", from_model=str(tmp_path / "no-model"), data=str(prompts_file(tmp_path, n=2)),
                         judge=str(plain), judge_rubric=str(rubric), samples=2, out=str(tmp_path / "x.jsonl"))
    cfg.validate()
    with pytest.raises(UserError, match=r"^--judge \S*plain_judge: the score label 'A' is not one token"):
        run(cfg)


def test_judge_demonstrations_ask_each_pair_both_ways(tmp_path, tiny_model_dir, shipped_tokenizer):
    """`align data make judge`: each pair twice, the chosen side once as A and once as B, the letter as the
    completion; the held-out prompts' pairs apart; the judge reading that rubric writes one token there."""
    from align import data as D

    src = tmp_path / "pairs.jsonl"
    src.write_text("".join((ROOT / "data/digit_sort/prefs.jsonl").read_text().splitlines(keepends=True)[:20]))
    pairs = _read(src)
    out = tmp_path / "judge.jsonl"
    cfg = DataMakeConfig(task="judge", data=str(src), judge_rubric=str(RUBRIC_FILE), n=0, test_n=4, out=str(out))
    cfg.validate()
    summary = run(cfg)
    rows, test = D.load_rows(out, "sft"), _read(summary["test_out"])
    assert (summary["pairs"], len(rows), len(test)) == (20, 32, 8)
    rubric = RUBRIC_FILE.read_text()
    want = {(fill(rubric, prompt=p["prompt"], a=p["chosen"], b=p["rejected"]), "A") for p in pairs} | {
        (fill(rubric, prompt=p["prompt"], a=p["rejected"], b=p["chosen"]), "B") for p in pairs}
    got = {(r["prompt"], r["completion"]) for r in rows + test}
    assert got == want and all(r["answer"] == r["completion"] for r in rows + test)
    held = {p["prompt"] for p in pairs[-4:]}
    assert all(any(h in r["prompt"] for h in held) for r in test)
    assert not any(h + "\n" in r["prompt"] for h in held for r in rows)
    Judge(torch.nn.Linear(1, 1), shipped_tokenizer, pair_rubric=rubric)  # "A" / "B": one token after the rubric
    default = run(DataMakeConfig(task="judge", data=str(src), n=3, out=str(tmp_path / "d.jsonl")))
    assert default["rows"] == 6 and _read(tmp_path / "d.jsonl")[0]["prompt"].startswith(PAIR_RUBRIC[:40])


def test_the_rlaif_pipeline_parses_and_its_stages_chain(tmp_path):
    """pipelines/rlaif.toml: the judge's pairs feed the reward model, the reward model PPO; the judge is a stage's
    artifact; the reward model is held out on the verifier's pairs; every stage would run on a fresh out."""
    from align import pipeline as P

    path = ROOT / "pipelines/rlaif.toml"
    p = P.load(path, [f"pipeline.out={tmp_path}"])
    assert [(s.name, s.kind) for s in p.stages] == [
        ("base", "model-init"), ("sft", "sft"), ("judge_data", "data"), ("judge", "sft"), ("pairs_self", "data"),
        ("rm_self", "rm"), ("pairs", "data"), ("rm", "rm"), ("ppo", "ppo")]
    cfg = {s.name: P.resolve(p, s) for s in p.stages}
    out = lambda name: str(tmp_path / name)
    assert cfg["judge_data"]["task"] == "judge" and cfg["judge"]["data"] == out("judge_data")
    assert cfg["judge"]["model"] == out("sft")
    assert (cfg["pairs"]["from_model"], cfg["pairs"]["judge"]) == (out("sft"), out("judge"))
    assert (cfg["pairs_self"]["from_model"], cfg["pairs_self"]["judge"]) == (out("sft"), out("sft"))
    assert {cfg[s]["judge_rubric"] for s in ("judge_data", "pairs", "pairs_self")} == {str(RUBRIC_FILE)}
    assert cfg["pairs"]["samples"] == 2 and cfg["pairs"]["judge_margin"] == 0.1  # the default margin
    assert (cfg["rm"]["data"], cfg["rm_self"]["data"]) == (out("pairs"), out("pairs_self"))
    shipped = ROOT / "data/digit_sort/prefs_test.jsonl"
    assert Path(cfg["rm"]["eval_data"]).resolve() == Path(cfg["rm_self"]["eval_data"]).resolve() == shipped
    assert (cfg["ppo"]["model"], cfg["ppo"]["reward_model"], cfg["ppo"]["gold_reward"]) == (
        out("sft"), out("rm"), "exact")
    _, problems = P.parse(path, ["stages.pairs.judge=tiny"])  # a preset judges too
    assert not problems
    results = P.run(path, dry_run=True, overrides=[f"pipeline.out={tmp_path}"])
    assert {r.status for r in results} == {"would run"} and len(results) == 9
