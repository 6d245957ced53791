"""RLMonitor's rollout_mismatch on real runs of the tiny model: the decoder's sampling log-probs against the
trainer's. A healthy decoder (HF generate or the fast decoder, fp32) agrees to ~1e-7 nats/token and the rule stays
quiet; a decoder whose weight copy stops being refreshed at step k (benchmarks.faults) makes it fire at once."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import parity_reward, run_command, small_data

GRPO = ["grpo", "--model", "tiny", "--max-steps", "4", "--prompts-per-step", "4", "--num-generations", "4",
        "--max-new-tokens", "8", "--eval-data", "", "--warmup-steps", "0"]


def run_with_fault(fault: str, onset: int, args: list[str]):
    import os

    env = {**os.environ, "COLUMNS": "500"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    # forked with the imports done (tests/conftest.py: AlignProcess)
    return run_command([sys.executable, "-m", "benchmarks.faults", fault, str(onset), *map(str, args)], env)


def rows(out, name):
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


@pytest.mark.parametrize("fault", ["stale_decoder", "stale_fast_decoder"])
def test_a_stale_decoder_copy_fires_at_once_and_a_fresh_one_never(tmp_path, fault):
    """Rollouts from step index 2 on decode with the weights of step 1 (lr 5e-5, GRPO's default): the logged steps
    1-2 agree to < 1e-5 (quiet), step 3 is off by > 1e-3 and rollout_mismatch fires there, once (debounced)."""
    out = tmp_path / "g"
    proc = run_with_fault(fault, 2, [*GRPO, "--out", out, "--reward", parity_reward(), "--data",
                                     small_data()["arith"], "--lr", "5e-5"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    diffs = [r["rollout/logp_abs_diff"] for r in rows(out, "metrics.jsonl") if "rollout/logp_abs_diff" in r]
    assert len(diffs) == 4
    assert max(diffs[:2]) < 1e-5 and min(diffs[2:]) > 1e-3
    events = [(e["step"], e["rule"]) for e in rows(out, "health.jsonl") if e["rule"] == "rollout_mismatch"]
    assert events == [(3, "rollout_mismatch")]


def test_ppo_logs_the_mismatch_and_a_stale_copy_fires(tmp_path, tiny_model_dir, tiny_reward_model_dir):
    out = tmp_path / "p"
    proc = run_with_fault("stale_decoder", 2, [
        "ppo", "--out", out, "--model", tiny_model_dir, "--reward-model", tiny_reward_model_dir, "--max-steps", "3",
        "--prompts-per-step", "4", "--minibatch-size", "4", "--micro-batch-size", "4", "--max-new-tokens", "8",
        "--ppo-epochs", "1", "--ptx-coef", "0", "--eval-data", "", "--data", small_data()["arith"], "--lr", "1e-4"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    diffs = [r["rollout/logp_abs_diff"] for r in rows(out, "metrics.jsonl") if "rollout/logp_abs_diff" in r]
    assert max(diffs[:2]) < 1e-5 and diffs[2] > 1e-3
    assert [e["step"] for e in rows(out, "health.jsonl") if e["rule"] == "rollout_mismatch"] == [3]
