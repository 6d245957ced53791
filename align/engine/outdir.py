"""--out: a run writes only into a directory that is new, empty or an align artifact, never into one of its own
inputs, and one run at a time (a lock file naming the holder's PID). A finished artifact is never replaced by
accident: a complete one needs --overwrite (or --resume to continue it), and another stage's needs --overwrite; an
unfinished run of the stage with a checkpoint (interrupted, killed, stopped) needs --resume or --overwrite, since a
run that started over would delete the checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

from align.artifacts import ARTIFACT_FILE, read_artifact
from align.config import Options, TrainConfig
from align.engine import checkpoint
from align.errors import UserError

LOCK = ".lock"


def check(cfg: Options, stage: str) -> None:
    """Refuse, before anything is written, an --out that holds someone else's files, is one of the inputs, or
    holds an artifact this run of `stage` must not replace. `cfg`: a command's options with --out and
    --overwrite (a training stage's --resume too)."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: --out is a file; give a directory (new, empty, or an earlier run's).")
    for name, value in cfg.paths().items():
        if name != "out" and value and Path(value).exists():
            if Path(value).resolve() == out.resolve():
                raise UserError(f"--out {out} is also --{name.replace('_', '-')}: the run would overwrite its own "
                                "input. Choose another --out.")
    if out.is_dir() and not (out / ARTIFACT_FILE).exists():
        foreign = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise UserError(f"{out}: --out holds files that are not an align artifact ({shown}); they would be "
                            "overwritten. Choose a new or empty directory.")
    if out.is_dir() and (out / ARTIFACT_FILE).exists():
        _check_artifact(stage, out, cfg.overwrite, cfg.resume if isinstance(cfg, TrainConfig) else None)


def _check_artifact(stage: str, out: Path, overwrite: bool, resume: bool | None) -> None:
    """--out holds an artifact: a run continues it (--resume, same stage), replaces it (--overwrite), or reruns
    a failed run of its own stage that left no checkpoint; a complete artifact, another stage's, or a checkpoint
    the rerun would delete is refused otherwise. `resume`: None for a command without --resume."""
    try:
        art = read_artifact(out) or {}
        have, status = art.get("stage"), art.get("status")
        what = f"a {status} {have} artifact"
    except UserError:
        art, have, status, what = {}, None, None, "a damaged artifact (its artifact.json is not JSON)"
    if resume and have != stage:
        raise UserError(f"{out}: holds {what}; --resume continues a {stage} run in its own --out.")
    if resume or overwrite:
        return
    if have != stage:
        raise UserError(f"{out}: holds {what}, which this {stage} run would replace. Choose another --out, or pass "
                        "--overwrite to replace it.")
    if status == "complete":
        finished = f" (finished {art['finished']})" if art.get("finished") else ""
        cont = ", --resume with a larger --max-steps to continue it" if resume is not None else ""
        raise UserError(f"{out}: holds a complete {stage} artifact{finished}. Pass --overwrite to replace it{cont}, "
                        "or choose another --out.")
    tag = checkpoint.latest(out) if resume is not None else None
    if tag and checkpoint.steps(out) and holder(out) is None:  # (a live run's lock is refused when --out is taken)
        what = {"running": "a killed", "failed": "a failed", "stopped": "a stopped"}.get(status, "an unfinished")
        why = f" ({art['reason']})" if art.get("reason") else ""
        raise UserError(f"{out}: holds {what} {stage} run{why} with its checkpoint at {tag.replace('step', 'step ')}. "
                        "--resume continues it from there; --overwrite starts over and deletes the checkpoint; or "
                        "choose another --out.")


def holder(out: Path) -> int | None:
    """The PID of a live process holding `out`'s lock (not this one), else None."""
    try:
        pid = int((Path(out) / LOCK).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if pid == os.getpid():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None  # a stale lock: its run died (SIGKILL)
    except PermissionError:
        pass
    return pid


def refuse_if_locked(out: Path) -> None:
    pid = holder(out)
    if pid is not None:
        raise UserError(f"{out}: in use by another align run (PID {pid}); wait for it, stop it (kill {pid}), or "
                        "choose another --out.")


def lock(out: Path) -> Path:
    """Take `out`'s lock (a stale one is taken over); returns the lock file, to remove at the end. The PID is
    written before the lock appears (a hard link of a finished file), so a reader never sees it empty."""
    path, mine = out / LOCK, out / f"{LOCK}.{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        mine.write_text(f"{os.getpid()}\n")
    except OSError as e:
        raise UserError(f"{out}: output directory is not writable ({e.strerror}); choose another --out.") from None
    try:
        while True:
            refuse_if_locked(out)
            try:
                os.link(mine, path)
                return path
            except FileExistsError:
                if holder(out) is None:
                    path.unlink(missing_ok=True)  # stale: its run died
    finally:
        mine.unlink(missing_ok=True)
