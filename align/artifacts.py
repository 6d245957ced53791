"""Stage artifacts: one directory per stage run, written so that a dead stage never looks complete.

Layout of `--out DIR`:
  artifact.json    stage, version, git commit, resolved config, inputs (+sha256), final metrics, status
  model/           save_pretrained directory (safetensors + tokenizer), loadable without align
  metrics.jsonl    one JSON line per step (and per evaluation)
  health.jsonl     RLMonitor events
  report.png       training curves
  tensorboard/ wandb/ trackio/ mlruns/   the --report-to trackers' local stores (align.trackers)
  checkpoints/     DeepSpeed checkpoints for --resume

`artifact.json` is written with status "running" when a stage starts and replaced (atomic rename) by the
"complete" version only after everything else is on disk. The model is written to `model.tmp/` and renamed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from align import __version__
from align.errors import UserError
from align.paths import split_spec

ARTIFACT_FILE = "artifact.json"
MODEL_DIR = "model"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def hash_tree(root: Path) -> dict[str, str]:
    """sha256 of every file below `root`, keyed by relative path."""
    return {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


@contextlib.contextmanager
def atomic_open(path):
    """A text file that appears at `path` (its folder made) only once the block completes: written as
    path.tmpPID, then os.replace'd over it, so a reader sees the old file or the whole new one, never half; on an
    error the temporary file is removed and `path` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            yield f
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path, text: str) -> None:
    with atomic_open(path) as f:
        f.write(text)


def write_json_atomic(path: Path, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")


def _readable(folder: Path) -> None:
    """Files with the permissions the umask gives (transformers writes model.safetensors 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    for f in folder.rglob("*"):
        if f.is_file():
            f.chmod(0o666 & ~umask)


def _json_or_none(line: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def git_commit(root: Path | None = None) -> str | None:
    """The commit of the align checkout that runs (None outside a git checkout), with "-dirty" appended when its
    tracked files differ from that commit (as `git describe --dirty`): an artifact made by edited code says so."""
    cwd = root or Path(__file__).parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=cwd)
        sha = out.stdout.strip()
        if not sha:
            return None
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], capture_output=True, timeout=5, cwd=cwd)
        return sha + ("-dirty" if dirty.returncode == 1 else "")
    except (OSError, subprocess.SubprocessError):
        return None


def read_artifact(path: Path) -> dict | None:
    f = Path(path) / ARTIFACT_FILE
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{f}:{e.lineno}: artifact.json is not valid JSON; rerun the stage that wrote it.") from None


def fail_if_running(out: Path, since: float, reason: str) -> bool:
    """The launcher's backstop: artifact.json in `out`, written since `since` (this launch) and still "running"
    after its processes ended badly, is marked failed with `reason` (no rank lived to say why: e.g. the
    launcher SIGKILLed ranks still blocked in a collective with a dead peer). True when it did."""
    f = Path(out) / ARTIFACT_FILE
    try:
        if f.stat().st_mtime < since:
            return False
        record = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if record.get("status") != "running":
        return False
    record.update(status="failed", reason=reason)
    write_json_atomic(f, record)
    return True


def verify_artifact(path: Path) -> dict:
    """Return the artifact record of a complete, untampered artifact; else a UserError saying what to do."""
    path = Path(path)
    art = read_artifact(path)
    if art is None:
        raise UserError(f"{path}: no {ARTIFACT_FILE}; not an align artifact.")
    if art.get("status") != "complete":
        raise UserError(
            f"{path}: artifact is incomplete (status {art.get('status')!r}): its stage did not finish. "
            "Rerun that stage (or the pipeline) before using it."
        )
    for rel, digest in art.get("files", {}).items():
        f = path / rel
        if not f.is_file():
            raise UserError(f"{path}: artifact file {rel} is missing; rerun the stage that wrote it.")
        if sha256_file(f) != digest:
            raise UserError(f"{f}: sha256 does not match artifact.json (file changed after the stage finished).")
    return art


def artifact_digest(path: Path) -> str:
    """A short identity for an input artifact: the sha256 of its artifact.json."""
    return sha256_file(Path(path) / ARTIFACT_FILE)


class ArtifactWriter:
    """Writes one stage's artifact. Create on every rank; only rank 0 touches the disk."""

    def __init__(self, out: str | Path, stage: str, config: dict, inputs: dict, is_main: bool = True,
                 started: float | None = None, notes: dict | None = None, choices: dict | None = None):
        """`started`: when the stage's work began (time.time()), where that was before its artifact was opened (a
        data stage samples first and opens its artifact to write); default now. artifact.json's `started` and
        `wall_seconds` count from it. `notes`: more keys of artifact.json, from the start (the verifier a stage
        chose). `choices`: what the run chose itself ({option: {"value", "why"}}: a precision left at auto, a
        default learning rate, ...), recorded as artifact.json's "choices"."""
        self.out = Path(out)
        self.stage, self.config, self.inputs, self.is_main = stage, config, inputs, is_main
        self.started = time.time() if started is None else started
        # more sinks of every metrics row and RLMonitor event, with log(step, metrics), events([dict]) and
        # finish(status): the --report-to experiment trackers (align.trackers.Trackers)
        self.sinks: list = []
        if not is_main:
            return
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            probe = self.out / f".write-test{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise UserError(f"{self.out}: output directory is not writable ({e.strerror}); choose another --out.") from None
        self.record = {
            "stage": stage,
            "status": "running",
            "align_version": __version__,
            "git_commit": git_commit(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started)),
            "config": config,
            "inputs": inputs,
            **(notes or {}),
            **({"choices": choices} if choices else {}),
        }
        write_json_atomic(self.out / ARTIFACT_FILE, self.record)
        self._metrics = open(self.out / "metrics.jsonl", "a" if config.get("resume") else "w")
        self._health = open(self.out / "health.jsonl", "a" if config.get("resume") else "w")

    def rewind(self, step: int, health: bool = True) -> None:
        """On --resume from a checkpoint at `step`: forget the metric lines and health events a killed run wrote
        after it (and a line it was killed in the middle of). `health=False` (a rollback): the metrics only."""
        if not self.is_main:
            return
        files = (("metrics.jsonl", self._metrics), ("health.jsonl", self._health))
        for name, f in files[: 2 if health else 1]:
            f.close()
            path = self.out / name
            kept = [line for line in path.read_text().splitlines() if (row := _json_or_none(line)) and row["step"] <= step]
            path.write_text("".join(line + "\n" for line in kept))
        self._metrics = open(self.out / "metrics.jsonl", "a")
        if health:
            self._health = open(self.out / "health.jsonl", "a")

    @property
    def running(self) -> bool:
        """Still "running": neither complete nor failed (always False off rank 0, which writes nothing)."""
        return self.is_main and self.record["status"] == "running"

    @property
    def model_tmp(self) -> Path:
        return self.out / (MODEL_DIR + ".tmp")

    def log(self, step: int, metrics: dict) -> None:
        if self.is_main:
            self._metrics.write(json.dumps({"step": step, **metrics}) + "\n")
            self._metrics.flush()
            for sink in self.sinks:
                sink.log(step, metrics)

    def log_events(self, events) -> None:
        if self.is_main:
            for e in events:
                self._health.write(json.dumps(e.to_dict()) + "\n")
            self._health.flush()
            for sink in self.sinks:
                sink.events([e.to_dict() for e in events])

    def begin_model(self) -> Path:
        """Directory to write the model into; `complete()` moves it to model/."""
        if self.is_main:
            shutil.rmtree(self.model_tmp, ignore_errors=True)
            self.model_tmp.mkdir(parents=True)
        return self.model_tmp

    def fail(self, reason: str, metrics: dict | None = None, health: dict | None = None) -> None:
        if not self.is_main:
            return
        self.record.update(status="failed", reason=reason, metrics=metrics or {}, health=health or {})
        write_json_atomic(self.out / ARTIFACT_FILE, self.record)
        self._close()
        for sink in self.sinks:
            sink.finish("failed")

    def land_model(self) -> None:
        """Move a finished model.tmp/ to model/ (rank 0)."""
        if self.is_main and self.model_tmp.exists():
            _readable(self.model_tmp)
            final = self.out / MODEL_DIR
            shutil.rmtree(final, ignore_errors=True)
            os.replace(self.model_tmp, final)

    def complete(self, metrics: dict, health: dict | None = None, extra: dict | None = None,
                 status: str = "complete") -> None:
        """model.tmp/ (if any) to model/, then artifact.json with `status`: "complete", or "stopped" (a run that
        --on-alarm stop ended early, its model kept)."""
        if not self.is_main:
            return
        self.land_model()
        files = {}
        for name in (MODEL_DIR,):
            if (self.out / name).is_dir():
                files.update({f"{name}/{k}": v for k, v in hash_tree(self.out / name).items()})
        self._close()
        self.record.update(
            status=status,
            finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            wall_seconds=round(time.time() - self.started, 2),
            metrics=metrics,
            health=health or {},
            files=files,
            **(extra or {}),
        )
        write_json_atomic(self.out / ARTIFACT_FILE, self.record)
        for sink in self.sinks:
            sink.finish(status)  # a run --on-alarm stop ended is "stopped" there too, not "complete"

    def _close(self) -> None:
        for f in (self._metrics, self._health):
            if not f.closed:
                f.close()


def describe_code(paths: list[str]) -> dict[str, str]:
    """{path: sha256} of the user's Python files a run reads (reward functions, verifiers), for artifact.json's
    inputs ("missing" for one that is gone)."""
    return {str(p): sha256_file(Path(p)) if Path(p).is_file() else "missing" for p in paths}


def describe_inputs(source, *data_paths: str) -> dict:
    """{'model': {...}, 'data': {path: sha256}} for artifact.json: what this run was made from (`source`: a
    models.ModelSource)."""
    model = {"spec": source.spec}
    if source.artifact is not None:
        model.update(artifact=str(Path(source.spec).resolve()), sha256=artifact_digest(Path(source.spec)),
                     stage=source.artifact.get("stage"))
    elif source.model_dir is not None:
        model.update(dir=str(source.model_dir.resolve()), files=hash_tree(source.model_dir))
    data = {}
    for p in data_paths:
        if p:  # a file, a folder, DIR:SPLIT (the folder's digest) or a Hub dataset NAME[:SPLIT] (named, not hashed)
            path = Path(p) if Path(p).exists() else Path(split_spec(str(p))[0])
            data[str(Path(p))] = (sha256_file(path) if path.is_file() else hash_tree(path) if path.is_dir()
                            else "hub dataset")
    return {"model": model, "data": data}
