"""SFT lifecycle: an RLMonitor stop checkpoints, marks the artifact failed and exits non-zero with the rule's
message; SIGTERM / SIGINT leave a failed artifact that says why (exact resume after a kill: tests/test_resume.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import run_command, small_sft

ARGS = ["--max-steps", "40", "--batch-size", "8", "--eval-every", "0", "--eval-samples", "4", "--max-new-tokens", "4",
        "--lr", "3e-3", "--warmup-steps", "2", *small_sft()]


def align(*args):
    return [sys.executable, "-m", "align", *args]


def test_monitor_stop_checkpoints_fails_the_artifact_and_exits_nonzero(tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text('[grad_explode]\nmax_value = 1e-9\nseverity = "stop"\n')  # any gradient "explodes"
    out = tmp_path / "sft"
    proc = run_command(align("sft", "--out", str(out), "--monitor", str(rules), *ARGS), dict(os.environ))
    assert proc.returncode == 1
    assert "grad_explode" in proc.stdout and "Traceback" not in proc.stdout + proc.stderr
    art = json.loads((out / "artifact.json").read_text())
    assert art["status"] == "failed" and "grad_explode" in art["reason"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step1"
    events = [json.loads(line) for line in (out / "health.jsonl").read_text().splitlines()]
    assert events and events[0]["rule"] == "grad_explode" and events[0]["severity"] == "stop"
    assert not (out / "model").exists()


@pytest.mark.parametrize("sig, code, reason", [(signal.SIGTERM, 143, "terminated (SIGTERM)"),
                                              (signal.SIGINT, 130, "interrupted (SIGINT)")])
def test_a_stopped_run_checkpoints_says_so_and_resumes(tmp_path, sig, code, reason):
    """SIGTERM and SIGINT end a run at the end of its step: that step is checkpointed and the artifact is marked
    failed with the reason and how to go on (never left "running"); --resume continues from it."""
    out = tmp_path / "sft"
    args = ["sft", "--out", str(out), *ARGS[2:], "--schedule", "constant"]  # constant: --max-steps may change
    proc = subprocess.Popen(align(*args, "--max-steps", "100000"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.time() + 240
    while time.time() < deadline and not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text()):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    proc.send_signal(sig)
    if sig == signal.SIGTERM:  # one request however often it comes (a dead launcher: one per thread of it)
        time.sleep(0.05)
        proc.send_signal(sig)
    said = proc.communicate(timeout=120)[0]
    assert proc.returncode == code and "Traceback" not in said, said[-3000:]
    art = json.loads((out / "artifact.json").read_text())
    step = int((out / "checkpoints" / "latest").read_text().strip().removeprefix("step"))
    assert art["status"] == "failed" and art["metrics"]["loss"] > 0
    assert art["reason"] == f"{reason} at step {step}; checkpoint saved: continue with --resume"
    if sig == signal.SIGTERM:
        resumed = run_command(align(*args, "--max-steps", str(step + 1), "--resume"), dict(os.environ))
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
        assert f"resumed from the checkpoint at step {step}" in " ".join(resumed.stdout.split())
