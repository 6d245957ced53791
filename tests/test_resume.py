"""Exact resume, for every training stage: a run killed with SIGKILL at a random step after its first checkpoint
and resumed with --resume ends with the weights of an uninterrupted run of the same seed and writes the same
metrics.jsonl rows after the resume point (1 process for every stage, 2 processes for grpo; grpo-stale:
rollouts sampled ahead of their step, in one process and on a decoder rank)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import time

import pytest
from safetensors.torch import load_file

from align.engine import checkpoint
from align.runtime import free_port
from tests.conftest import _DIST_ENV, ROOT, AlignProcess, parity_reward, processes_mentioning

STEPS = 6
ARITH = ROOT / "data/arithmetic/train.jsonl"
FIXTURES = ROOT / "tests" / "fixtures"
COMMON = ["--max-steps", str(STEPS), "--warmup-steps", "2", "--eval-every", "3", "--save-every", "1"]
STAGES = {
    "sft": ["sft", "--batch-size", "8", "--lr", "3e-3", "--eval-samples", "4", "--max-new-tokens", "4"],
    "rm": ["rm", "train", "--batch-size", "8", "--lr", "3e-3", "--normalize-samples", "8"],
    # dpo, grpo, ppo: padding-free forwards (--packing), the same numbers whatever the batch's layout
    "dpo": ["dpo", "--batch-size", "8", "--lr", "1e-3", "--eval-pairs", "16", "--eval-samples", "4",
            "--max-new-tokens", "4", "--packing"],
    "grpo": ["grpo", "--prompts-per-step", "4", "--num-generations", "4", "--max-new-tokens", "8", "--eval-samples",
             "4", "--eval-k", "1,2", "--micro-batch-size", "8", "--lr", "1e-3", "--beta", "0.1", "--num-iterations", "2",
             "--packing"],
    # rollouts sampled ahead of their step: the checkpoint holds the queued ones (2 in one process, 1 on a decoder)
    "grpo-stale": ["grpo", "--prompts-per-step", "4", "--num-generations", "4", "--max-new-tokens", "8", "--eval-samples",
                   "4", "--eval-k", "1,2", "--micro-batch-size", "8", "--lr", "1e-3", "--max-staleness", "2",
                   "--tis-cap", "2"],
    # multi-turn episodes (an environment that answers a wrong answer until the third turn), sampled ahead of their
    # step: the checkpoint holds queued episodes (their policy masks, turns, stops) and the environment's rewards
    "grpo-env": ["grpo", "--prompts-per-step", "4", "--num-generations", "2", "--max-new-tokens", "8", "--max-turns",
                 "3", "--eval-samples", "4", "--eval-k", "1", "--micro-batch-size", "8", "--lr", "1e-3",
                 "--max-staleness", "2", "--tis-cap", "2"],
    "ppo": ["ppo", "--model", "tiny", "--prompts-per-step", "4", "--minibatch-size", "2", "--micro-batch-size", "2",
            "--ppo-epochs", "2", "--max-new-tokens", "8", "--ptx-batch-size", "2", "--eval-samples", "4",
            "--packing"],
}
# 1 process: grpo runs what one CUDA process runs by default (ZeRO-0 engines, bf16 weights and moments, AdamW
# with stochastic rounding whose noise comes from the checkpointed RNG); its fp32 ZeRO-3 resume is the 2-process
# test's
ONE_PROCESS = {**STAGES, "grpo": [*STAGES["grpo"], "--zero-stage", "0", "--precision", "bf16-pure"]}
TWO_PROCESS = {**STAGES, "grpo-stale": [*STAGES["grpo-stale"][:-4], "--max-staleness", "1", "--rollout-gpus", "1",
                                        "--tis-cap", "2"]}
TIMING = ("time/", "_per_s")  # wall-clock measurements, the only numbers allowed to differ


def command(args, nproc):
    if nproc == 1:
        return [sys.executable, "-m", "align", *args]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
            "-m", "align", *args]


def start(args, nproc=1):
    """A run in a new process group (a killed run: kill_at ends the group, wait_gone finds its processes by --out),
    forked with the imports done (tests/conftest.py: AlignProcess): the run itself, or torchrun's launcher."""
    cmd = command(args, nproc)
    return AlignProcess(cmd[3:], env(), stderr_to_stdout=True, module=cmd[2], new_session=True)


def launch(args, nproc=1):
    """A run that is not killed: forked with the imports done (tests/conftest.py: AlignProcess), the run itself or
    torchrun's launcher."""
    cmd = command(args, nproc)
    return AlignProcess(cmd[3:], env(), stderr_to_stdout=True, module=cmd[2])


def env() -> dict:
    # one OpenMP thread each: the uninterrupted and the doomed run share the machine's cores
    return {**{k: v for k, v in os.environ.items() if k not in _DIST_ENV}, "OMP_NUM_THREADS": "1",
            "ALIGN_DIST_TIMEOUT": "120"}


def finish(proc, code: int = 0) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == code, out[-3000:]
    return out


def step_lines(out) -> list[dict]:
    path = out / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written
            pass
    return rows


def kill_at(proc, out, step: int) -> None:
    """SIGKILL the whole run (launcher and workers) once it has logged `step`."""
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if any(r["step"] >= step and not any(k.startswith("eval/") for k in r) for r in step_lines(out)):
            break
        time.sleep(0.02)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    wait_gone(out)


def wait_gone(out, timeout: float = 120) -> None:
    """Until no process writes to `out` any more: torchrun's workers live in their own process groups, hear of the
    launcher's death (PR_SET_PDEATHSIG) and may still be saving their last checkpoint."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not processes_mentioning(str(out)):
            return
        time.sleep(0.1)
    pytest.fail(f"processes writing {out} still alive after {timeout} s")


def weights(out) -> dict:
    return load_file(out / "model" / "model.safetensors")


def comparable(rows: list[dict], after: int) -> list[dict]:
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows if r["step"] > after]


def head(path, n: int, out):
    out.write_text("".join(path.read_text().splitlines(keepends=True)[:n]))
    return str(out)


@pytest.fixture(scope="module")
def inputs(tiny_model_dir, tiny_reward_model_dir, tmp_path_factory):
    return stage_inputs(tiny_model_dir, tiny_reward_model_dir, tmp_path_factory.mktemp("resume_data"))


def stage_inputs(tiny_model_dir, tiny_reward_model_dir, d) -> dict:
    """Each stage's model and data arguments, with small data files in d: the shipped ones hold 20k-50k rows,
    seconds of tokenising in every process."""
    arith, prefs = head(ARITH, 256, d / "arith.jsonl"), head(ROOT / "data/prefs/train.jsonl", 128, d / "prefs.jsonl")
    test, ptest = head(ROOT / "data/arithmetic/test.jsonl", 8, d / "test.jsonl"), head(ROOT / "data/prefs/test.jsonl",
                                                                                        16, d / "ptest.jsonl")
    model = ["--model", str(tiny_model_dir)]
    return {"sft": [*model, "--data", arith, "--eval-data", test],
            "rm": [*model, "--data", prefs, "--eval-data", ptest],
            "dpo": [*model, "--data", prefs, "--eval-data", ptest, "--pass-data", test],
            "grpo": [*model, "--data", arith, "--eval-data", test, "--reward", parity_reward()],  # a training signal
            "grpo-stale": [*model, "--data", arith, "--eval-data", test, "--reward", parity_reward()],
            "grpo-env": [*model, "--data", arith, "--eval-data", test, "--env", f"{FIXTURES / 'user_env.py'}:ShortTurns",
                         "--reward", "env"],
            "ppo": ["--reward-model", str(tiny_reward_model_dir), "--data", arith, "--eval-data", test,
                    "--ptx-data", arith]}


def killed_run(args, out, nproc):
    """A run SIGKILLed at a random step after its first checkpoint: (its artifact, the step it resumes from). A
    machine busy enough for the run to finish first gets another try."""
    for _ in range(3):
        shutil.rmtree(out, ignore_errors=True)
        kill_at(start([*args, "--out", str(out)], nproc), out, random.Random().randint(2, STEPS // 2))
        art = json.loads((out / "artifact.json").read_text())
        if art["status"] != "complete":
            return art, int((out / "checkpoints" / "latest").read_text().strip().removeprefix("step"))
    pytest.fail("the run finished three times before it could be killed")


def check_resume(stage, inputs, tmp_path, nproc=1):
    ref, out = tmp_path / "uninterrupted", tmp_path / "killed"
    args = [*(ONE_PROCESS if nproc == 1 else TWO_PROCESS)[stage], *inputs[stage], *COMMON]
    uninterrupted = launch([*args, "--out", str(ref)], nproc)
    art, resumed_at = killed_run(args, out, nproc)
    finish(uninterrupted)
    # SIGKILL: nothing could mark it failed; 2 processes: the workers outlive the killed torchrun long enough to
    # hear of it (PR_SET_PDEATHSIG, once per thread of torchrun) and stop together at the end of their step
    if nproc == 1:
        assert art["status"] == "running"
    else:
        assert art["status"] == "failed" and art["reason"].startswith("terminated (SIGTERM) at step "), art["reason"]
    assert 1 <= resumed_at < STEPS
    assert not (out / "model").exists()
    if stage == "sft":  # an incomplete artifact is refused as an input
        refused = finish(launch(["eval", str(out), "--out", str(tmp_path / "eval")]), code=2)
        assert "incomplete" in refused and "Traceback" not in refused
        # rerun without --resume or --overwrite: refused, the checkpoint kept (a fresh run would delete it)
        refused = " ".join(finish(launch([*args, "--out", str(out)]), code=2).split())
        assert f"holds a killed sft run with its checkpoint at step {resumed_at}" in refused, refused
        assert "--resume continues it from there; --overwrite starts over and deletes the checkpoint" in refused
        assert checkpoint.latest(out) == f"step{resumed_at}"

    said = finish(launch([*args, "--out", str(out), "--resume"], nproc))
    assert f"resumed from the checkpoint at step {resumed_at}" in " ".join(said.split())
    assert json.loads((out / "artifact.json").read_text())["status"] == "complete"
    a, b = weights(ref), weights(out)
    assert a.keys() == b.keys()
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert diff <= 1e-6, f"{stage}: weights differ by {diff} after resuming at step {resumed_at}"
    assert [r["step"] for r in step_lines(out)] == [r["step"] for r in step_lines(ref)]
    assert comparable(step_lines(out), resumed_at) == comparable(step_lines(ref), resumed_at)


def test_resume_applies_a_new_lr_and_refuses_other_changes_before_touching_the_artifact(inputs, tmp_path):
    """A --resume never silently ignores a setting: a new --lr is applied from the resume point on (the optimiser
    state holds the old one); a setting that changes the run's path is refused, named, with the artifact left as
    it was."""
    out = tmp_path / "sft"
    args = [*STAGES["sft"], *inputs["sft"], "--max-steps", "2", "--eval-every", "0", "--schedule", "constant",
            "--warmup-steps", "0", "--out", str(out)]
    finish(launch(args))
    before = (out / "artifact.json").read_text()
    proc = launch([*args, "--resume", "--batch-size", "4"])
    said = proc.communicate(timeout=300)[0]
    assert proc.returncode == 2 and "--batch-size 8 -> 4" in " ".join(said.split()) and "Traceback" not in said
    assert (out / "artifact.json").read_text() == before

    said = finish(launch([*args, "--resume", "--lr", "1e-3", "--max-steps", "3"]))
    assert "--lr 0.003 -> 0.001 from step 2 on" in " ".join(said.split())
    assert [r["lr"] for r in step_lines(out) if "lr" in r] == [3e-3, 3e-3, 1e-3]


def test_checkpoint_holds_rng_algorithm_and_monitor_state(inputs, tmp_path):
    """What a checkpoint holds besides DeepSpeed's engine state: each rank's RNG, the run's own state."""
    out = tmp_path / "sft"
    finish(launch([*STAGES["sft"], *inputs["sft"], "--max-steps", "2", "--eval-every", "0", "--out", str(out)]))
    step = out / "checkpoints" / "step2"
    state = json.loads((step / "state.json").read_text())
    assert state["step"] == 2 and state["config"]["lr"] == 3e-3 and state["last"]["loss"] > 0
    assert len(state["monitor"]["history"]["loss"]) == 2
    rng = json.loads((step / "rng-rank0.json").read_text())
    assert {"python", "torch", "numpy"} <= set(rng) and len(rng["torch"]) > 1000
    assert (step / "policy").is_dir() and not (out / "checkpoints" / "step1").exists()


def test_a_new_max_steps_on_resume_continues_a_constant_schedule_and_is_refused_otherwise(inputs, tmp_path):
    """One rule for a changed budget (by hand here, the same in a pipeline: tests/test_pipeline.py): a checkpoint
    continues to a new --max-steps only when no step's learning rate depends on it (a constant schedule, the
    checkpoint not past the new end), and then the run is the one the new budget gives from the start, recorded in
    artifact.json; otherwise exit 2 names the two ways on, with nothing touched."""
    base = [*STAGES["sft"], *inputs["sft"], "--eval-every", "0", "--warmup-steps", "1"]
    constant, short, full = [*base, "--schedule", "constant"], tmp_path / "short", tmp_path / "full"
    finish(launch([*constant, "--max-steps", "2", "--out", str(short)]))
    said = finish(launch([*constant, "--max-steps", "4", "--out", str(short), "--resume"]))
    assert "--max-steps 2 -> 4: the learning rate is constant" in " ".join(said.split())
    finish(launch([*constant, "--max-steps", "4", "--out", str(full)]))
    art = json.loads((short / "artifact.json").read_text())
    assert art["status"] == "complete" and art["metrics"]["steps"] == 4
    assert art["resumed"] == [{"step": 2, "max_steps": 2}]
    a, b = weights(short), weights(full)
    assert max((a[k].float() - b[k].float()).abs().max().item() for k in a) <= 1e-6

    def refused(args, out, *needles):
        before = (out / "artifact.json").read_text()
        said = " ".join(finish(launch([*args, "--out", str(out), "--resume"]), code=2).split())
        assert "Traceback" not in said and all(n in said for n in needles), said
        assert (out / "artifact.json").read_text() == before

    refused([*constant, "--max-steps", "3"], short, "--max-steps 4 -> 3: the checkpoint is at step 4, past the new "
            "end", "Resume with --max-steps 4, or start over with --max-steps 3 (--overwrite instead of --resume)")
    cosine = tmp_path / "cosine"
    finish(launch([*base, "--max-steps", "2", "--out", str(cosine)]))
    refused([*base, "--max-steps", "4"], cosine, "--max-steps 2 -> 4: the checkpoint is at step 2 of a cosine "
            "learning-rate schedule over 2 steps", "Resume with --max-steps 2, or start over with --max-steps 4")
