"""Checkpoints for exact resume: every trained engine (model, optimiser, LR schedule), each rank's RNG states, and
the run's own state (step, the stage's state such as PPO's β, RLMonitor's windows, the first evaluation).

    checkpoints/step40/policy/   DeepSpeed checkpoint of the engine named "policy" (ZeRO shards of every rank)
    checkpoints/step40/value/    ... one folder per trained engine
    checkpoints/step40/state.json, rng-rank0.json, rng-rank1.json
    checkpoints/latest           "step40", written last (atomic rename): a checkpoint is complete or ignored

A checkpoint is written into step40.tmp/ and renamed step40/ once every rank has written its part; a write that
fails (a full disk) removes the temporary directory. `latest` then names it, and the newest --keep-checkpoints
complete checkpoints are kept (the older ones are deleted only after the new one is complete).

Written by align and read back only from the run's own --out with --resume (DeepSpeed's files are torch pickles).
"""

from __future__ import annotations

import base64
import json
import random
import re
import shutil
from pathlib import Path

from align.artifacts import write_json_atomic
from align.config import PREFLIGHT
from align.engine import disk
from align.errors import UserError

DIR = "checkpoints"
TMP = ".tmp"  # a checkpoint being written: checkpoints/step40.tmp/
APPLIED = {"lr", "vf_lr"}  # may change on --resume: the new value is applied from the resume point on
RESUMABLE = {"resume", "max_steps", "save_every", "eval_every", "eval_data", "eval_samples", "eval_k", "eval_pairs",
             "pass_data", "monitor", "on_alarm", "out", "nproc", "gather", "nnodes", "node_rank", "master_addr", "master_port",
             "compile", "keep_checkpoints", "final_checkpoint", "max_shard_size", *PREFLIGHT}
# (RESUMABLE: they may change; they do not alter the path to the checkpoint: the launch, the evaluation, the length)


def latest(out: Path) -> str | None:
    f = Path(out) / DIR / "latest"
    return f.read_text().strip() if f.is_file() else None


def conflicts(saved: dict, now: dict) -> list[str]:
    """The settings of `now` that differ from the checkpoint's (`saved`) and would change the run's path."""
    return sorted(k for k, v in saved.items() if k not in RESUMABLE | APPLIED and now.get(k) != v)


def budget_conflict(saved: dict, now: dict, step: int) -> str | None:
    """Why a run with `now`'s max_steps cannot continue the checkpoint at `step` of a run with `saved`'s; None when it
    can: the same budget, or a constant learning rate (the rate of no step depends on the budget) and a checkpoint
    not past the new end. Continued, the run is then the one the new budget gives from the start."""
    old, new = saved.get("max_steps"), now.get("max_steps")
    if old == new:
        return None
    if step > new:
        return f"the checkpoint is at step {step}, past the new end"
    if saved.get("schedule") != "constant":
        return (f"the checkpoint is at step {step} of a {saved.get('schedule')} learning-rate schedule over {old} steps, "
                f"and a {new}-step run has another learning rate at every step after the warmup")
    return None


def _rng_state() -> dict:
    import numpy as np
    import torch

    def b64(t) -> str:
        return base64.b64encode(t.numpy().tobytes()).decode()

    state = {"python": random.getstate(), "torch": b64(torch.get_rng_state())}
    np_state = np.random.get_state()
    state["numpy"] = [np_state[0], np_state[1].tolist(), *np_state[2:]]
    if torch.cuda.is_available():
        state["cuda"] = b64(torch.cuda.get_rng_state())
    return state


def _set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    def tensor(s: str):
        return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(tensor(state["torch"]))
    np.random.set_state((state["numpy"][0], np.array(state["numpy"][1], dtype=np.uint32), *state["numpy"][2:]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensor(state["cuda"]))


def steps(out: Path) -> list[int]:
    """The steps of the complete checkpoints in `out`, oldest first."""
    root = Path(out) / DIR
    found = [int(m[1]) for d in (root.iterdir() if root.is_dir() else ()) if (m := re.fullmatch(r"step(\d+)", d.name))
             and (d / "state.json").is_file()]
    return sorted(found)


def remove_partial(out: Path) -> None:
    """Delete what a killed or failed save left behind (checkpoints/*.tmp, *.old): never resumed from."""
    root = Path(out) / DIR
    for d in root.glob("step*") if root.is_dir() else ():
        if d.name.endswith((TMP, ".old")):
            shutil.rmtree(d, ignore_errors=True)


def save(out: Path, step: int, engines: dict, state: dict, dist, keep: int = 1) -> None:
    """Write checkpoint `step` (every rank calls this) into stepN.tmp/, rename it stepN/, point `latest` at it
    and delete all but the newest `keep` checkpoints. A write that fails for want of space removes stepN.tmp/
    and raises disk.DiskFull; the checkpoints already there stay."""
    from align import runtime

    root = Path(out) / DIR
    tag = f"step{step}"
    tmp = root / (tag + TMP)
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # a killed save's leftovers
    runtime.barrier()
    try:
        for name, eng in engines.items():
            eng.save_checkpoint(str(tmp), tag=name, save_latest=False)
        tmp.mkdir(parents=True, exist_ok=True)
        write_json_atomic(tmp / f"rng-rank{dist.rank}.json", _rng_state())
        if dist.is_main:
            write_json_atomic(tmp / "state.json", {"step": step, "world_size": dist.world_size, **state})
    except Exception as e:
        if not disk.is_disk_full(e):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise disk.DiskFull(f"{root}: the disk filled up while the checkpoint at step {step} was written "
                            f"({str(e).strip()[:200]}); its partial files were removed.") from None
    runtime.barrier()
    if dist.is_main:
        _publish(root, tag, keep)
    runtime.barrier()


def _publish(root: Path, tag: str, keep: int) -> None:
    """stepN.tmp/ -> stepN/ (a checkpoint of the same step already there is replaced), `latest` -> stepN, then
    every other directory deleted but the newest keep - 1 complete checkpoints before it."""
    final, old = root / tag, root / (tag + ".old")
    if final.exists():  # the same step saved again (a resumed run that ends where it resumed)
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    (root / (tag + TMP)).rename(final)
    pointer = root / "latest.tmp"
    pointer.write_text(tag + "\n")
    pointer.replace(root / "latest")
    step = int(tag.removeprefix("step"))
    kept = {f"step{s}" for s in [s for s in steps(root.parent) if s < step][-(keep - 1):]} if keep > 1 else set()
    for d in root.iterdir():
        if d.is_dir() and d.name != tag and d.name not in kept:
            shutil.rmtree(d, ignore_errors=True)


def read_state(out: Path) -> dict:
    """The run state of the latest checkpoint (plain JSON: readable before anything is loaded or written)."""
    root = Path(out) / DIR
    tag = latest(out)
    state_file = root / str(tag) / "state.json"
    if tag is None or not state_file.is_file():
        raise UserError(f"{root}: no complete checkpoint to resume from; run without --resume.")
    return json.loads(state_file.read_text())


def check_world_size(out: Path, state: dict, world_size: int) -> None:
    """A checkpoint is resumed by as many processes as wrote it."""
    if state["world_size"] != world_size:
        raise UserError(f"{Path(out) / DIR / latest(out)}: written by {state['world_size']} processes, resumed "
                        f"with {world_size}; resume with --nproc {state['world_size']}.")


def load(out: Path, engines: dict, dist) -> dict:
    """Restore every engine and this rank's RNG from the latest checkpoint; returns the run state."""
    root, tag = Path(out) / DIR, latest(out)
    state = read_state(out)
    check_world_size(out, state, dist.world_size)
    for name, eng in engines.items():
        path, _ = eng.load_checkpoint(str(root / tag), tag=name)
        if path is None:
            raise UserError(f"{root / tag / name}: checkpoint could not be loaded; run without --resume.")
    _set_rng_state(json.loads((root / tag / f"rng-rank{dist.rank}.json").read_text()))
    return state
