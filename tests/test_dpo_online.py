"""`align dpo --online`: pairs sampled from the current policy and ranked by a judge (a verifier function or a
reward model). Pair selection on hand values; the tiny model learns what a judge prefers; a judge without
preferences leaves the policy where it started; a reward-model judge picks what the reward model scores
highest; two processes; bad input."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stages.dpo import best_worst
from tests.conftest import _DIST_ENV, assert_user_error, run_align, small_data

ARITH = small_data()["arith"]
ONLINE = ["--online", "--data", ARITH, "--eval-data", "", "--pass-data", "", "--batch-size", "8", "--lr", "3e-3",
          "--warmup-steps", "1", "--max-new-tokens", "12", "--online-samples", "4", "--eval-every", "0"]


def judges(tmp_path: Path) -> Path:
    path = tmp_path / "judges.py"
    path.write_text("def letter_a(prompt, completion, **row):\n    return float(completion.count('a'))\n\n"
                    "def indifferent(prompt, completion, **row):\n    return 1.0\n")
    return path


def steps(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"online/reward"' in x]


def ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_best_worst_pairs_the_top_and_bottom_sample_and_drops_ties():
    scores = torch.tensor([[0.0, 1.0, 0.5], [2.0, 2.0, 2.0], [3.0, 1.0, 1.0], [-1.0, 4.0, 4.0]])
    best, worst, weight = best_worst(scores)
    assert best.tolist() == [1, 0, 0, 1] and worst.tolist() == [0, 0, 1, 0]  # ties: the first such sample
    assert weight.tolist() == [1.0, 0.0, 1.0, 1.0]  # all equal: no preference, no pair


def test_online_dpo_learns_what_the_judge_prefers(tmp_path):
    """A judge that counts the letter 'a': chosen = the sample with the most. At step 1 the policy is the
    reference (loss log 2); over 15 steps the sampled completions carry about twice as many 'a's (samples at T 1
    over the whole vocabulary; three seeds: 1.3-1.6 -> 3.0-3.4 a's per completion)."""
    out = tmp_path / "od"
    ok(run_align("dpo", "--model", "tiny", *ONLINE, "--verifier", f"{judges(tmp_path)}:letter_a", "--max-steps", "15",
                 "--out", out))
    rows = steps(out)
    assert [r["step"] for r in rows] == list(range(1, 16))
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)
    first, last = sum(r["online/reward"] for r in rows[:3]) / 3, sum(r["online/reward"] for r in rows[-5:]) / 5
    assert last > 1.5 * first and last > first + 1.0, (first, last)
    assert all(0 < r["online/pair_frac"] <= 1 for r in rows)
    art = json.loads((out / "artifact.json").read_text())
    assert art["status"] == "complete" and art["metrics"]["train/online/reward"] == rows[-1]["online/reward"]


def test_a_judge_without_preferences_leaves_the_policy_where_it_started(tmp_path, tiny_model_dir):
    """Every sample scores the same: no pair exists, every slot weighs 0, the loss and gradient are 0 and AdamW
    (no weight decay) leaves every weight as it was."""
    out = tmp_path / "od"
    ok(run_align("dpo", "--model", tiny_model_dir, *ONLINE, "--verifier", f"{judges(tmp_path)}:indifferent",
                 "--max-steps", "2", "--out", out))
    assert all(r["online/pair_frac"] == 0 and r["loss"] == 0 and r["grad_norm"] == 0 for r in steps(out))
    before, after = load_file(tiny_model_dir / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)


def rm_scores(rm_dir: Path, prompts: list[str], texts: list[str]) -> torch.Tensor:
    """The reward model's normalised scores of prompt + completion, computed apart: plain transformers on the
    saved model, one unpadded sequence at a time."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from align.reward_model import encode_scored, normalized_reward

    model, tok = AutoModelForSequenceClassification.from_pretrained(rm_dir), AutoTokenizer.from_pretrained(rm_dir)
    with torch.no_grad():
        raw = torch.stack([model(input_ids=torch.tensor([p + r])).logits[0, 0]
                           for p, r in encode_scored(tok, prompts, texts)])
    return normalized_reward(raw, model.config)


def test_a_reward_model_judge_picks_the_sample_it_scores_highest(tmp_path, tiny_reward_model_dir, single_process):
    """--reward-model: each prompt's chosen completion is the one of its samples the RM scores highest, the
    rejected one the lowest (the RM's scores computed apart), and the judge's scores are the RM's values."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from align.engine.run import StageRun
    from stages.dpo import DPOConfig, OnlineDPO

    cfg = DPOConfig(model="tiny", online=True, reward_model=str(tiny_reward_model_dir), data=str(ARITH), eval_data="",
                    pass_data="", batch_size=8, max_new_tokens=12, online_samples=4, max_steps=1,
                    out=str(tmp_path / "od"))
    cfg.validate()
    ranked = []
    with StageRun(cfg, "dpo") as run:
        algo = OnlineDPO(cfg, run)
        rank = algo.rank
        algo.rank = lambda rows, done: ranked.append((rows, done, rank(rows, done))) or ranked[-1][2]
        algo.sample_window(0)
    unset_hf_deepspeed_config()
    (rows, done, judged), (pairs, weights, _) = ranked[0], algo.buffer[0]
    want = rm_scores(tiny_reward_model_dir, [r["prompt"] for r in rows], [c.text for c in done]).view(8, 4)
    torch.testing.assert_close(judged.view(8, 4), want, rtol=0, atol=1e-4)
    top, bottom = want.max(1).values, want.min(1).values
    assert (top - bottom > 1e-2).all()  # every prompt's samples score well apart: an inverted judge shows

    def place(j: int, ids: list) -> int:  # which of prompt j's samples a pair took
        return next(k for k in range(4) if done[4 * j + k].ids == ids)

    chosen, rejected = ([place(j, p[key]) for j, p in enumerate(pairs)] for key in ("chosen_ids", "rejected_ids"))
    torch.testing.assert_close(want[range(8), chosen], top, rtol=0, atol=1e-5)
    torch.testing.assert_close(want[range(8), rejected], bottom, rtol=0, atol=1e-5)
    assert len(set(chosen)) > 1 and len(set(rejected)) > 1  # no fixed position wins: only the scores can pick
    assert weights.tolist() == [1.0] * 8
    art = json.loads((tmp_path / "od" / "artifact.json").read_text())
    assert art["inputs"]["reward_model"]["spec"] == str(tiny_reward_model_dir)


def test_two_process_online_dpo(tmp_path):
    """Each rank samples, judges and pairs its own slots; the loss's normaliser is the global pair count."""
    from align.runtime import free_port

    out = tmp_path / "od2"
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    ok(subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                       "-m", "align", "dpo", "--model", "tiny", *map(str, ONLINE), "--verifier",
                       f"{judges(tmp_path)}:letter_a", "--max-steps", "2", "--out", str(out)],
                      capture_output=True, text=True, timeout=300, env=env))
    rows = steps(out)
    assert len(rows) == 2 and all(r["pairs"] > 0 for r in rows) and rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)


def test_online_bad_input_exits_2(tmp_path):
    prompts = tmp_path / "prompts.jsonl"  # prompts without answers: nothing for the verifier to check
    prompts.write_text('{"prompt": "Say hi."}\n{"prompt": "Say bye."}\n')
    one = ["--max-steps", "1"]  # should any of these start, it ends at once
    assert_user_error(run_align("dpo", "--online", "--data", prompts, *one, "--out", tmp_path / "a"), str(prompts),
                      "'answer'", "--reward-model")
    assert_user_error(run_align("dpo", "--reward-model", tmp_path, *one, "--out", tmp_path / "b"), "--reward-model",
                      "--online")
    assert_user_error(run_align("dpo", "--online", "--loss", "kto", "--data", ARITH, *one, "--out", tmp_path / "c"),
                      "--online")
    assert_user_error(run_align("dpo", "--online", "--online-samples", "1", "--data", ARITH, *one,
                                "--out", tmp_path / "d"), "--online-samples")
