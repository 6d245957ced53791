"""Disk space: a run that cannot save what it will write stops before training (exit 2, --out as it was); a save
that no longer fits mid-run is refused with the last checkpoint kept; a write the disk cuts off leaves nothing
partial; --keep-checkpoints keeps N; the model lands in model/ first, as sharded safetensors.

Each `align` command runs in a process forked from a server that imported the stage modules once, with
`shutil.disk_usage` (and what else a test needs to see) patched inside it: one stage per process, as the CLI
runs them (a stage ends its process group when it exits, and DeepSpeed's caches do not survive that)."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from align.artifacts import hash_tree
from align.engine import checkpoint, disk
from tests.conftest import _DIST_ENV, small_data

SFT = ["sft", "--data", small_data()["arith"], "--eval-data", "", "--batch-size", "8", "--eval-every", "0"]
EVAL = ["--eval-data", small_data()["arith_test"], "--eval-samples", "2", "--max-new-tokens", "4"]
MiB = 2**20


def _patch_free(free: int, when: str | None) -> None:
    """shutil.disk_usage says `free` bytes are free (once the path `when` exists; before, the real number)."""
    real = shutil.disk_usage

    def usage(path):
        u = real(path)
        return type(u)(u.total, u.used, free if when is None or Path(when).exists() else u.free)

    shutil.disk_usage = usage


def _patch_measure(log: str) -> None:
    """Each checkpoint save appends [the bytes disk.checkpoint_bytes expects, the bytes of the .pt files written]."""
    save = checkpoint.save

    def measured(out, step, engines, state, dist, keep=1):
        expected = sum(disk.checkpoint_bytes(e) for e in engines.values())
        save(out, step, engines, state, dist, keep)
        written = sum(f.stat().st_size for f in (Path(out) / "checkpoints" / f"step{step}").rglob("*.pt"))
        with open(log, "a") as f:
            f.write(json.dumps([expected, written]) + "\n")

    checkpoint.save = measured


def _patch_crash_eval() -> None:
    """The last evaluation (after the model is saved: it checks) raises."""
    from stages.sft import SFT as Algorithm

    evaluate = Algorithm.evaluate

    def crash_at_the_end(self, step):
        if step == self.cfg.max_steps:
            assert (self.run.out / "model" / "config.json").is_file()
            raise RuntimeError("the evaluation crashed")
        return evaluate(self, step)

    Algorithm.evaluate = crash_at_the_end


def _child(argv: list[str], log: str, patches: dict) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)
    for k in _DIST_ENV:  # this process's own group, not one the test process may have started
        os.environ.pop(k, None)
    if "free" in patches:
        _patch_free(*patches["free"])
    if "measure" in patches:
        _patch_measure(patches["measure"])
    if patches.get("crash_eval"):
        _patch_crash_eval()
    sys.argv = ["align", *argv]
    from align.cli import main

    main()


@pytest.fixture(scope="module")
def processes():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "deepspeed", "align.cli", "stages.sft", "tests.test_disk"])
    return ctx


def align_patched(processes, log: Path, *args, **patches) -> tuple[int, str]:
    """`align ARGS` with `patches` applied in its process: (exit code, what it printed, on one line)."""
    proc = processes.Process(target=_child, args=([str(a) for a in args], str(log), patches))
    proc.start()
    proc.join(300)
    return proc.exitcode, " ".join(log.read_text().split())


def files(out: Path) -> dict:
    return hash_tree(out) if out.exists() else {}


@pytest.fixture(scope="module")
def kept(processes, tmp_path_factory):
    """A 4-step run checkpointing every step with --keep-checkpoints 2 (ZeRO-3: one optimiser shard per rank),
    each save's expected and written bytes measured: (its --out, the measurements, exit code, output)."""
    d = tmp_path_factory.mktemp("kept")
    out, measured = d / "run", d / "measured.jsonl"
    code, said = align_patched(processes, d / "log", *SFT, "--max-steps", "4", "--save-every", "1",
                               "--keep-checkpoints", "2", "--zero-stage", "3", "--schedule", "constant", "--out", out,
                               measure=str(measured))
    assert code == 0, said
    return out, [json.loads(line) for line in measured.read_text().splitlines()]


def test_a_run_that_cannot_save_stops_before_training_and_leaves_out_as_it_was(processes, kept, tmp_path):
    """Exit 2 before the first step, a message with the bytes needed and free and the flags that save less; a new
    --out is not created, an earlier artifact in --out (rerun, --resume) keeps every byte."""
    out = tmp_path / "run"
    args = [*SFT, "--max-steps", "4", "--save-every", "1", "--keep-checkpoints", "2", "--zero-stage", "3",
            "--schedule", "constant"]  # `kept`'s run: a --resume may grow --max-steps under a constant schedule
    code, said = align_patched(processes, tmp_path / "log", *args, "--out", out, free=(5 * MiB, None))
    assert code == 2 and "Traceback" not in said, said
    assert "not enough free disk space for what this run saves" in said and "nothing was written" in said
    found = re.search(r"the model ([\d.]+) MiB \+ 3 checkpoints of ([\d.]+) MiB need ([\d.]+) MiB more and "
                      r"([\d.]+) MiB are free", said)  # 3: the 2 kept and the one being written
    assert found, said
    model, ckpt, need, free = map(float, found.groups())
    written = kept[1][0][1] / MiB
    assert free == 5.0 and abs(ckpt - written) < 0.02 * written and need >= model + 3 * ckpt
    for flag in ("--no-final-checkpoint", "--save-every", "--keep-checkpoints 1", "--lora-r", "--out"):
        assert flag in said, (flag, said)
    assert not out.exists()

    shutil.copytree(kept[0], out)
    before = files(out)
    for again in (["--overwrite"], ["--resume", "--max-steps", "5"]):  # a rerun that would replace it, a resume
        code, said = align_patched(processes, tmp_path / "log", *args, *again, "--out", out, free=(5 * MiB, None))
        assert code == 2 and "not enough free disk space for what this run saves" in said, said
        assert files(out) == before and {p.name for p in out.iterdir()} == {Path(k).parts[0] for k in before}


def test_a_save_that_no_longer_fits_is_refused_and_the_last_checkpoint_kept(processes, tmp_path):
    """The disk fills up during the run: the checkpoint at step 2 is refused before it is written (exit 2, the
    artifact failed with the reason), step 1's stays, and --resume continues from it once there is room."""
    out = tmp_path / "run"
    args = [*SFT, "--max-steps", "3", "--save-every", "1", "--out", out]
    code, said = align_patched(processes, tmp_path / "log", *args,
                               free=(5 * MiB, str(out / "checkpoints" / "latest")))
    assert code == 2 and "Traceback" not in said, said
    reason = json.loads((out / "artifact.json").read_text())["reason"]
    assert "not enough free disk space for the checkpoint at step 2" in reason and "(step1) is kept" in reason
    assert "--resume" in reason and "".join(reason.split()) in "".join(said.split())  # a long path may fold anywhere
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step1"]
    assert not (out / "model").exists() and not (out / "model.tmp").exists()

    code, said = align_patched(processes, tmp_path / "log", *args, "--resume")
    assert code == 0 and "resumed from the checkpoint at step 1" in said, said


def test_a_write_the_disk_cuts_off_leaves_no_partial_checkpoint(tmp_path):
    """torch's zip writer failing half-way (the error a full disk gives) removes stepN.tmp/ and raises DiskFull;
    `latest` and the checkpoint it names are untouched."""
    class Engine:
        def save_checkpoint(self, path, tag, save_latest):
            (Path(path) / tag).mkdir(parents=True)
            (Path(path) / tag / "mp_rank_00_model_states.pt").write_bytes(b"x" * 1000)
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 37240583616 vs 37240583512")

    class Dist:
        rank, world_size, is_main = 0, 1, True

    good = tmp_path / "checkpoints" / "step1"
    good.mkdir(parents=True)
    (good / "state.json").write_text("{}")
    (tmp_path / "checkpoints" / "latest").write_text("step1\n")
    before = files(tmp_path)
    with pytest.raises(disk.DiskFull, match=r"disk filled up while the checkpoint at step 2 was written.*unexpected pos"):
        checkpoint.save(tmp_path, 2, {"policy": Engine()}, {}, Dist())
    assert files(tmp_path) == before and not (tmp_path / "checkpoints" / "step2.tmp").exists()
    assert disk.is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert not disk.is_disk_full(RuntimeError("CUDA out of memory"))


def test_keep_checkpoints_keeps_the_newest_n_and_the_estimate_matches_the_files(kept):
    """--keep-checkpoints 2 with a checkpoint every step: the last two remain, `latest` names the newest. The
    bytes the disk check expects of a checkpoint are those written, short of the zip format's few KB of headers
    and the pickled config."""
    out, measured = kept
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step3", "step4"]
    assert checkpoint.latest(out) == "step4" and len(measured) == 4
    for expected, written in measured:
        assert 0.98 * written <= expected <= written, measured


def test_the_model_lands_first_as_sharded_safetensors(processes, tmp_path):
    """A small --max-shard-size gives model-0000k-of-0000n.safetensors and an index (artifact.json hashes each
    shard; transformers loads them). No room left for the final checkpoint once the model is saved: the run
    completes without it and says so. The model is in model/ before the last evaluation: one that crashes
    leaves it there; --no-final-checkpoint writes no checkpoint."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    code, said = align_patched(processes, tmp_path / "log", *SFT, "--max-steps", "2", "--max-shard-size", "500KB",
                               "--out", out, free=(5 * MiB, str(out / "model")))
    assert code == 0, said
    model = out / "model"
    shards = sorted(p.name for p in model.glob("*.safetensors"))
    index = json.loads((model / "model.safetensors.index.json").read_text())
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards), shards
    assert not list(model.glob("*.bin")) and not (model / "model.safetensors").exists()
    art = json.loads((out / "artifact.json").read_text())
    assert art["status"] == "complete" and {f"model/{s}" for s in shards} <= set(art["files"])
    assert art["final_checkpoint"].startswith("skipped: ") and "end-of-run checkpoint is skipped" in said
    assert checkpoint.latest(out) is None
    loaded = AutoModelForCausalLM.from_pretrained(model)
    assert set(index["weight_map"]) <= set(loaded.state_dict())

    out = tmp_path / "crash"
    code, said = align_patched(processes, tmp_path / "log", *SFT, *EVAL, "--max-steps", "2",
                               "--no-final-checkpoint", "--out", out, crash_eval=True)
    assert code == 1 and "the evaluation crashed" in said, said
    assert json.loads((out / "artifact.json").read_text())["status"] == "failed"
    assert (out / "model" / "model.safetensors").is_file() and not (out / "checkpoints").exists()


def test_run_peak_and_shortage_arithmetic():
    """Checkpoints on disk at once: the kept ones + the one being written; the model is saved before the final
    checkpoint. Needs add up per filesystem over the ranks writing to it."""
    assert disk.run_peak(present=0, writes=0, final=True, keep=1) == (0, 1)
    assert disk.run_peak(present=0, writes=5, final=True, keep=1) == (2, 2)
    assert disk.run_peak(present=0, writes=1, final=False, keep=3) == (1, 1)
    assert disk.run_peak(present=0, writes=9, final=True, keep=3) == (4, 4)
    assert disk.run_peak(present=3, writes=1, final=True, keep=1) == (4, 2)  # --keep-checkpoints lowered on resume

    def share(fs, ckpt, model=0, free=10**9):
        return disk.Share((fs, 1), free, ckpt, (fs, 1), free, model)

    gib = 2**30
    # 2 ranks on one disk, one on another: each disk holds its ranks' shards; rank 0 also writes the model
    shares = [share("a", 3 * gib, model=2 * gib, free=12 * gib), share("a", 3 * gib, free=12 * gib),
              share("b", 3 * gib, free=4 * gib)]
    short = disk.shortage(shares, checkpoints=2, model=True)
    assert short is not None and short.free == 12 * gib and short.writers == 2 and short.ckpt == 6 * gib
    assert short.need == int(14 * gib * (1 + disk.SLACK_FRACTION)) + disk.SLACK_BYTES
    assert "the model 2.00 GiB + 2 checkpoints of 6.00 GiB (2 processes write ~3.00 GiB of each)" == short.what()
    assert disk.shortage(shares, checkpoints=1) is None  # one checkpoint: 6 GiB on a, 3 GiB on b
    # a checkpoint already on disk counts as used: only the new one and the model need room
    assert disk.shortage([share("a", gib, model=gib, free=3 * gib)], checkpoints=2, model=True, present=1) is None


def test_disk_flags_are_checked():
    from align.errors import UserError
    from stages.sft import SFTConfig

    with pytest.raises(UserError, match="--keep-checkpoints must be >= 1, got 0"):
        SFTConfig(keep_checkpoints=0).validate()
    with pytest.raises(UserError, match="--max-shard-size must be a size such as 5GB"):
        SFTConfig(max_shard_size="lots").validate()
