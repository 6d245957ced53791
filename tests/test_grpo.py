"""GRPO end to end on the tiny model (short runs): 2-process ZeRO-3, the KL/reference switch, user rewards and
the reward-error policy."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from align.runtime import free_port
from tests.conftest import (assert_same_training, assert_terminated_length, parity_reward, run_command,
                            small_sft)

SHORT = ["--max-steps", "2", "--prompts-per-step", "4", "--num-generations", "4", "--max-new-tokens", "8",
         "--eval-samples", "4", "--eval-k", "1,2", "--micro-batch-size", "8"]
SMALL = small_sft()  # --data / --eval-data: heads of the shipped files


def align(*args, nproc=1):
    if nproc == 1:
        return [sys.executable, "-m", "align", *args]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
            "-m", "align", *args]


def run(cmd):
    return run_command(cmd, {**os.environ, "ALIGN_DIST_TIMEOUT": "120", "COLUMNS": "200"}, timeout=600)


def metric_rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory, tiny_model_dir):
    """The same short run on 1 and on 2 processes (ZeRO-3 both: one CPU process keeps the stage asked for)."""
    root = tmp_path_factory.mktemp("grpo")
    for name, nproc in (("one", 1), ("two", 2)):
        proc = run(align("grpo", "--model", str(tiny_model_dir), "--out", str(root / name), "--reward", "math",
                         "--reward", parity_reward(), "--lr", "1e-3", "--warmup-steps", "0", *SHORT, *SMALL, nproc=nproc))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root / "one", root / "two"


def test_two_process_zero3_grpo_run(grpo_runs):
    out = grpo_runs[1]
    art = json.loads((out / "artifact.json").read_text())
    assert art["status"] == "complete" and art["world_size"] == 2 and art["model_kind"] == "policy"
    steps = [r for r in metric_rows(out) if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for key in ("reward", "reward_std", "frac_reward_zero_std", "clip_ratio/low", "clip_ratio/high", "entropy",
                "completions/mean_length", "completions/clipped_ratio", "completions/mean_terminated_length",
                "rewards/math", "distinct_1", "signal_frac"):
        assert key in steps[0], key
    for row in steps:
        assert_terminated_length(row, 8)
    assert "kl" not in steps[0]  # beta 0: no reference model, no KL
    evals = [r for r in metric_rows(out) if "eval/pass@1/greedy" in r]
    assert [r["step"] for r in evals] == [0, 2] and "eval/pass@2" in evals[0]
    assert "start/pass@1/greedy" in art["metrics"] and "gain/pass@1/greedy" in art["metrics"]
    answers = [json.loads(x) for x in (out / "eval_samples.jsonl").read_text().splitlines()]  # the last evaluation
    assert len(answers) == 4 and {a["step"] for a in answers} == {2} and all(len(a["samples"]) == 2 for a in answers)
    assert sum(a["greedy_correct"] for a in answers) / 4 == evals[-1]["eval/pass@1/greedy"]
    assert not list(out.glob("eval_samples.jsonl.tmp*"))


def test_two_processes_match_one_process(grpo_runs, tiny_model_dir):
    """Rollouts are keyed by (seed, step, the prompt's place in the global batch) and every loss is normalised
    over the global batch: 2 processes sample the same completions and take the same steps as 1."""
    assert_same_training(*grpo_runs, tiny_model_dir)


def test_beta_loads_a_reference_and_logs_kl_and_a_reward_model_adds_its_score(tmp_path, tiny_reward_model_dir,
                                                                              tiny_model_dir):
    """--beta, --reward-model and --teacher (on-policy distillation) together in one run."""
    out = tmp_path / "kl"
    proc = run(align("grpo", "--out", str(out), "--beta", "0.1", "--num-iterations", "2", "--advantage", "rloo",
                     "--reward-model", str(tiny_reward_model_dir), "--reward-model-weight", "0.5", "--lr", "1e-3",
                     "--warmup-steps", "0", "--teacher", str(tiny_model_dir), "--distill-coef", "0.5", *SHORT, *SMALL))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = " ".join(proc.stdout.split())  # the info line wraps at the terminal width
    assert "reference model on" in said and "reward model" in said
    steps = [r for r in metric_rows(out) if "reward" in r]
    # KL is logged on the first pass over a rollout: at step 1 the policy is still the reference (exactly 0); at
    # step 2 the policy has moved and the reference has not
    assert steps[0]["kl"] == 0.0 and steps[1]["kl"] > 1e-3, steps
    assert all("distill/reverse_kl" in r for r in steps)
    # reward = math + 0.5 · RM: the step means add up the same way
    for r in steps:
        assert r["reward"] == pytest.approx(r["rewards/math"] + 0.5 * r["rewards/reward_model"], abs=1e-5)
    art = json.loads((out / "artifact.json").read_text())
    assert art["inputs"]["reward_model"]["spec"] == str(tiny_reward_model_dir)
    assert art["inputs"]["teacher"]["spec"] == str(tiny_model_dir)


def test_reward_model_that_is_a_preset_is_refused(tmp_path):
    # (a policy directory given as a reward model is refused by models.resolve: covered in the PPO tests)
    proc = run(align("grpo", "--out", str(tmp_path / "o"), "--reward-model", "tiny", *SHORT))
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert "reward model" in " ".join((proc.stdout + proc.stderr).split())
    assert not (tmp_path / "o").exists()


@pytest.fixture
def reward_file(tmp_path):
    f = tmp_path / "rewards.py"
    f.write_text("import time\n"
                 "def boom(prompt, completion, **row):\n    raise RuntimeError('bad reward')\n"
                 "def flaky(prompt, completion, **row):\n    if len(completion) % 2:\n        raise ValueError('odd')\n"
                 "    return float(len(completion) % 4 == 0)\n"
                 "def slow(prompt, completion, **row):\n    time.sleep(600)\n    return 1.0\n"
                 "def one(prompt, completion, **row):\n    return 1.0\n"
                 "def sorted_ok(prompt, completion, **row):\n    return float(completion.split() == row['answer'].split())\n")
    return f


def test_reward_error_fails_clearly_or_is_skipped(tmp_path, reward_file):
    proc = run(align("grpo", "--out", str(tmp_path / "fail"), "--reward", f"{reward_file}:boom", *SHORT, *SMALL))
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "bad reward" in text and "on completion" in text and "Traceback" not in text
    art = json.loads((tmp_path / "fail" / "artifact.json").read_text())
    assert art["status"] == "failed" and "bad reward" in art["reason"]  # never left "running"
    ok = run(align("grpo", "--out", str(tmp_path / "skip"), "--reward", f"{reward_file}:flaky",
                   "--on-reward-error", "skip", *SHORT, *SMALL))
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    steps = [r for r in metric_rows(tmp_path / "skip") if "reward" in r]
    assert all(0 < r["rewards/errors"] < 1 for r in steps)  # the failures are counted, the run goes on


def test_a_reward_function_that_never_returns_times_out(tmp_path, reward_file):
    t = time.time()
    proc = run(align("grpo", "--out", str(tmp_path / "slow"), "--reward", f"{reward_file}:slow", "--reward-timeout",
                     "1", *SHORT, *SMALL))
    text = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2 and "took longer than 1 s" in text and "Traceback" not in text, text[-3000:]
    assert time.time() - t < 120


def health(out):
    return [json.loads(line) for line in (out / "health.jsonl").read_text().splitlines()]


def test_a_short_run_without_training_signal_completes_with_a_warning(tmp_path, reward_file):
    """A constant reward (a task the model already solves looks the same): every group has zero spread, every
    advantage is 0, nothing is learned. A 2-step run is shorter than no_signal's 50-step window: RLMonitor judges it
    as a whole at its end and warns, and the run completes (exit 0) with its model, under --on-alarm stop too (a
    smoke test passed, not a run that cannot learn). The policy's entropy on its own samples is still measured."""
    for mode in ("warn", "stop"):
        out = tmp_path / f"flat-{mode}"
        proc = run(align("grpo", "--out", str(out), "--reward", f"{reward_file}:one", "--on-alarm", mode, *SHORT,
                         *SMALL))
        said = " ".join((proc.stdout + proc.stderr).split())
        assert proc.returncode == 0, said[-3000:]
        steps = [r for r in metric_rows(out) if "reward" in r]
        assert all(r["frac_reward_zero_std"] == 1.0 and r["signal_frac"] == 0.0 and r["entropy"] > 1.0 for r in steps)
        assert [(e["rule"], e["severity"], e["step"]) for e in health(out) if e["rule"] == "no_signal"] == [
            ("no_signal", "warn", 2)]
        assert "health warn: no_signal at step 2" in said and "a warning, not a stop" in said
        art = json.loads((out / "artifact.json").read_text())
        assert art["status"] == "complete" and (out / "model").is_dir() and not art["health"]["stop"]


def test_a_reward_that_fails_on_every_row_stops_the_run(tmp_path, reward_file):
    """--on-reward-error skip with a function that always raises: every sample skipped, reward 0.0 logged. Not a
    "complete" run: reward_errors stops it after 5 steps in a row, or at the end of a shorter run."""
    for steps, at in (("6", 5), ("2", 2)):
        out = tmp_path / f"boom{steps}"
        proc = run(align("grpo", "--out", str(out), "--reward", f"{reward_file}:boom", "--on-reward-error", "skip",
                         *SHORT, "--max-steps", steps, "--eval-samples", "0", *SMALL))
        said = " ".join((proc.stdout + proc.stderr).split())
        assert proc.returncode == 2 and "Traceback" not in said, said[-3000:]  # the reward is bad input
        assert f"health stop: reward_errors at step {at}" in said
        assert all(r["rewards/errors"] == 1.0 for r in metric_rows(out) if "reward" in r)
        assert health(out)[0]["rule"] == "reward_errors" and health(out)[0]["step"] == at
        art = json.loads((out / "artifact.json").read_text())
        assert art["status"] == "failed" and f"RLMonitor stop at step {at}: reward_errors" in art["reason"]
        assert "fn(prompt, completion, **row)" in art["reason"]


def test_sort_task_with_a_user_reward_file(tmp_path, reward_file):
    from align.paths import DATA_DIR

    out = tmp_path / "sort"
    proc = run(align("grpo", "--out", str(out), *SHORT, "--data", str(DATA_DIR / "sort/train.jsonl"),
                     "--eval-data", str(DATA_DIR / "sort/test.jsonl"), "--reward", f"{reward_file}:sorted_ok",
                     "--reward", "sort_inclusion:0.5", "--reward", parity_reward()))  # the tiny model sorts nothing
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [r for r in metric_rows(out) if "reward" in r]
    assert "rewards/rewards.sorted_ok" in steps[0] and "rewards/sort_inclusion" in steps[0]


def test_bad_grpo_flags_exit_2(tmp_path):
    for args, needle in ((["--advantage", "median"], "--advantage"), (["--num-generations", "1"], ">= 2"),
                         (["--reward", "nope"], "unknown reward")):
        proc = run(align("grpo", "--out", str(tmp_path / "x"), *args))
        assert proc.returncode == 2 and needle in proc.stdout + proc.stderr, proc.stdout + proc.stderr


@pytest.mark.parametrize("flags, needle", [({"loss": "ppo2"}, "--loss must be"), ({"ratio": "sequence", "loss": "cispo"}, "GSPO"),
                                           ({"micro_batch_tokens": 0}, "--micro-batch-tokens must be >= 1, got 0"),
                                           ({"teacher": "tiny", "distill_coef": 0.0}, "--distill-coef must be > 0, got 0.0"),
                                           ({"reinforce": True, "loss": "cispo"}, "--reinforce has no importance ratio")])
def test_bad_combinations_of_the_policy_objective_are_refused(flags, needle):
    """Checked by the config (every entry point: flags, --config, pipeline validate) before anything runs."""
    from align.errors import UserError
    from stages.grpo import GRPOConfig

    with pytest.raises(UserError, match=needle):
        GRPOConfig(**flags).validate()
