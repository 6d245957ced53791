"""A judge reward trains the tiny model toward what the rubric asks.

Two judges of the tiny architecture are trained here (a plain torch loop, a few seconds on one core) on completions
the tiny policy samples, half of them with a digit or three written in: one reads the rubric "Digit?" and puts its
mass on 9 when the completion holds a digit, on 0 when it holds none; the other reads the inverted rubric "No
digit?" and answers the other way. GRPO on the tiny policy with `--reward judge:JUDGE --judge-rubric RUBRIC` then
raises the share of its completions that hold a digit from about one in five to nearly all of them in 10 steps
with the first judge (0.19 -> 0.97 over the last 3 steps), and lowers it with the second (0.19 -> 0.03). A
verifier weighted 0 (`--reward digits.py:has_digit:0`) logs that share every step without training on it: the gold
reward RLMonitor sets beside the judge's score, the proxy. The held-out greedy answers carry the judge's score in
eval_samples.jsonl. About 40 s on one core.
"""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest
import torch

from align.chat import prompt_text
from align.data import pad
from align.judge import Judge, fill
from tests.conftest import run_align, small_data

RUBRICS = {"digit": "Digit?\n{completion}\n", "no_digit": "No digit?\n{completion}\n"}
VERIFIER = "import re\n\ndef has_digit(prompt, completion, **row):\n    return float(bool(re.search(r'\\d', completion)))\n"
NEW_TOKENS = 12


def has_digit(text: str) -> bool:
    return bool(re.search(r"\d", text))


def policy_samples(model_dir: Path, n: int, seed: int) -> list[list[int]]:
    """n completions of the tiny policy at T 1 (NEW_TOKENS tokens each) of the GRPO run's prompts, as token ids."""
    from align.models import load_causal_lm, load_tokenizer, resolve

    source = resolve(str(model_dir))
    tok = load_tokenizer(source)
    model = load_causal_lm(source, tok, torch.float32, seed=0).eval()
    prompts = [json.loads(x)["prompt"] for x in Path(small_data()["arith"]).read_text().splitlines()[:16]]
    out = []
    torch.manual_seed(seed)
    for p in prompts:
        ids = tok(prompt_text(tok, p), add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            got = model.generate(torch.tensor([ids] * (n // len(prompts))), do_sample=True, temperature=1.0, top_k=0,
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=tok.pad_token_id)
        out += [g[len(ids):].tolist() for g in got]
    return out


def train_judge(tok, texts: list[str], rubric: str, wants_digit: bool, out: Path, steps: int = 80) -> Path:
    """The tiny architecture (seed 1) trained to answer 9 where the completion holds a digit (`wants_digit`; else
    where it holds none) and 0 otherwise, after `rubric` filled with it as Judge reads it; saved in `out`."""
    from align.models import load_causal_lm, resolve

    model = load_causal_lm(resolve("tiny"), tok, torch.float32, seed=1)
    judge = Judge(model, tok, rubric=rubric)
    nine, zero = judge.score_ids[9], judge.score_ids[0]
    examples = [(tok(judge.text(fill(rubric, completion=t)), add_special_tokens=False)["input_ids"],
                 nine if has_digit(t) == wants_digit else zero) for t in texts]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rng = random.Random(0)
    model.train()
    for _ in range(steps):
        batch = rng.sample(examples, 32)
        x = torch.tensor(pad([e[0] for e in batch], tok.pad_token_id, side="left"))
        mask = torch.tensor(pad([[1] * len(e[0]) for e in batch], 0, side="left"))
        logits = model(input_ids=x, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                       logits_to_keep=1).logits[:, -1]
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor([e[1] for e in batch]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def judges(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    """{rubric name: a judge trained on it}; each judge right on at least 9 in 10 fresh samples of the policy."""
    from align.models import load_causal_lm, load_tokenizer, resolve

    tok = load_tokenizer(resolve(str(tiny_model_dir)))
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    rng = random.Random(0)
    texts = []
    for ids in policy_samples(tiny_model_dir, 512, seed=0):  # half with 1-3 digits written in: both kinds plenty
        if rng.random() < 0.5:
            for _ in range(rng.randint(1, 3)):
                ids[rng.randrange(len(ids))] = rng.choice(digits)
        texts.append(tok.decode(ids, skip_special_tokens=True))
    root = tmp_path_factory.mktemp("judges")
    out = {name: train_judge(tok, texts, rubric, name == "digit", root / name) for name, rubric in RUBRICS.items()}
    fresh = [tok.decode(ids, skip_special_tokens=True) for ids in policy_samples(tiny_model_dir, 128, seed=1)]
    assert 0.1 < sum(map(has_digit, fresh)) / len(fresh) < 0.4  # the policy's own share of digits
    for name, rubric in RUBRICS.items():
        judge = Judge(load_causal_lm(resolve(str(out[name])), tok, torch.float32).eval(), tok, rubric=rubric)
        right = [(s > 0.5) == (has_digit(t) == (name == "digit")) for s, t in zip(judge.scores([""] * 128, fresh), fresh)]
        assert sum(right) / len(right) >= 0.9, name
    return out


def grpo(root: Path, tiny_model_dir: Path, judge: Path, rubric: str) -> Path:
    """10 GRPO steps of the tiny policy on the judge's score alone (8 prompts x 8 samples a step), the digit
    verifier weighted 0; held-out greedy answers of 4 problems at the start and the end."""
    root.mkdir()
    (root / "rubric.txt").write_text(rubric)
    (root / "digits.py").write_text(VERIFIER)
    out = root / "grpo"
    proc = run_align("grpo", "--model", tiny_model_dir, "--data", small_data()["arith"], "--eval-data",
                     small_data()["arith_test"], "--eval-samples", "4", "--eval-k", "1", "--reward", f"judge:{judge}",
                     "--judge-rubric", root / "rubric.txt", "--reward", f"{root / 'digits.py'}:has_digit:0",
                     "--max-steps", "10", "--prompts-per-step", "8", "--num-generations", "8", "--max-new-tokens",
                     str(NEW_TOKENS), "--lr", "5e-3", "--warmup-steps", "0", "--out", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir, judges) -> dict[str, Path]:
    """{rubric name: the GRPO run on its judge}."""
    root = tmp_path_factory.mktemp("grpo_judged")
    return {name: grpo(root / name, tiny_model_dir, judges[name], rubric) for name, rubric in RUBRICS.items()}


def steps(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward" in r]


def test_a_judge_reward_trains_the_policy_toward_what_its_rubric_asks(runs):
    rows = {name: steps(out) for name, out in runs.items()}
    share = {name: [r["gold_reward"] for r in rs] for name, rs in rows.items()}  # completions with a digit
    for rs in rows.values():
        assert len(rs) == 10
        for r in rs:  # the judge is the proxy, the verifier the gold: each its own reward's mean
            assert r["proxy_reward"] == pytest.approx(r["rewards/judge"]) == pytest.approx(r["reward"])
            assert r["gold_reward"] == pytest.approx(r["rewards/digits.has_digit"])
    for name in RUBRICS:  # the same policy and seed: the same first rollout, about one completion in five
        assert 0.05 < share[name][0] < 0.4, share
    asks, inverted = share["digit"], share["no_digit"]
    assert sum(asks[-3:]) / 3 > max(0.6, asks[0] + 0.4), share  # 64 samples a step: 0.4 is ~8 standard errors
    assert sum(inverted[-3:]) / 3 < inverted[0] + 0.05, share


def test_held_out_answers_carry_the_judge_score(runs, judges):
    """eval_samples.jsonl: each greedy answer's "judge" is the judge's score of it, computed apart (its prompt
    unused by this rubric); eval/reward is their mean, eval/kl 0 before training and NaN after (--beta 0: no
    reference, no KL)."""
    from align.models import load_causal_lm, load_tokenizer, resolve

    source = resolve(str(judges["digit"]))
    tok = load_tokenizer(source)
    judge = Judge(load_causal_lm(source, tok, torch.float32).eval(), tok, rubric=RUBRICS["digit"])
    records = [json.loads(x) for x in (runs["digit"] / "eval_samples.jsonl").read_text().splitlines()]
    assert len(records) == 4 and {r["step"] for r in records} == {10}
    want = [judge.scores([""], [r["greedy"]])[0] for r in records]
    assert [r["judge"] for r in records] == pytest.approx(want, abs=1e-5)
    evals = [r for r in map(json.loads, (runs["digit"] / "metrics.jsonl").read_text().splitlines())
             if "eval/reward" in r]
    assert [r["step"] for r in evals] == [0, 10] and evals[-1]["eval/reward"] == pytest.approx(sum(want) / 4, abs=1e-5)
    assert evals[0]["eval/kl"] == 0.0 and math.isnan(evals[-1]["eval/kl"])
