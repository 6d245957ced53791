"""Reward functions in both forms — per sample, fn(prompt, completion, **row) -> float, and batched as TRL's
GRPOTrainer calls them, fn(prompts, completions, **kwargs) -> list[float | None] — checked on the data's first rows
before any model is built; --verifier auto's choice, said and recorded; user reward files hashed into the
artifact's inputs and a pipeline stage's fingerprint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from align import pipeline as P
from align.artifacts import sha256_file
from align.errors import UserError
from align.rewards import (RewardError, auto_verifier, call_rewards, choose_verifier, is_batched, parse_rewards,
                           probe)
from align.rollout.generation import Completion
from tests.conftest import assert_user_error, run_align, small_data

FORMS = ("def score(prompt, completion, **row) -> float", "def score(prompts, completions, **kwargs) -> list[float]")

# the same reward in both forms: 1 for a completion of odd length, times 1 + the row's level; and a second one,
# 2 where the completion is the answer, that TRL's form leaves out (None) for rows of level 2
REWARDS = '''\
import numpy as np
import torch

def parity(prompt, completion, **row):
    return float(len(completion) % 2) * (1 + row["level"])

def parity_batched(prompts, completions, completion_ids, level, **kwargs):
    assert len(prompts) == len(completions) == len(completion_ids) == len(level)
    return [np.float32(len(c) % 2) * (1 + lv) for c, lv in zip(completions, level)]

def answer(completions, answer, level, **kwargs):
    return [None if lv == 2 else 2 * (c.strip() == a) for c, a, lv in zip(completions, answer, level)]

def never(completions, **kwargs):
    return [None] * len(completions)

def chat(prompts, completions, **kwargs):
    return [len(p) + len(c[0]["content"]) if c[0]["role"] == "assistant" else -1 for p, c in zip(prompts, completions)]

def chat_sample(prompt, completion, **row):
    return len(prompt) + len(completion)

def kinds(prompt, completion, **row):
    return {"f": 0.5, "i": 2, "b": True, "n32": np.float32(0.25), "n64": np.int64(3), "nb": np.bool_(True),
            "t": torch.tensor(1.5)}[completion]

def text(prompt, completion, **row):
    return "1.0"

def listed(prompt, completion, **row):
    return [1.0]

def nothing(prompt, completion, **row):
    if completion == "never":
        return 1.0

def short(prompts, completions, **kwargs):
    return [1.0] * (len(completions) - 1)

def scalar(prompts, completions, **kwargs):
    return 1.0

def nan(prompts, completions, **kwargs):
    return [float("nan")] * len(completions)

def one_arg(completion):
    return 1.0

def no_ids(prompts, completions):
    return [1.0] * len(completions)

def named_columns(prompt, completion, answer):
    return 1.0

def boom(prompt, completion, **row):
    raise RuntimeError("bad reward")

def plain(prompts, completions, **kwargs):
    return [float(isinstance(c, str)) for c in completions]

def marked(**kwargs):  # nothing in its signature says batched: the marker does
    return [1.0] * len(kwargs["completions"])
marked.batched = True
'''


@pytest.fixture
def rewards(tmp_path) -> Path:
    f = tmp_path / "r.py"
    f.write_text(REWARDS)
    return f


ROWS = [{"prompt": "What is 1 + 1?", "answer": "2", "level": 1},
        {"prompt": "What is 2 + 3?", "answer": "5", "level": 2},
        {"prompt": "What is 4 + 4?", "answer": "8", "level": 3}]


def one(rewards: Path, name: str):
    (r,) = parse_rewards([f"{rewards}:{name}"])
    return r


def test_the_form_is_read_from_the_parameter_names_or_the_marker(rewards):
    assert [is_batched(one(rewards, n).fn) for n in ("parity", "parity_batched", "answer", "marked")] == \
        [False, True, True, True]  # `answer(completions, ...)`: TRL's usual form, prompts left to **kwargs
    assert [one(rewards, n).batched for n in ("parity", "parity_batched")] == [False, True]

    def f(prompt, completions, **row):  # named like TRL's, marked per sample: the marker wins
        return 1.0

    f.batched = False
    assert not is_batched(f)


def test_a_batched_and_a_per_sample_reward_of_the_same_thing_give_the_same_rewards(rewards):
    """call_rewards (the registry's one call path) and grpo's rewards_of (the weighted sum per sample): the same
    values by hand — parity · (1 + level): 'ab' 0, 'abc' 3·1 ... — in either form, the batched one called once."""
    from stages.grpo import GRPOConfig, rewards_of

    texts = ["ab", "abc", "abcde"]
    per, batched = one(rewards, "parity"), one(rewards, "parity_batched")
    want = [0.0, 3.0, 4.0]  # 'ab': even; 'abc': 1 · (1 + 2); 'abcde': 1 · (1 + 3)
    assert call_rewards(per, ROWS, texts) == call_rewards(batched, ROWS, texts, [[7]] * 3) == want
    cfg = GRPOConfig(reward=[f"{rewards}:parity:0.5"])
    done = [Completion([1], [5] * len(t), t, True) for t in texts]
    for spec in (f"{rewards}:parity:0.5", f"{rewards}:parity_batched:0.5"):
        fns = parse_rewards([spec])
        got = rewards_of(cfg, fns, ROWS, done)
        assert [total for total, _ in got] == [0.5 * w for w in want]
        assert [parts[fns[0].name] for _, parts in got] == want


def test_none_is_does_not_apply_and_left_out_of_the_sum_as_trl_does(rewards):
    """TRL's GRPOTrainer turns None into NaN and sums over the functions with nansum; a sample every function
    called not applicable is unscorable (left out of its group's baseline): here a skipped sample, not an error."""
    from stages.grpo import GRPOConfig, rewards_of

    texts = ["2", "5", "9"]
    done = [Completion([1], [5], t, True) for t in texts]
    fns = parse_rewards([f"{rewards}:answer:3", f"{rewards}:parity"])
    got = rewards_of(GRPOConfig(), fns, ROWS, done)
    # answer: 2 (right), None (level 2), 0 (wrong) times 3; parity: 1 · (1 + level) for each 1-character text
    assert [total for total, _ in got] == [3 * 2 + 2, 3, 3 * 0 + 4]
    assert ["r.answer" in parts for _, parts in got] == [True, False, True]
    never = parse_rewards([f"{rewards}:never"])
    assert [v for v, _ in rewards_of(GRPOConfig(), never, ROWS, done)] == [None] * 3  # unscorable: skipped
    assert all(parts == {"errors": 0.0} for _, parts in rewards_of(GRPOConfig(), never, ROWS, done))
    assert [v for v, _ in rewards_of(GRPOConfig(reward_model="rm"), never, ROWS, done)] == [0.0] * 3  # the RM scores


def test_the_grpo_step_logs_each_function_over_the_samples_it_applied_to(rewards):
    """score(): rewards/NAME is the mean over the samples the function scored (TRL's nanmean); the skipped
    (unscorable) samples are not valid; every function's name is logged, NaN where it applied to none."""
    from align.engine.stats import Stats
    from align.rollout.batch import Rollout
    from stages.grpo import GRPO, GRPOConfig

    algo = object.__new__(GRPO)
    algo.cfg = GRPOConfig(reward=[f"{rewards}:answer", f"{rewards}:never"])
    algo.reward_fns, algo.rm = parse_rewards(algo.cfg.reward), None
    r = Rollout(ROWS[:2], [Completion([1], [5], t, True) for t in ("2", "7", "5", "5")], 2)
    algo.score(r)
    assert r.valid.tolist() == [[1.0, 1.0], [0.0, 0.0]] and r.rewards[0].tolist() == [2.0, 0.0]
    stats = Stats()
    for k, v in r.parts.items():
        stats.mean(f"rewards/{k}", sum(v), len(v), math.nan)
    got = stats.reduce("cpu")
    assert got["rewards/r.answer"] == 1.0 and math.isnan(got["rewards/r.never"]) and got["rewards/errors"] == 0.0


def test_conversational_prompts_give_a_batched_function_message_lists_and_a_per_sample_one_text(rewards):
    chat = [{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"},
            {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "yo"}], "answer": "2"}]
    # batched: len(prompt messages) + len(the completion's content); per sample: the prompt as given, the text
    assert call_rewards(one(rewards, "chat"), chat, ["abc", "de"]) == [1 + 3, 2 + 2]
    assert call_rewards(one(rewards, "chat_sample"), chat, ["abc", "de"]) == [1 + 3, 2 + 2]
    assert call_rewards(one(rewards, "plain"), ROWS[:2], ["abc", "de"]) == [1.0, 1.0]  # plain prompts: the texts
    assert call_rewards(one(rewards, "plain"), chat, ["abc", "de"]) == [0.0, 0.0]


def test_returns_float_int_bool_numpy_and_tensor_scalars_and_refuses_the_rest(rewards):
    kinds = one(rewards, "kinds")
    texts = ["f", "i", "b", "n32", "n64", "nb", "t"]
    assert call_rewards(kinds, [ROWS[0]] * 7, texts) == [0.5, 2.0, 1.0, 0.25, 3.0, 1.0, 1.5]
    for name, kind, needle in (("text", "type", "str '1.0' (not a number)"), ("listed", "type", "list [1.0]"),
                               ("short", "type", "returned list of 2, not a list of 3"),
                               ("scalar", "type", "returned float 1.0, not a list of 3"), ("nan", "value", "nan")):
        got = call_rewards(one(rewards, name), ROWS, ["a", "b", "c"])
        assert all(isinstance(e, RewardError) and e.kind == kind and needle in str(e) for e in got), (name, got)
        assert (kind == "type") == ("--on-reward-error" not in got[0].fix())
    (err,) = call_rewards(one(rewards, "nothing"), ROWS[:1], ["x"])
    assert err.kind == "type" and "None (does not apply) is for a batched function's list" in str(err)


def test_a_wrong_signature_or_return_is_refused_before_any_model_with_both_forms(rewards):
    """parse_rewards (the config's check: before the data is read) refuses a function neither form can call; probe
    (the stage's, on the first rows of --data) a signature that cannot take the data's columns and a return that
    is no number. Never with --on-reward-error in the message: it does not excuse a bug."""
    for name, why in (("one_arg", "takes no prompt and completion"), ("no_ids", "takes no completion_ids")):
        with pytest.raises(UserError) as e:
            parse_rewards([f"{rewards}:{name}"])
        said = str(e.value).replace(name, "score")
        assert why in said and all(form in said for form in FORMS) and "--on-reward-error" not in said
        assert e.value.option == "reward"
    for name, needle in (("named_columns", "cannot take the columns of d.jsonl (answer, level): got an unexpected "
                                           "keyword argument 'level'"), ("text", "(not a number)"),
                         ("scalar", "not a list of 3 values")):
        with pytest.raises(UserError) as e:
            probe([one(rewards, name)], ROWS, where="d.jsonl")
        said = str(e.value).replace(name, "score")
        assert needle in said and all(form in said for form in FORMS) and "--on-reward-error" not in said


def test_the_probe_warns_of_a_function_that_raises_and_refuses_data_a_registered_reward_cannot_read(rewards, capsys):
    probe([one(rewards, "boom")], ROWS, where="d.jsonl")  # a sampled completion may fare better: a warning
    said = " ".join("".join(capsys.readouterr()).split())
    assert "raised RuntimeError: bad reward on completion '2'" in said and "every probe completion" in said
    with pytest.raises(UserError, match="reference answer 'blue' is not a number"):
        probe(parse_rewards(["math"]), [{"prompt": "q", "answer": "blue"}], where="d.jsonl")
    probe(parse_rewards(["math", "exact", f"{rewards}:parity"]), ROWS)  # fine


def test_auto_picks_math_for_answers_that_are_or_end_in_a_number_and_says_why():
    gsm8k = [{"prompt": "q", "answer": "Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips.\n#### 72"},
             {"prompt": "q", "answer": "The answer is \\boxed{3/4}."}]
    assert auto_verifier(gsm8k) == ("math", "the answers are numbers or end in one")
    assert auto_verifier([{"answer": 72}, {"answer": -1.5}, {"answer": "1,234"}]) == ("math", "the answers are numbers")
    assert auto_verifier([{"answer": "0 1 6 7 8"}, {"answer": "3 6 9"}]) == ("exact", "the answers are not numbers")
    assert auto_verifier([{"answer": "5"}, {"answer": "blue"}, {"answer": "red"}]) == \
        ("exact", "2 of 3 answers are not numbers, e.g. row 2's 'blue'")
    assert auto_verifier([{"answer": "x", "rg_task": "gcd"}])[0] == "rg:gcd"
    v = choose_verifier("auto", gsm8k)
    assert v.line == "verifier: math (auto: the answers are numbers or end in one)"
    assert v.record() == {"name": "math", "auto": True, "why": "the answers are numbers or end in one"}
    assert v.check(gsm8k[0], "so #### 72") and not v.check(gsm8k[0], "#### 71")  # a right answer scores 1
    assert choose_verifier("exact", gsm8k).record() == {"name": "exact", "auto": False}


def test_a_batched_user_verifier_judges_one_completion_at_a_time(rewards):
    v = choose_verifier(f"{rewards}:answer", ROWS)
    assert v.check(ROWS[0], " 2 ") is False  # answer's 2 · (right): 2, not 1
    v = choose_verifier(f"{rewards}:marked", ROWS)
    assert v.check(ROWS[0], "anything", [1, 2]) and v.fn("p", "c", answer="1") == 1.0


def test_reward_files_are_in_the_fingerprint_and_only_when_a_stage_has_one(tmp_path, rewards, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a stage reads a relative reward file from where it runs: the pipeline's directory
    f = tmp_path / "p.toml"
    f.write_text('[stages.grpo]\nmodel = "tiny"\nreward = ["r.py:parity", "math"]\n\n'
                 '[stages.plain]\nstage = "grpo"\nmodel = "tiny"\nreward = ["math"]\n')
    p = P.load(f)
    before = [P.fingerprint(p, s) for s in p.stages]
    rewards.write_text(REWARDS + "\n# edited\n")
    after = [P.fingerprint(P.load(f), s) for s in P.load(f).stages]
    assert after[0] != before[0] and after[1] == before[1]
    from stages.grpo import GRPOConfig

    assert GRPOConfig(reward=["r.py:parity:2", "math", "r.py:answer"], verifier="v.py:ok").user_code() == \
        ["v.py", "r.py"]


# ----------------------------------------------------------------------------------------- end to end


SHORT = ["--max-steps", "2", "--prompts-per-step", "2", "--num-generations", "4", "--max-new-tokens", "6",
         "--eval-samples", "2", "--eval-k", "1", "--micro-batch-size", "8", "--data", str(small_data()["arith"]),
         "--eval-data", str(small_data()["arith_test"])]


def metrics(out: Path, name: str) -> list[dict]:
    """metrics.jsonl's rows without the times and rates, the reward function's name made NAME."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k.replace(name, "NAME"): v for k, v in row.items()
             if not k.startswith(("time/", "memory/")) and not k.endswith("per_s")} for row in rows]


def test_a_batched_and_a_per_sample_reward_train_grpo_identically(tmp_path, rewards):
    """Two 2-step GRPO runs on the tiny model, the same reward in each form: the same metrics, every step and
    evaluation; the artifact records the reward file's sha256 and the verifier auto chose, which the run said."""
    runs = {}
    for name in ("parity", "parity_batched"):
        out = tmp_path / name
        proc = run_align("grpo", "--model", "tiny", "--out", out, "--reward", f"{rewards}:{name}", *SHORT)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "verifier: math (auto: the answers are numbers)" in proc.stdout
        runs[name] = metrics(out, f"r.{name}")
        art = json.loads((out / "artifact.json").read_text())
        assert art["inputs"]["code"] == {str(rewards): sha256_file(rewards)}
        assert art["verifier"] == {"name": "math", "auto": True, "why": "the answers are numbers"}
    assert runs["parity"] == runs["parity_batched"] and len(runs["parity"]) >= 3
    steps = [row for row in runs["parity"] if "reward" in row]
    assert len(steps) == 2 and any(row["rewards/NAME"] > 0 and row["reward_std"] > 0 for row in steps)  # a signal


def test_a_wrong_signature_fails_before_the_model_loads(tmp_path, rewards, tiny_model_dir, monkeypatch,
                                                        single_process):
    """The CLI: exit 2, both forms, no --on-reward-error, --out never made. In-process: the stage refuses it
    before run.open (which would make --out) and before any model is loaded (a loader that fails the test)."""
    out = tmp_path / "o"
    proc = run_align("grpo", "--model", "tiny", "--out", out, "--reward", f"{rewards}:named_columns", *SHORT)
    said = assert_user_error(proc, "cannot take the columns of", "unexpected keyword argument 'level'",
                             *(form.replace("score", "named_columns") for form in FORMS))
    assert "--on-reward-error" not in said and not out.exists()
    import stages.grpo as grpo_module
    from stages.grpo import GRPO, GRPOConfig
    from tests.conftest import stage_in_process

    def loaded(*a, **kw):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(grpo_module, "load_causal_lm", loaded)
    cfg = GRPOConfig(model=str(tiny_model_dir), out=str(out), reward=[f"{rewards}:scalar"], data=SHORT[SHORT.index(
        "--data") + 1], eval_data="", zero_stage=0)
    with pytest.raises(UserError, match="not a list of 4 values"):
        with stage_in_process(cfg, "grpo", GRPO):
            pass
    assert not out.exists()


def test_eval_says_and_records_the_verifier_auto_chose_for_full_solutions(tmp_path):
    """The user's report: answers that end in a number (GSM8K's '... #### 72') picked exact, which scored right
    answers 0. Now math, said in the first lines and recorded."""
    data = tmp_path / "gsm.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {n} + 1?", "answer": f"{n} + 1 = {n + 1}. #### {n + 1}"})
                            + "\n" for n in range(2)))
    out = tmp_path / "ev"
    proc = run_align("eval", "tiny", "--data", data, "--out", out, "--k", "1", "--limit", "2",
                     "--max-new-tokens", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first = proc.stdout.strip().splitlines()[:3]  # before the model loads (then: the run's own lines)
    assert "verifier: math (auto: the answers are numbers or end in one)" in first, proc.stdout
    art = json.loads((out / "artifact.json").read_text())
    assert art["verifier"] == {"name": "math", "auto": True, "why": "the answers are numbers or end in one"}


def test_a_pipeline_stage_whose_reward_file_changed_reruns(tmp_path, rewards):
    """pipeline run → up to date → the reward file edited → stale (show says so) → run reruns it."""
    f = tmp_path / "p.toml"
    f.write_text(f'[pipeline]\nout = "runs"\n\n[stages.grpo]\nmodel = "tiny"\nreward = ["{rewards}:parity"]\n'
                 f'data = "{small_data()["arith"]}"\neval_data = ""\nmax_steps = 1\nprompts_per_step = 2\n'
                 'num_generations = 2\nmax_new_tokens = 4\nmicro_batch_size = 4\n')
    results = P.run(f)
    P.raise_for_failure(results)
    assert [pl.state.status for pl in P.plan(P.load(f))] == ["complete"]
    rewards.write_text(REWARDS.replace("% 2)", "% 2 == 0)"))
    assert [(pl.run, pl.state.status) for pl in P.plan(P.load(f))] == [(True, "stale")]
    show = run_align("pipeline", "show", f, cwd=tmp_path)
    assert "stale (config or inputs changed)" in show.stdout, show.stdout + show.stderr
    assert [r.status for r in P.run(f)] == ["ran"]
    art = json.loads((tmp_path / "runs/grpo/artifact.json").read_text())
    assert art["inputs"]["code"] == {str(rewards): sha256_file(rewards)}

