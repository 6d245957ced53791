"""An LLM judge in PPO (--judge, beside or instead of the reward model) and in online DPO (--online --judge), pinned
by values on the tiny models: the stage built in this process, its scores and pairs compared with the judge's
verdicts computed apart (align.judge.Judge on a fresh copy of the judge model). And the options' checks."""

from __future__ import annotations

import json

import pytest
import torch

from align.errors import UserError
from align.judge import PAIR_RUBRIC, RUBRIC, Judge
from align.rollout.batch import Rollout
from align.rollout.generation import Completion
from stages.dpo import DPOConfig, OnlineDPO
from stages.grpo import GRPOConfig
from stages.ppo import PPO, PPOConfig
from tests.conftest import assert_user_error, run_align, small_data, stage_in_process

PPO_BASE = dict(zero_stage=0, compile=False, eval_data="", ptx_coef=0.0, prompts_per_step=4, minibatch_size=4,
                micro_batch_size=2, ppo_epochs=1, max_new_tokens=6, schedule="constant", warmup_steps=0, seed=0)
TEXTS = ["12", "It is 12, since 7 + 5 = 12.", "hello there", "5"]


@pytest.fixture(autouse=True)
def single_process_env(single_process):
    """Every test here builds engines in this process (tests/conftest.py)."""


def judge_apart(path, rubric: str = RUBRIC, pair_rubric: str = PAIR_RUBRIC) -> Judge:
    from align.models import load_causal_lm, load_tokenizer, resolve

    source = resolve(str(path))
    tok = load_tokenizer(source)
    return Judge(load_causal_lm(source, tok, torch.float32).eval(), tok, rubric, pair_rubric)


def episodes(algo, n: int = 4) -> Rollout:
    """n episodes of the first n prompts, each response TEXTS[i] (its tokens, then EOS)."""
    comps = [Completion(algo.prompt_ids[i], algo.tok.encode(TEXTS[i], add_special_tokens=False) +
                        [algo.tok.eos_token_id], TEXTS[i], True) for i in range(n)]
    return Rollout(algo.rows[:n], comps, 1)


def ppo(tmp_path, name: str, **kw):
    cfg = PPOConfig(data=str(small_data()["arith"]), out=str(tmp_path / name), **{**PPO_BASE, **kw})
    return stage_in_process(cfg, "ppo", PPO)


def test_ppo_judge_score_times_its_coef_is_added_to_the_reward_models(tmp_path, tiny_model_dir, other_model_dir,
                                                                       tiny_reward_model_dir):
    """--judge J --judge-coef 0.5 --judge-rubric R beside --reward-model: the proxy PPO trains on is the RM's
    normalised score + 0.5 x J's expected score of each episode (prompt, response text) through R; the step logs
    rewards/judge, J's mean; the RM alone gives the RM's scores."""
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("Is the answer short?\n{prompt}\n{completion}\nOne digit:\n")
    with ppo(tmp_path, "rm", model=str(tiny_model_dir), reward_model=str(tiny_reward_model_dir)) as algo:
        rm_only, _, _ = algo.scores(episodes(algo))
    with ppo(tmp_path, "both", model=str(tiny_model_dir), reward_model=str(tiny_reward_model_dir),
             judge=str(other_model_dir), judge_coef=0.5, judge_rubric=str(rubric)) as algo:
        r = episodes(algo)
        proxy, _, gold = algo.scores(r)
        prompts = [row["prompt"] for row in r.sample_rows]
    want = judge_apart(other_model_dir, rubric.read_text()).scores(prompts, TEXTS)
    assert r.parts["judge"] == pytest.approx(want, abs=1e-5)
    assert max(want) - min(want) > 1e-3  # episodes the judge tells apart: a score from the wrong rubric shows
    torch.testing.assert_close(proxy, rm_only + 0.5 * torch.tensor(want), rtol=0, atol=1e-5)


def test_ppo_on_the_judge_alone_starts_its_value_network_from_the_policy(tmp_path, tiny_model_dir, other_model_dir):
    """--reward-model '' --judge J --judge-coef 2: the score is 2 x J's alone; the value network is the policy's
    body with a new scalar head (its transformer's weights the policy's); each held-out greedy answer carries J's
    score in eval_samples.jsonl ("judge", no "rm_score") and eval/reward is 2 x their mean; the artifact names the
    judge."""
    from safetensors.torch import load_file

    with ppo(tmp_path, "judge", model=str(tiny_model_dir), reward_model="", judge=str(other_model_dir),
             judge_coef=2.0, eval_data=str(small_data()["arith_test"]), eval_samples=3) as algo:
        assert algo.rm is None
        r = episodes(algo)
        proxy, _, _ = algo.scores(r)
        prompts = [row["prompt"] for row in r.sample_rows]
        policy = load_file(tiny_model_dir / "model.safetensors")
        value = dict(algo.value.module.named_parameters())
        body = {k: v for k, v in value.items() if not k.startswith("score.")}
        assert len(body) == len([k for k in policy if not k.startswith("lm_head")]) and "score.weight" in value
        for k, v in body.items():
            torch.testing.assert_close(v.detach(), policy[k], rtol=0, atol=0)
        metrics = algo.evaluate(1)
    judge = judge_apart(other_model_dir)
    torch.testing.assert_close(proxy, 2.0 * torch.tensor(judge.scores(prompts, TEXTS)), rtol=0, atol=1e-5)
    records = [json.loads(x) for x in (tmp_path / "judge" / "eval_samples.jsonl").read_text().splitlines()]
    want = judge.scores([x["prompt"] for x in records], [x["greedy"] for x in records])
    assert len(records) == 3 and [x["judge"] for x in records] == pytest.approx(want, abs=1e-5)
    assert "rm_score" not in records[0] and metrics["eval/reward"] == pytest.approx(2.0 * sum(want) / 3, abs=1e-5)
    art = json.loads((tmp_path / "judge" / "artifact.json").read_text())
    assert art["inputs"]["judge"]["spec"] == str(other_model_dir) and "reward_model" not in art["inputs"]


def test_grpo_judge_reward_reads_its_rubric_and_is_the_proxy_beside_a_verifier(tmp_path, tiny_model_dir,
                                                                               other_model_dir):
    """--reward judge:J --judge-rubric R --reward math:0: each sample's reward is J's expected score through R
    (computed apart; the verifier weighs 0), logged as rewards/judge; RLMonitor's proxy is that score and its gold
    the verifier's (1 for the right answer); the artifact names the judge."""
    from stages.grpo import GRPO

    rubric = tmp_path / "rubric.txt"
    rubric.write_text("Is the answer right?\n{prompt}\n{completion}\nOne digit:\n")
    cfg = GRPOConfig(model=str(tiny_model_dir), out=str(tmp_path / "g"), eval_data="", data=str(small_data()["arith"]),
                     reward=[f"judge:{other_model_dir}", "math:0"], judge_rubric=str(rubric), prompts_per_step=2,
                     num_generations=2, max_new_tokens=4, micro_batch_size=4, zero_stage=0)
    with stage_in_process(cfg, "grpo", GRPO) as algo:
        rows, eos = algo.rows[:2], algo.tok.eos_token_id
        texts = [f"#### {rows[0]['answer']}", "#### 7", f"It is {rows[1]['answer']}.", "no idea"]
        r = Rollout(rows, [Completion(algo.prompt_ids[i // 2], algo.tok.encode(t, add_special_tokens=False) + [eos],
                                      t, True) for i, t in enumerate(texts)], 2)
        algo.score(r)
    want = judge_apart(other_model_dir, rubric.read_text()).scores([rows[i // 2]["prompt"] for i in range(4)], texts)
    assert max(want) - min(want) > 1e-3 and r.rewards.flatten().tolist() == pytest.approx(want, abs=1e-5)
    assert r.parts["judge"] == pytest.approx(want, abs=1e-5)
    assert r.watched["proxy_reward"] == pytest.approx(want, abs=1e-5)
    assert r.watched["gold_reward"] == [1.0, 0.0, 1.0, 0.0] and rows[0]["answer"] != "7"
    art = json.loads((tmp_path / "g" / "artifact.json").read_text())
    assert art["inputs"]["judge"]["spec"] == str(other_model_dir)


def online_dpo(tmp_path, model, judge, samples: int, **kw):
    from align.engine.run import StageRun

    tmp_path.mkdir(exist_ok=True)
    prompts = tmp_path / "prompts.jsonl"  # prompts only: a judge needs no answer
    prompts.write_text("".join(json.dumps({"prompt": f"Say something about the number {n}."}) + "\n"
                               for n in range(6)))
    cfg = DPOConfig(model=str(model), online=True, judge=str(judge), data=str(prompts), eval_data="", pass_data="",
                    batch_size=6, max_new_tokens=8, online_samples=samples, max_steps=1, out=str(tmp_path / "od"),
                    **kw)
    cfg.validate()
    return cfg, StageRun(cfg, "dpo")


def sampled_pairs(tmp_path, model, judge, samples: int, **kw):
    """(the window's pairs and weights, each prompt's K sample texts, the prompts) of online DPO's first step."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    cfg, run = online_dpo(tmp_path, model, judge, samples, **kw)
    with run:
        algo = OnlineDPO(cfg, run)
        idx = run.indices(len(algo.rows), cfg.batch_size, 0)
        seen = []
        rank = algo.rank
        algo.rank = lambda rows, done: seen.append(done) or rank(rows, done)
        algo.sample_window(0)
        tok = algo.tok
    unset_hf_deepspeed_config()
    pairs, weights, _ = algo.buffer[0]
    texts = [[c.text for c in seen[0][j * samples:(j + 1) * samples]] for j in range(len(idx))]
    ids = [[c.ids for c in seen[0][j * samples:(j + 1) * samples]] for j in range(len(idx))]
    return pairs, weights, texts, ids, [algo.rows[i]["prompt"] for i in idx], tok


def test_online_dpo_two_samples_are_ranked_by_the_judge_in_both_orders(tmp_path, tiny_model_dir, other_model_dir):
    """--online-samples 2: chosen is the sample the judge prefers, asked A/B and B/A (Judge.preferences, computed
    apart), rejected the other. At --temperature 1e-4 the two samples of a prompt are one text: the judge's
    verdict is even (within judge_pairs.TIE) and the slot weighs 0."""
    pairs, weights, texts, ids, prompts, tok = sampled_pairs(tmp_path / "t1", tiny_model_dir, other_model_dir, 2)
    judge = judge_apart(other_model_dir)
    p = judge.preferences(prompts, [t[0] for t in texts], [t[1] for t in texts])
    for j, pair in enumerate(pairs):
        first = p[j] > 0.5
        assert pair["chosen_ids"] == ids[j][0 if first else 1] and pair["rejected_ids"] == ids[j][1 if first else 0]
    assert {p_ > 0.5 for p_ in p} == {True, False}  # both positions win somewhere: only the verdicts can pick
    assert weights.tolist() == [1.0] * 6 and min(abs(p_ - 0.5) for p_ in p) > 1e-6
    pairs, weights, texts, *_ = sampled_pairs(tmp_path / "greedy", tiny_model_dir, other_model_dir, 2,
                                              temperature=1e-4)
    assert all(a == b for a, b in texts) and weights.tolist() == [0.0] * 6


def test_online_dpo_more_samples_are_ranked_by_the_judges_expected_score(tmp_path, tiny_model_dir, other_model_dir):
    """--online-samples 3 and a --judge-rubric: chosen is the sample of highest expected score through that rubric
    (Judge.scores, computed apart), rejected the lowest."""
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("Rate it.\n{completion}\nOne digit:\n")
    pairs, weights, texts, ids, prompts, tok = sampled_pairs(tmp_path, tiny_model_dir, other_model_dir, 3,
                                                             judge_rubric=str(rubric))
    judge = judge_apart(other_model_dir, rubric.read_text())
    for j, pair in enumerate(pairs):
        s = judge.scores([prompts[j]] * 3, texts[j])
        assert pair["chosen_ids"] == ids[j][max(range(3), key=s.__getitem__)]
        assert pair["rejected_ids"] == ids[j][min(range(3), key=s.__getitem__)]
        assert weights[j] == 1.0 and max(s) - min(s) > 1e-6


def test_judge_options_are_checked_before_a_run(tmp_path, tiny_model_dir):
    pair = tmp_path / "pair.txt"
    pair.write_text("Which is better?\n{prompt}\n{completion}\nA or B:\n")
    bad = [(PPOConfig, {"reward_model": "", "model": "tiny"}, "--reward-model '' leaves PPO nothing"),
           (PPOConfig, {"judge_rubric": str(pair), "model": "tiny"}, "--judge-rubric goes with --judge"),
           (PPOConfig, {"judge_coef": 0.5, "model": "tiny"}, "--judge-coef goes with --judge"),
           (GRPOConfig, {"judge_rubric": str(pair), "model": "tiny"}, "--judge-rubric goes with --reward judge:MODEL"),
           (DPOConfig, {"judge": "tiny"}, "--judge ranks sampled pairs: it needs --online"),
           (DPOConfig, {"judge": "tiny", "online": True, "reward_model": "x"}, "give one"),
           (DPOConfig, {"judge": "tiny", "online": True, "online_samples": 2, "judge_rubric": str(pair)},
            "no {a} or {b}; with 2 --online-samples")]
    for cls, kw, message in bad:
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace("{", r"\{").replace("?", r"\?")):
            cls(out=str(tmp_path / "x"), **kw).validate()
    DPOConfig(judge="tiny", online=True, online_samples=3, judge_rubric=str(pair), out=str(tmp_path / "x")).validate()
    proc = run_align("ppo", "--model", tiny_model_dir, "--reward-model", "", "--out", tmp_path / "p")
    assert_user_error(proc, "--reward-model '' leaves PPO nothing to train on", "--judge MODEL")
    assert not (tmp_path / "p").exists()
