"""--on-alarm stop|rollback on real runs of the tiny model, with faults injected (benchmarks.faults)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import parity_reward, small_data
from tests.test_rollout_mismatch import GRPO, rows, run_with_fault


def grpo(out, *extra):
    return [*GRPO, "--out", out, "--reward", parity_reward(), "--data", small_data()["arith"], "--lr", "5e-5", *extra]


def test_stop_keeps_the_best_heldout_weights_and_says_it_stopped(tmp_path):
    """A stale decoder from step index 2 fires rollout_mismatch at step 3: the run ends there (exit 1), model/ holds
    the weights of the best held-out evaluation (steps 0-3, evaluated every step), the artifact says "stopped"."""
    out = tmp_path / "g"
    proc = run_with_fault("stale_decoder", 2, grpo(out, "--on-alarm", "stop", "--eval-data", small_data()["arith_test"],
                                                   "--eval-samples", "8", "--eval-k", "1", "--eval-every", "1"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    art = json.loads((out / "artifact.json").read_text())
    assert art["status"] == "stopped" and art["stopped"]["rule"] == "rollout_mismatch" and art["stopped"]["step"] == 3
    evals = [(r["step"], r["eval/pass@1/greedy"]) for r in rows(out, "metrics.jsonl") if "eval/pass@1/greedy" in r]
    best_step, best = max(evals, key=lambda e: (e[1], -e[0]))  # the first evaluation with the highest pass rate
    assert art["stopped"]["kept"] == {"step": best_step, "key": "eval/pass@1/greedy", "value": best}
    kept_row = next(r for r in rows(out, "metrics.jsonl") if r["step"] == best_step and "eval/pass@1/greedy" in r)
    held_out = {k: v for k, v in art["metrics"].items() if k.startswith("eval/")}
    assert held_out == pytest.approx({k: v for k, v in kept_row.items() if k.startswith("eval/")})
    assert "stopped on an alarm" in art["reason"] and f"step {best_step}" in art["reason"]
    assert (out / "model" / "model.safetensors").is_file() and set(art["files"]) >= {"model/model.safetensors"}


def test_a_stopped_artifact_reports_the_kept_evaluation():
    """PPO over-optimising a weak RM: held-out pass@1 0.45 at step 0, 0.30 at step 5, where heldout_degradation
    stops it; model/ holds step 0's weights, so the artifact's held-out figures are step 0's (not 0.30)."""
    from align.engine.alarm import kept_metrics

    last = {"reward": 0.2, "eval/pass@1/greedy": 0.30, "eval/reward": 0.19, "eval/problems": 100.0}
    best = {"step": 0, "key": "eval/pass@1/greedy", "value": 0.45,
            "metrics": {"eval/pass@1/greedy": 0.45, "eval/reward": 0.05, "eval/problems": 100.0}}
    assert kept_metrics(last, best) == {"reward": 0.2, "eval/pass@1/greedy": 0.45, "eval/reward": 0.05,
                                        "eval/problems": 100.0}
    assert kept_metrics(last, None) == last  # no evaluation ran: this step's weights, this step's figures


def test_rollback_returns_to_the_checkpoint_with_half_the_lr_once(tmp_path):
    """A NaN at step index 3 (logged step 4): nan fires, the run goes back to its checkpoint at step 2, halves the
    learning rate and completes; the rollback is in health.jsonl and artifact.json."""
    out = tmp_path / "g"
    proc = run_with_fault("nan", 3, grpo(out, "--on-alarm", "rollback", "--save-every", "2", "--max-steps", "5",
                                         "--schedule", "constant"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    art = json.loads((out / "artifact.json").read_text())
    assert art["status"] == "complete"
    assert art["rollback"] == {"at": 4, "to": 2, "rule": "nan", "changes": ["learning rate x0.5"], "lr_factor": 0.5}
    metrics = rows(out, "metrics.jsonl")
    assert [r["step"] for r in metrics] == [1, 2, 3, 4, 5]  # the abandoned steps 3-4 are gone
    assert [r["lr"] for r in metrics] == [5e-5, 5e-5, 2.5e-5, 2.5e-5, 2.5e-5]
    health = rows(out, "health.jsonl")
    assert [(e["rule"], e["severity"], e["step"]) for e in health] == [("nan", "stop", 4), ("on_alarm", "rollback", 4)]


def test_rollback_before_any_checkpoint_goes_back_to_the_input_weights(tmp_path):
    """No --save-every: a NaN at step index 2 (logged step 3) rolls the run back to its start (the step-0 checkpoint
    it wrote before training: the input weights, a fresh optimiser) and it continues at half the lr. From there it
    is the run that started at lr 2.5e-5: every step's metrics equal a clean run's at that lr (same weights, same
    data and sampling seeds), which a rollback that kept any trained weight or optimiser state would not give."""
    from align.engine import checkpoint

    out, clean = tmp_path / "g", tmp_path / "clean"
    common = ("--max-steps", "4", "--schedule", "constant")
    proc = run_with_fault("nan", 2, grpo(out, "--on-alarm", "rollback", *common))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    art = json.loads((out / "artifact.json").read_text())
    assert art["status"] == "complete"
    assert art["rollback"] == {"at": 3, "to": 0, "rule": "nan", "changes": ["learning rate x0.5"], "lr_factor": 0.5}
    health = rows(out, "health.jsonl")
    assert [(e["rule"], e["severity"], e["step"]) for e in health] == [("nan", "stop", 3), ("on_alarm", "rollback", 3)]
    assert "the run's start" in health[1]["message"]
    assert checkpoint.steps(out) == [4]  # the final checkpoint replaced the start's
    args = grpo(clean, *common)
    args[args.index("--lr") + 1] = "2.5e-5"
    proc = run_with_fault("none", 0, args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    keys = ("loss", "reward", "grad_norm", "entropy", "lr")
    got, want = rows(out, "metrics.jsonl"), rows(clean, "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    flat = [r[k] for r in got for k in keys]
    assert flat == pytest.approx([r[k] for r in want for k in keys], rel=1e-5, abs=1e-7)
