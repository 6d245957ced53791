"""Disaggregated GRPO (--rollout-gpus) on CPU with gloo: decoder ranks sample, trainer ranks train, the weights
cross the bridge after every update. The same runs as one colocated process (staleness 0 and 1), the decoder's
log-probs are the updated policy's, and a killed decoder fails the run honestly and quickly; --resume continues."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from align.runtime import free_port
from tests.conftest import _DIST_ENV, AlignProcess, assert_same_training, parity_reward, small_sft, worker_pid

FIXTURES = Path(__file__).parent / "fixtures"
ARGS = ["--prompts-per-step", "4", "--num-generations", "4", "--max-new-tokens", "8", "--micro-batch-size", "8",
        "--eval-samples", "4", "--eval-k", "1", "--lr", "3e-3", "--warmup-steps", "0", "--reward", "math", *small_sft()]


def command(args, nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
            "-m", "align", *map(str, args)]


def start(args, nproc: int = 1, timeout: int = 60):
    """Forked with the imports done (tests/conftest.py: AlignProcess): one process, or torchrun's launcher of more,
    in a new process group."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env.update(ALIGN_DIST_TIMEOUT=str(timeout), COLUMNS="300")
    if nproc == 1:
        return AlignProcess(args, env, stderr_to_stdout=True)
    return AlignProcess(command(args, nproc)[3:], env, stderr_to_stdout=True, module="torch.distributed.run",
                        new_session=True)


def finish(proc, code: int = 0, timeout: float = 300) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == code, out[-4000:]
    return out


def rows(out) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    """Staleness 0: one colocated process and 1 trainer + 1 decoder, with multi-turn episodes where this machine can
    isolate a user's environment (the decoder runs them, the environment beside it); staleness 1 (TIS): one
    colocated process and 2 trainers + 1 decoder (ZeRO-3 over the trainers, the weights gathered from their
    shards)."""
    from align.tools.sandbox import isolation

    root = tmp_path_factory.mktemp("disagg")
    grpo = ["grpo", "--model", tiny_model_dir, "--max-steps", "3", "--reward", parity_reward(), *ARGS]
    stale = ["--max-staleness", "1", "--tis-cap", "2"]
    # an environment that answers "Wrong, try again" until the third turn, turns ending at common texts
    env = ["--env", f"{FIXTURES / 'user_env.py'}:ShortTurns", "--max-turns", "3"] if isolation() else []
    plan = {"sync": (env, 1), "sync_disagg": ([*env, "--rollout-gpus", "1"], 2),
            "stale": (stale, 1), "stale_disagg": ([*stale, "--rollout-gpus", "1"], 3)}
    for name, (extra, nproc) in plan.items():  # one at a time: 2 cores
        finish(start([*grpo, *extra, "--out", root / name], nproc))
    return root


def test_staleness_0_on_a_decoder_rank_is_the_colocated_run(runs, tiny_model_dir):
    assert_same_training(runs / "sync", runs / "sync_disagg", tiny_model_dir, rel=1e-5, weights_rel=1e-4,
                         ignore=("rollout/staleness",))
    # bit for bit: the same samples (the decoder's plain copy decodes as the gathered ZeRO-3 module does), losses,
    # gradients and weights; only the sampler's own log-probs differ, in the last bits of fp32
    step = [[(r["loss"], r["grad_norm"], r["reward"]) for r in rows(runs / n) if "loss" in r] for n in ("sync", "sync_disagg")]
    assert step[0] == step[1]
    from safetensors.torch import load_file

    a, b = (load_file(runs / n / "model" / "model.safetensors") for n in ("sync", "sync_disagg"))
    assert all(a[k].equal(b[k]) for k in a)
    art = json.loads((runs / "sync_disagg" / "artifact.json").read_text())
    assert art["status"] == "complete" and art["world_size"] == 1 and art["rollout_gpus"] == 1
    from align.tools.sandbox import isolation

    if isolation():  # the decoder's episodes: several turns, the environment's tokens out of the loss
        got = [r for r in rows(runs / "sync_disagg") if "loss" in r]
        assert max(r["num_turns/mean"] for r in got) > 1 and max(r["episodes/env_tokens"] for r in got) > 0


def test_the_decoder_samples_from_the_updated_weights(runs):
    """Staleness 0: the decoder's sampling log-probs are the trainer's π_old at every step, to fp32 rounding, while
    each update moves the policy by far more (the staleness-1 run's gap): the weights reached the decoder."""
    fresh = [r["rollout/logp_abs_diff"] for r in rows(runs / "sync_disagg") if "rollout/logp_abs_diff" in r]
    moved = [r["rollout/stale_logp_abs_diff"] for r in rows(runs / "stale_disagg") if "rollout/stale_logp_abs_diff" in r]
    assert len(fresh) == 3 and max(fresh) < 1e-5
    assert len(moved) == 2 and min(moved) > 1e-3


def test_staleness_1_with_decoder_ranks_is_the_one_process_algorithm(runs, tiny_model_dir):
    """Rollout t + 1 is sampled from θ_t while step t trains: the same samples, losses and weights as the one-process
    queue (2 ZeRO-3 trainers: float reduction order aside)."""
    assert_same_training(runs / "stale", runs / "stale_disagg", tiny_model_dir)
    got = rows(runs / "stale_disagg")
    assert [r["rollout/staleness"] for r in got if "rollout/staleness" in r] == [0, 1, 1]
    assert all(r["time/wait"] >= 0 and r["time/wait_decoder"] >= 0 for r in got if "loss" in r)


@pytest.mark.parametrize("victim, nproc, rank, reason", [
    ("decoder", 2, 1, "the decoder ranks (--rollout-gpus) stopped answering"),
    ("trainer", 3, 1, "gloo")])  # 2 trainers + 1 decoder: trainer 1; trainer 0 says what its collective met
def test_a_killed_rank_fails_the_run_at_once_and_resume_continues(tiny_model_dir, tmp_path, victim, nproc, rank,
                                                                  reason):
    out = tmp_path / "g"
    args = ["grpo", "--model", tiny_model_dir, "--max-steps", "6", "--save-every", "1", "--reward", parity_reward(),
            *ARGS, "--eval-samples", "0", "--rollout-gpus", "1", "--max-staleness", "1", "--out", out]
    proc = start(args, nproc, timeout=600)  # no hang: the loss of the peer is noticed at once, not after a timeout
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not any(r["step"] >= 2 for r in rows(out)):
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before a rank could be killed"
    os.kill(worker_pid(out, rank), signal.SIGKILL)
    t = time.time()
    said = finish(proc, code=1, timeout=120)
    assert time.time() - t < 60, said[-3000:]
    art = json.loads((out / "artifact.json").read_text())
    assert art["status"] == "failed" and reason in art["reason"], (victim, art)
    assert not (out / "model").exists()
    resumed = finish(start([*args, "--resume"], nproc))
    assert "resumed from the checkpoint at step" in " ".join(resumed.split())
    assert json.loads((out / "artifact.json").read_text())["status"] == "complete"
    assert [r["step"] for r in rows(out) if "loss" in r][-1] == 6


def test_a_failing_run_drops_the_bridge_without_a_stop_message():
    """A run that fails (a trainer gone mid-collective) aborts the bridge: a decoder may be mid-exchange and would
    never match a "stop", and that broadcast would block in C past the launcher's SIGKILL, before the run could
    write its failure. A run that ends well says "stop" first."""
    from align.rollout import disagg

    said = []

    class Bridge:
        def send(self, msg):
            said.append(("send", msg))

        def abort(self):
            said.append(("abort",))

        def close(self):
            said.append(("close",))

    sampler = disagg.RemoteSampler.__new__(disagg.RemoteSampler)
    sampler.bridge = Bridge()
    sampler.close(failed=True)
    assert said == [("abort",)] and sampler.bridge is None
    said.clear()
    sampler.bridge = Bridge()
    sampler.close()
    assert said == [("send", {"op": "stop"}), ("close",)] and sampler.bridge is None
