"""Multi-process ZeRO-3 on CPU (gloo): 2 ranks match 1 rank, parameters are really sharded, generation agrees
(a killed stage and its resume: tests/test_resume.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.conftest import AlignProcess, run_command, small_sft

STEPS = 8
SFT_ARGS = ["--max-steps", str(STEPS), "--batch-size", "8", "--eval-every", "0", "--eval-samples", "16",
            "--max-new-tokens", "16", "--lr", "3e-3", "--warmup-steps", "2", *small_sft()]


def align_cmd(*args, nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "align", *args]
    from align.runtime import free_port

    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
            "-m", "align", *args]


def env() -> dict:
    # A rank that waits for a peer which never comes fails after 120 s instead of gloo's 30 minutes.
    return {**os.environ, "ALIGN_DIST_TIMEOUT": "120"}


def run(cmd, timeout=600):
    proc = run_command(cmd, env(), timeout)  # one process: forked with the imports done (conftest: AlignProcess)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def assert_same_curve(a: list[float], b: list[float], rel: float = 1e-4) -> None:
    """Both runs logged STEPS losses, equal step by step within `rel` (float reduction order aside)."""
    assert len(a) == len(b) == STEPS, (a, b)
    for x, y in zip(a, b):
        assert abs(x - y) <= rel * max(1.0, abs(x)), (a, b)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    # ZeRO-3 on both (one process would otherwise run ZeRO-0, whose preset init is not zero.Init's), every tensor
    # sharded, even tiny ones, so partitioning is visible
    shard_all = root / "ds.json"
    shard_all.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    one, two = root / "one", root / "two"
    run(align_cmd("sft", "--out", str(one), "--deepspeed", str(shard_all), *SFT_ARGS))
    run(align_cmd("sft", "--out", str(two), "--deepspeed", str(shard_all), *SFT_ARGS, nproc=2))
    return root, one, two


def test_replicas_on_two_processes_match_one_process(tmp_path):
    """--zero-stage 0 on 2 processes (replicas: each holds the whole model and optimizer, DeepSpeed all-reduces the
    gradients; the fast synchronous choice on GPUs for a model that fits one) trains as one process does: the
    same losses and, at the end, the same saved weights."""
    from safetensors.torch import load_file

    one, two = tmp_path / "one", tmp_path / "two"
    run(align_cmd("sft", "--out", str(one), "--zero-stage", "0", *SFT_ARGS))
    run(align_cmd("sft", "--out", str(two), "--zero-stage", "0", *SFT_ARGS, nproc=2))
    a, b = losses(one), losses(two)
    assert_same_curve(a, b)
    assert a[-1] < a[0]
    art = json.loads((two / "artifact.json").read_text())
    assert art["world_size"] == 2 and art["status"] == "complete"
    wa, wb = (load_file(d / "model" / "model.safetensors") for d in (one, two))
    assert wa.keys() == wb.keys() and all((wa[k] - wb[k]).abs().max() <= 1e-4 for k in wa)


def test_two_processes_match_one_process_loss_curve(runs):
    _, one, two = runs
    a, b = losses(one), losses(two)
    # Same global batches, loss normalised by the global token count: only float reduction order differs.
    assert_same_curve(a, b)
    assert a[-1] < a[0]  # and it is learning


def test_each_rank_holds_only_its_shard(runs):
    _, _, two = runs
    art = json.loads((two / "artifact.json").read_text())
    part = art["zero_partition"]
    assert art["world_size"] == 2
    total = part["params"]
    shards = part["shard_per_rank"]
    assert len(shards) == 2
    for s in shards:  # each rank owns about half (ZeRO pads each tensor to a multiple of the world size)
        assert total / 2 <= s <= total / 2 + 64 * len(shards) * 20
    assert part["resident_per_rank"] == [0, 0]  # nothing kept whole outside forward/backward


def test_generation_does_not_depend_on_the_number_of_processes_or_the_batch_size(runs, tmp_path):
    """`align eval` with one seed: the same greedy answers, the same samples and so the same sampled pass@k for
    any --nproc and --batch-size, ZeRO-3 weights gathered for generation or not (each prompt's sampling noise
    comes from the seed and its index: align/rollout/sampling.py). One run of two processes, batches of 5 (against the
    default 64) and the ZeRO-3 shards not gathered, against one process: a dependence on any of the three shows;
    two processes gathering the weights against one: test_lora.py's --no-merge test (`align eval --nproc 2`)."""
    _, _, two = runs
    outs = {}
    for name, nproc, extra in (("one", 1, []), ("two", 2, ["--batch-size", "5", "--no-gather"])):
        out = tmp_path / name
        run(align_cmd("eval", str(two), "--out", str(out), "--k", "1,4", "--limit", "24", "--max-new-tokens", "12",
                      "--temperature", "1.0", *extra, nproc=nproc))
        rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        metrics = json.loads((out / "artifact.json").read_text())["metrics"]
        outs[name] = ([r["greedy"] for r in rows], [r["samples"] for r in rows],
                      {k: v for k, v in metrics.items() if k.startswith("pass@")})
    greedy, samples, passk = outs["one"]
    assert len(greedy) == 24 and all(len(s) == 4 for s in samples) and {"pass@1", "pass@4"} <= set(passk)
    assert len({x for s in samples for x in s}) > 24  # really sampling: a problem's samples differ
    assert outs["one"] == outs["two"]


def test_launch_env_gives_each_process_its_share_of_cores(monkeypatch):
    """torchrun would pin each process to 1 OpenMP thread (CPU Adam with --offload-optimizer then ran on one core
    per GPU); `align --nproc N` gives each process cores // N, and keeps a value the user set."""
    from align.runtime import launch_env

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))
    assert launch_env(2)["OMP_NUM_THREADS"] == "16"
    assert launch_env(64)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in launch_env(1)
    assert launch_env(2)["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "600"  # torchrun's 30 s would cut a checkpoint off
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert launch_env(2)["OMP_NUM_THREADS"] == "3"


def test_offload_threads_hint():
    from align.engine.build import offload_threads_hint

    assert "OMP_NUM_THREADS=16" in offload_threads_hint(local_world=2, threads=1, cores=32)
    assert offload_threads_hint(local_world=2, threads=16, cores=32) is None
    assert offload_threads_hint(local_world=2, threads=1, cores=2) is None  # the CI machine: 1 core each
    assert offload_threads_hint(local_world=1, threads=8, cores=8) is None


def test_two_nodes_of_one_process_match_one_node_of_two(runs):
    """`align sft --nnodes 2 --node-rank R --master-addr A --master-port P` started once per "node" (here both on
    localhost, one process each) runs the same 2-rank job as one node with --nproc 2: the same loss curve."""
    from align.runtime import free_port

    root, _, two = runs
    out, port = root / "nodes", free_port()
    nodes = [AlignProcess(["sft", "--out", str(out), "--deepspeed", str(root / "ds.json"), *SFT_ARGS, "--nnodes", "2",
                           "--node-rank", str(r), "--master-addr", "127.0.0.1", "--master-port", str(port)], env(),
                          stderr_to_stdout=True) for r in (0, 1)]
    logs = [p.communicate(timeout=600)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(x[-3000:] for x in logs)
    assert "on node 1 of 2" in logs[1]
    assert_same_curve(losses(two), losses(out), rel=1e-6)


def test_a_node_rank_outside_nnodes_is_refused():
    from align.config import StageConfig
    from align.errors import UserError

    with pytest.raises(UserError, match=r"--node-rank must be in 0\.\.1"):
        StageConfig(nnodes=2, node_rank=2)


def test_the_launcher_marks_a_run_failed_when_no_rank_lived_to_say_why(tmp_path):
    """`align sft --nproc 2` with both workers SIGKILLed mid-run (as torchrun does to ranks still blocked in a
    collective 30 s after a peer died): nobody in the run can write its failure, so the launching process marks
    artifact.json failed instead of leaving it "running"."""
    import signal
    import time

    from tests.conftest import worker_pid

    out = tmp_path / "killed"
    args = ["sft", "--out", str(out), "--nproc", "2", *SFT_ARGS]
    args[args.index("--max-steps") + 1] = "100000"
    proc = AlignProcess(args, env(), stderr_to_stdout=True)  # the launcher; torchrun's workers are new interpreters
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not (out / "metrics.jsonl").exists():
        time.sleep(0.1)
    assert proc.poll() is None and json.loads((out / "artifact.json").read_text())["status"] == "running"
    for pid in [worker_pid(out, rank) for rank in (0, 1)]:
        os.kill(pid, signal.SIGKILL)
    said, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, said[-3000:]
    art = json.loads((out / "artifact.json").read_text())
    assert art["status"] == "failed" and "before rank 0 could say why" in art["reason"], said[-3000:]
    assert "marked failed" in " ".join(said.split())
