"""PPO-ptx end to end on the tiny model: one shared 2-process ZeRO-3 run (value network, KL controller, ptx, gold
reward, report), the value head read at every position, and bad input (exit 2, nothing written)."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

from align.errors import UserError
from align.runtime import free_port
from tests.conftest import assert_same_training, assert_terminated_length, assert_user_error, run_align, run_command

SHORT = ["--max-steps", "2", "--prompts-per-step", "8", "--minibatch-size", "4", "--micro-batch-size", "2",
         "--ppo-epochs", "2", "--max-new-tokens", "8", "--ptx-batch-size", "2", "--eval-samples", "4"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_reward_model_dir, tiny_model_dir):
    """The tiny reward model (random head, offset 0.5 in its config) and small data files."""
    from align.paths import DATA_DIR

    d = tmp_path_factory.mktemp("ppo")
    rows = [json.loads(line) for line in (DATA_DIR / "arithmetic/train.jsonl").read_text().splitlines()[:16]]
    texts = [json.loads(line) for line in (DATA_DIR / "text/train.jsonl").read_text().splitlines()[:8]]
    # a gold reward the random tiny policy earns about half the time (it is almost never right on arithmetic)
    (d / "gold.py").write_text("def odd_length(prompt, completion, **row):\n    return float(len(completion) % 2)\n")
    return {"dir": d, "rm": tiny_reward_model_dir, "policy": tiny_model_dir, "prompts": write_jsonl(d / "prompts.jsonl", rows),
            "eval": write_jsonl(d / "eval.jsonl", rows[:4]), "text": write_jsonl(d / "text.jsonl", texts),
            "gold": f"{d / 'gold.py'}:odd_length"}


def base_args(files, out):
    return ["--model", "tiny", "--reward-model", str(files["rm"]), "--data", str(files["prompts"]),
            "--eval-data", str(files["eval"]), "--ptx-data", str(files["text"]), "--out", str(out), *SHORT]


@pytest.fixture(scope="module")
def runs(files):
    """The same PPO-ptx run on 1 and on 2 processes (ZeRO-3 both: one CPU process keeps the stage asked for),
    trained on the RM's score plus 0.5 x the gold reward; and the 1-process run without the gold term."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    two = ["-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    for name, launch, coef in (("ppo1", [], "0.5"), ("ppo2", two, "0.5"), ("ppo1-no-gold", [], "0")):
        args = base_args(files, files["dir"] / name)
        args[args.index("--model") + 1] = str(files["policy"])  # saved weights: the updates can be measured
        proc = run_command([sys.executable, *launch, "-m", "align", "ppo", *args, "--ptx-coef", "0.1", "--kl-horizon",
                            "100", "--init-kl-coef", "0.05", "--gold-reward", files["gold"],
                            "--gold-reward-coef", coef], {**env, "ALIGN_DIST_TIMEOUT": "120", "COLUMNS": "200"})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return files["dir"] / "ppo1", files["dir"] / "ppo2", files["dir"] / "ppo1-no-gold"


@pytest.fixture(scope="module")
def two_proc_run(runs):
    out = runs[1]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, [r for r in rows if "reward" in r], [r for r in rows if "eval/reward" in r]


def test_two_processes_match_one_process(runs, files):
    """The rollout is keyed by (seed, step, the prompt's place), advantages are whitened and losses normalised
    over the global batch, and each epoch's minibatches are the same episodes for any number of processes:
    2 processes take the same steps as 1 (policy, value network, KL controller)."""
    assert_same_training(*runs[:2], files["policy"])


def test_the_gold_term_trains_centred_on_the_other_episodes(runs, files):
    """--gold-reward-coef 0.5 against 0: the same first rollout (reward, gold), a score whose gold term sums to 0
    over the batch (its leave-one-out baseline), and other weights at the end."""
    from safetensors.torch import load_file

    with_gold, _, without = runs
    a, b = ([json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"reward"' in x]
            for out in (with_gold, without))
    assert (a[0]["reward"], a[0]["gold_reward"]) == (b[0]["reward"], b[0]["gold_reward"])
    for row in a + b:
        assert row["objective/scores"] == pytest.approx(row["reward"], abs=1e-5)
    w1, w0, base = (load_file(d / "model.safetensors") for d in (with_gold / "model", without / "model", files["policy"]))
    apart = torch.cat([(w1[k] - w0[k]).flatten() for k in w1]).norm()
    moved = torch.cat([(w0[k] - base[k]).flatten() for k in w1]).norm()
    assert apart > 0.05 * moved > 0, (apart, moved)


def test_two_process_zero3_ppo_ptx_run(two_proc_run):
    out, steps, evals = two_proc_run
    art = json.loads((out / "artifact.json").read_text())
    assert art["status"] == "complete" and art["world_size"] == 2 and art["model_kind"] == "policy"
    assert [r["step"] for r in steps] == [1, 2] and [r["step"] for r in evals] == [0, 2]
    for key in ("reward", "gold_reward", "objective/kl", "objective/scores", "objective/rlhf_reward", "kl", "kl_coef",
                "entropy", "clip_ratio", "val/clipfrac", "policy/approxkl", "val/explained_variance",
                "completions/mean_length", "distinct_1", "distinct_2", "loss/policy", "loss/value", "loss/ptx"):
        assert key in steps[0] and steps[0][key] == steps[0][key], key  # present and not NaN
    for row in steps:
        assert_terminated_length(row, 8)
    assert 0.0 < steps[0]["gold_reward"] < 1.0 and 0.0 < steps[1]["gold_reward"] < 1.0
    assert "eval/pass@1/greedy" in evals[0] and "start/reward" in art["metrics"]
    assert (out / "report.png").stat().st_size > 5000 and (out / "checkpoints" / "step2" / "value").is_dir()
    assert art["inputs"]["reward_model"]["spec"] == art["inputs"]["value_model"]["spec"]  # V starts from the RM
    # the last held-out evaluation, one problem a line, its greedy answers scored as eval/pass@1/greedy and eval/reward
    answers = [json.loads(x) for x in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert len(answers) == 4 and {a["step"] for a in answers} == {2}
    assert sum(a["greedy_correct"] for a in answers) / 4 == evals[-1]["eval/pass@1/greedy"]
    assert abs(sum(a["rm_score"] for a in answers) / 4 - evals[-1]["eval/reward"]) < 1e-5


def test_kl_controller_in_the_run_follows_the_formula(two_proc_run):
    """β of step 2 = β₁·(1 + clip(KL₁/target − 1, ±0.2)·n/horizon), n = 8 episodes, target 1, horizon 100."""
    _, steps, _ = two_proc_run
    b1, kl1 = steps[0]["kl_coef"], steps[0]["objective/kl"]
    assert b1 == 0.05
    e = min(max(kl1 / 1.0 - 1, -0.2), 0.2)
    assert steps[1]["kl_coef"] == pytest.approx(b1 * (1 + e * 8 / 100))
    final = json.loads((two_proc_run[0] / "artifact.json").read_text())["metrics"]["kl_coef/final"]
    e2 = min(max(steps[1]["objective/kl"] - 1, -0.2), 0.2)
    assert final == pytest.approx(steps[1]["kl_coef"] * (1 + e2 * 8 / 100))


def test_value_head_at_every_position_matches_the_reward_model(files, shipped_tokenizer):
    """token_values reads the score head at each position; at the last token it is the RM's (normalised) reward."""
    from align.reward_model import normalized_reward, raw_rewards
    from stages.ppo import token_values
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(files["rm"]).eval()

    class Engine:  # what token_values needs of a DeepSpeed engine: callable, .module
        module = model

        def __call__(self, **kw):
            return model(**kw)

    seqs = [[1, 5, 9, 30, 40, 2], [1, 7, 8, 2]]
    pad = shipped_tokenizer.pad_token_id
    width = max(map(len, seqs)) + 1  # one pad more: token_values drops the last position (it predicts nothing)
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    with torch.no_grad():
        v = token_values(Engine(), {"input_ids": ids, "attention_mask": attn})
        r = normalized_reward(raw_rewards(model, {"input_ids": ids, "attention_mask": attn}), model.config)
    assert v.shape == (2, width - 1)
    torch.testing.assert_close(v[[0, 1], [5, 3]], r)
    assert not torch.allclose(v[0, :5], v[0, 5].expand(5))  # a value per position, not one per sequence


def test_bad_input_is_refused_before_anything_is_written(files, tmp_path, shipped_tokenizer, monkeypatch):
    from stages.ppo import PPOConfig, run

    def refused(match, **kw):
        args = dict(model="tiny", reward_model=str(files["rm"]), data=str(files["prompts"]), ptx_data=str(files["text"]),
                    eval_data="", out=str(tmp_path / "never"), max_steps=1, prompts_per_step=2, minibatch_size=2,
                    max_new_tokens=2)  # tiny budgets: a refusal that fails must not train for long
        with pytest.raises(UserError, match=match):
            run(PPOConfig(**{**args, **kw}))
        assert not (tmp_path / "never").exists()

    # an RM whose tokenizer differs: the RM could score re-tokenised text, but the value network (initialised
    # from it) must read the policy's tokens
    other = tmp_path / "rm-other-tok"
    from transformers import AutoModelForSequenceClassification

    tok = type(shipped_tokenizer).from_pretrained(files["rm"])
    tok.add_tokens(["<new>"])
    rm = AutoModelForSequenceClassification.from_pretrained(files["rm"])
    rm.resize_token_embeddings(len(tok))  # a consistent model: only its tokenizer differs from the policy's
    rm.save_pretrained(other)
    tok.save_pretrained(other)
    refused(r"rm-other-tok: its tokenizer differs.*vocabularies differ.*value network.*--value-model", reward_model=str(other))
    refused(r"every prompt is longer than --max-prompt-length 4", max_prompt_length=4)
    refused(r"empty.jsonl: the dataset is empty", ptx_data=str(write_jsonl(tmp_path / "empty.jsonl", [])))
    refused(r"no usable pretraining text", ptx_data=str(write_jsonl(tmp_path / "blank.jsonl", [{"text": ""}])))
    refused(r"a preset is an untrained model, not a reward model", reward_model="tiny")
    refused(r"this is a policy model, but a reward model", reward_model=str(files["policy"]))
    monkeypatch.chdir(tmp_path)  # no runs/arithmetic here: the defaults say how to make them
    refused(r"runs/arithmetic/rm: not found.*align pipeline run pipelines/arithmetic.toml", reward_model="runs/arithmetic/rm")
    no_answer = write_jsonl(tmp_path / "no-answer.jsonl", [{"prompt": "1+1="}, {"prompt": "2+2="}])
    refused(r"no-answer.jsonl: --gold-reward-coef 1.0 needs the verifier's `answer` column", data=str(no_answer),
            gold_reward_coef=1.0)
    with pytest.raises(UserError, match="--minibatch-size 5 must divide"):
        PPOConfig(minibatch_size=5).validate()
    with pytest.raises(UserError, match="--gold-reward-coef 1.0 trains on the gold reward, but --gold-reward is off"):
        PPOConfig(gold_reward="", gold_reward_coef=1.0).validate()


def test_bad_input_exits_2_on_the_command_line(files, tmp_path):
    proc = run_align("ppo", "--model", "tiny", "--reward-model", files["rm"], "--data", files["prompts"],
                     "--ptx-data", write_jsonl(tmp_path / "empty.jsonl", []), "--out", tmp_path / "o")
    assert_user_error(proc, "empty.jsonl", "the dataset is empty")
    assert not (tmp_path / "o").exists()


def test_ptx_examples_text_and_sft_rows(tmp_path, shipped_tokenizer):
    """--ptx-data: {text} rows -> LM loss on every token (BOS + text + EOS, cut on the right); {prompt,
    completion} rows -> the chat-templated SFT example with the prompt masked (-100)."""
    from stages.ppo import ptx_examples

    tok = shipped_tokenizer
    text = ptx_examples(tok, str(write_jsonl(tmp_path / "t.jsonl", [{"text": "Tom has 3 apples."}])), 128)
    ids = tok("Tom has 3 apples.", add_special_tokens=False)["input_ids"]
    assert text == [{"input_ids": [tok.bos_token_id, *ids, tok.eos_token_id],
                     "labels": [tok.bos_token_id, *ids, tok.eos_token_id]}]
    assert len(ptx_examples(tok, str(tmp_path / "t.jsonl"), 4)[0]["input_ids"]) == 4
    sft = ptx_examples(tok, str(write_jsonl(tmp_path / "s.jsonl", [{"prompt": "2 + 3?", "completion": "5"}])), 128)
    (ex,) = sft
    from align.data import encode_prompts

    n_prompt = len(encode_prompts(tok, ["2 + 3?"])[0])
    assert ex["labels"][:n_prompt] == [-100] * n_prompt
    assert ex["labels"][n_prompt:] == ex["input_ids"][n_prompt:] == [*tok("5", add_special_tokens=False)["input_ids"],
                                                                     tok.eos_token_id]


def test_dropout_is_off_so_the_first_ratio_is_exactly_one(files, tmp_path, shipped_tokenizer):
    """A policy whose config has attention dropout 0.1: the one minibatch of a one-epoch step is scored with the
    weights that sampled it, so π_θ/π_old = 1 exactly (approx-KL 0, nothing clipped) only if dropout is off in
    both passes; with it on the two passes drew different dropout masks. Run as one CUDA process runs by default
    — ZeRO-0 engines, bf16-pure (bf16 weights, AdamW with stochastic rounding) — on the CPU: policy, value,
    reference, reward model and ptx all run, and both trained engines report the gradient norm they clip
    (DeepSpeed's ZeRO-0 path without its own mixed precision keeps none)."""
    from align.models import load_causal_lm, resolve

    model = load_causal_lm(resolve("tiny"), shipped_tokenizer, torch.float32, seed=0)
    model.config.attention_dropout = 0.1
    model.save_pretrained(tmp_path / "dropout", safe_serialization=True)
    shipped_tokenizer.save_pretrained(tmp_path / "dropout")
    out = tmp_path / "ppo"
    proc = run_align("ppo", "--model", tmp_path / "dropout", "--reward-model", files["rm"], "--data", files["prompts"],
                     "--eval-data", "", "--ptx-coef", "0.1", "--ptx-data", files["text"], "--ptx-batch-size", "2",
                     "--out", out, "--max-steps", "1", "--prompts-per-step", "8", "--minibatch-size", "8",
                     "--micro-batch-size", "4", "--ppo-epochs", "1", "--max-new-tokens", "8", "--zero-stage", "0",
                     "--precision", "bf16-pure")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ZeRO-0" in proc.stdout + proc.stderr
    (step,) = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward" in r]
    assert step["policy/approxkl"] == 0.0 and step["clip_ratio"] == 0.0
    assert step["grad_norm"] > 0 and step["val/grad_norm"] > 0
    assert all(math.isfinite(step[k]) for k in ("loss/policy", "loss/value", "loss/ptx"))
