"""Process lifecycle and --out safety: a killed launcher takes its workers with it, one run at a time per --out, a
run never writes over foreign files or its own input, bad flags never touch a finished artifact, a NaN stop keeps
the last good checkpoint, and an interrupted pipeline stage resumes (SIGTERM / SIGINT: tests/test_sft_lifecycle.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import (_DIST_ENV, AlignProcess, align_env, assert_user_error, output, processes_mentioning,
                            run_align, small_data, small_sft)

FAST = ["--batch-size", "8", "--eval-every", "0", "--eval-samples", "4", "--max-new-tokens", "4", "--lr", "3e-3",
        *small_sft()]


def popen(*args, **kw):
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env.update(COLUMNS="500", ALIGN_DIST_TIMEOUT="120")
    return subprocess.Popen([sys.executable, "-m", "align", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, **kw)


def wait_for_steps(proc, out: Path, n: int = 1, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = out / "metrics.jsonl"
        if m.exists() and len([x for x in m.read_text().splitlines() if '"loss"' in x]) >= n:
            return
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    pytest.fail("the run did not start training in time")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killing_the_launcher_of_a_two_process_run_leaves_no_process_behind(tiny_model_dir, tmp_path, sig):
    out = tmp_path / f"sft-{sig.name}"
    launcher = popen("sft", "--model", tiny_model_dir, "--out", out, "--nproc", "2", *FAST, "--max-steps", "100000")
    wait_for_steps(launcher, out)
    assert len(processes_mentioning(str(out))) >= 3  # align, torchrun, 2 workers
    launcher.send_signal(sig)
    # SIGKILL: gone within 10 s. SIGTERM is a graceful stop: the workers finish their step and checkpoint it first
    # (seconds, more on a machine as busy as the test suite makes it), then they exit.
    limit = 10 if sig == signal.SIGKILL else 60
    deadline = time.time() + limit
    while processes_mentioning(str(out)) and time.time() < deadline:
        time.sleep(0.2)
    left = processes_mentioning(str(out))
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running {limit} s after {sig.name} to the launcher: {left}"
    launcher.communicate(timeout=30)
    if sig == signal.SIGTERM:  # the workers heard of it: the artifact says why it stopped
        art = json.loads((out / "artifact.json").read_text())
        assert art["status"] == "failed" and "SIGTERM" in art["reason"]


def test_a_second_run_into_a_locked_out_exits_2_naming_the_holder(tiny_model_dir, tmp_path):
    out = tmp_path / "sft"
    first = AlignProcess(["sft", "--model", tiny_model_dir, "--out", out, *FAST, "--max-steps", "100000"],
                         align_env({"ALIGN_DIST_TIMEOUT": "120"}), stderr_to_stdout=True)  # forked: conftest
    try:
        wait_for_steps(first, out)
        said = assert_user_error(run_align("sft", "--model", tiny_model_dir, "--out", out, *FAST, "--max-steps", "1"),
                                 "in use by another align run", f"PID {first.pid}")
        assert "kill" in said
        assert json.loads((out / "artifact.json").read_text())["status"] == "running"  # the first run's, intact
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    assert not (out / ".lock").exists()  # released when the run ended


def test_out_with_foreign_files_or_equal_to_an_input_is_refused(tiny_model_dir, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    (mine / "model").mkdir()
    assert_user_error(run_align("sft", "--model", tiny_model_dir, "--out", mine, *FAST, "--max-steps", "1"),
                      "not an align artifact", "notes.txt")
    assert (mine / "notes.txt").read_text() == "keep me" and (mine / "model").is_dir()
    assert_user_error(run_align("sft", "--model", tiny_model_dir, "--out", tiny_model_dir, *FAST, "--max-steps", "1"),
                      "is also --model", "overwrite its own input")


def test_a_bad_flag_over_a_finished_artifact_leaves_it_complete(tiny_model_dir, tmp_path):
    out = tmp_path / "sft"
    proc = run_align("sft", "--model", tiny_model_dir, "--out", out, *FAST, "--max-steps", "1")
    assert proc.returncode == 0, output(proc)
    before = (out / "artifact.json").read_text()
    assert_user_error(run_align("sft", "--model", tiny_model_dir, "--out", out, "--lr", "-1"), "--lr must be >= 0, got -1.0.")
    assert (out / "artifact.json").read_text() == before and json.loads(before)["status"] == "complete"
    assert oct((out / "model" / "model.safetensors").stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_a_nan_stop_keeps_the_last_good_checkpoint_and_says_what_to_do(tiny_model_dir, tmp_path):
    out = tmp_path / "sft"
    proc = run_align("sft", "--model", tiny_model_dir, "--out", out, *FAST[:-2], "--lr", "1e6", "--save-every", "1",
                     "--warmup-steps", "0", "--schedule", "constant", "--max-steps", "40")
    assert proc.returncode == 1, output(proc)
    art = json.loads((out / "artifact.json").read_text())
    stop = int(art["reason"].split("at step ")[1].split(":")[0])
    good = (out / "checkpoints" / "latest").read_text().strip()
    assert art["status"] == "failed" and "nan" in art["reason"] and int(good.removeprefix("step")) < stop
    assert f"the last good checkpoint ({good}) is kept" in art["reason"] and "--lr" in art["reason"]
    assert "fp16 (not" not in art["reason"] and "max_grad_norm" not in art["reason"]


def test_an_interrupted_pipeline_stage_resumes_from_its_checkpoint(tiny_model_dir, tmp_path):
    toml = tmp_path / "p.toml"
    toml.write_text(f'[pipeline]\nout = "{tmp_path / "runs"}"\n\n[stages.sft]\nmodel = "{tiny_model_dir}"\n'
                    'max_steps = 30\nbatch_size = 8\neval_every = 0\neval_samples = 4\nmax_new_tokens = 4\n'
                    f'save_every = 1\ndata = "{small_data()["arith"]}"\neval_data = "{small_data()["arith_test"]}"\n')
    out = tmp_path / "runs" / "sft"
    proc = popen("pipeline", "run", toml, start_new_session=True)
    wait_for_steps(proc, out, 3)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    step = (out / "checkpoints" / "latest").read_text().strip()
    again = run_align("pipeline", "run", toml)
    said = " ".join(output(again).split())
    assert again.returncode == 0 and f"resuming from its {step} checkpoint" in said, said[-3000:]
    assert f"resumed from the checkpoint at {step.replace('step', 'step ')}" in said
    assert json.loads((out / "artifact.json").read_text())["status"] == "complete"


def test_an_exception_marks_the_artifact_failed_with_its_message(tmp_path):
    """Any error after --out is opened ends with artifact.json "failed" and the error, and the lock released."""
    from align.engine.run import StageRun
    from stages.model_init import ModelInitConfig

    out = tmp_path / "m"
    with pytest.raises(RuntimeError):
        with StageRun(ModelInitConfig(out=str(out)), "model-init") as run:
            run.open({}, distributed=False)
            assert (out / ".lock").read_text().split()[0] == str(os.getpid())
            raise RuntimeError("boom")
    art = json.loads((out / "artifact.json").read_text())
    assert art["status"] == "failed" and art["reason"] == "RuntimeError: boom" and not (out / ".lock").exists()


def test_the_process_group_is_ended_before_the_interpreter_exits():
    """A gloo group left alive at interpreter teardown can abort a finished worker (SIGABRT: "terminate called
    without an active exception"), so the CLI ends it: after a clean exit and after a failure alike."""
    script = ("import sys, torch.distributed as td\n"
              "from align import runtime\n"
              "runtime.init()\n"
              "assert td.is_initialized() and td.get_backend() == 'gloo'\n"
              "runtime.shutdown(clean=sys.argv[1] == 'clean')\n"
              "print('initialized after shutdown:', td.is_initialized(), runtime._DIST)\n")
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    for how in ("clean", "failed"):
        proc = subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True, env=env,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "initialized after shutdown: False None" in proc.stdout, (how, proc.stdout, proc.stderr[-2000:])
