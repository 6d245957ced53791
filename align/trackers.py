"""Experiment trackers (`--report-to tensorboard,wandb,trackio,mlflow`): every stage's metrics go to the chosen
trackers as well as to metrics.jsonl, with the same names and values (MLflow, which refuses '@' in a name, gets
`mlflow_name(key)`: pass@1 -> pass_at_1), and the run's config and lineage as the run's parameters; RLMonitor's
events are logged as such (TensorBoard: text summaries; W&B: an alert and an events table; Trackio: alerts;
MLflow: tags and a health.jsonl artifact).

Local by default, inside the run directory, with no network: TensorBoard event files in OUT/tensorboard/, W&B
offline in OUT/wandb/ (WANDB_MODE=online streams to wandb.ai), Trackio's store in OUT/trackio/ (unless TRACKIO_DIR
is set), an MLflow file store in OUT/mlruns/ (unless MLFLOW_TRACKING_URI is set). A fresh run replaces those folders;
a --resume continues the same tracker run (W&B and MLflow by the run id kept in OUT/trackers.json, Trackio by the
run's name, TensorBoard in the same folder), so its curves go on from the checkpoint's step.

Only rank 0 logs (the ArtifactWriter that feeds them writes on rank 0 only). Each tracker is an optional extra
(`pip install 'align[wandb]'`); a missing one is refused when the config is checked, before anything runs. A
tracker that fails mid-run is dropped with one warning: training goes on, metrics.jsonl stays complete.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import re
import shutil
import time
from pathlib import Path

from align.artifacts import write_json_atomic
from align.console import warn
from align.errors import UserError

MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow"}  # name: import
PROJECT = "align"  # W&B project, Trackio project and MLflow experiment (WANDB_PROJECT, MLFLOW_EXPERIMENT_NAME win)


def parse(text: str) -> list[str]:
    """The tracker names of a --report-to value ("" or "none": none); an unknown name is a UserError."""
    names = [n.strip().lower() for n in (text or "").split(",") if n.strip()]
    if names == ["none"]:
        return []
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        raise UserError(f"--report-to: unknown tracker {unknown[0]!r}; choose from {', '.join(MODULES)} "
                        "(comma-separated), or none.", option="report_to")
    return list(dict.fromkeys(names))


def check(text: str) -> list[str]:
    """parse(), and every named tracker installed (else a one-line UserError naming the extra to install)."""
    names = parse(text)
    for name in names:
        if importlib.util.find_spec(MODULES[name]) is None:
            raise UserError(f"--report-to {name}: the {MODULES[name]} package is not installed; install it with "
                            f"pip install 'align[{name}]'.", option="report_to")
    return names


def numbers(metrics: dict) -> dict[str, float]:
    """The finite numbers of a metrics row (what a tracker can plot)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def mlflow_name(key: str) -> str:
    """A metric or parameter name MLflow accepts (alphanumerics, _ - . space : /): '@' -> '_at_', others -> '_'."""
    return re.sub(r"[^\w\-. :/]", "_", key.replace("@", "_at_"))[:250]


def flat(d: dict, prefix: str = "") -> dict[str, object]:
    """A nested dict as {dotted key: scalar}; lists become JSON text, None the text "None"."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat(v, key + "."))
        elif isinstance(v, (bool, int, float, str)):
            out[key] = v
        else:
            out[key] = json.dumps(v, default=str)
    return out


def lineage_params(record: dict, chain: list[dict]) -> dict:
    """The run's lineage as parameters: what align made it with, its inputs (data sha256s, the model), and the
    artifacts upstream of it (stage and directory)."""
    me = chain[-1] if chain else {}
    return {"stage": record.get("stage"), "align_version": record.get("align_version"),
            "git_commit": record.get("git_commit"), "model": me.get("model"), "model_sha256": me.get("model_sha256"),
            "data": me.get("data", {}), "upstream": [f"{e['stage']}: {e['out']}" for e in chain[:-1]]}


def event_text(e: dict) -> str:
    return f"[{e['severity']}] step {e['step']} {e['rule']}: {e.get('detail', '')}. {e['message']}"


# ------------------------------------------------------------------------------------------------- backends


class Tracker:
    """One tracker's run. `start` opens it with the run's parameters, `log` a metrics row, `events` RLMonitor's new
    events (`every`: all so far), `finish` closes it with the run's status (complete | stopped | failed)."""

    name = ""
    local = ""  # the folder in the run directory it writes to (replaced by a fresh run)
    elsewhere = "-"  # the environment variable that sends it somewhere else than `local`

    def __init__(self, out: Path, run_name: str, stage: str):
        self.out, self.run_name, self.stage = out, run_name, stage
        self.resume_id: str | None = None  # the tracker run a --resume continues (set before start)
        self.run_id: str | None = None  # this tracker's run id once started (kept for a later --resume)

    def start(self, config: dict, lineage: dict) -> None: ...

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def events(self, step: int, new: list[dict], every: list[dict]) -> None: ...

    def finish(self, status: str) -> None: ...


class TensorBoard(Tracker):
    name, local = "tensorboard", "tensorboard"

    def start(self, config, lineage):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.w = SummaryWriter(log_dir=str(self.out / self.local))
        params = {k: v if isinstance(v, (bool, int, float, str)) else str(v)
                  for k, v in {**flat(config), **flat(lineage, "lineage.")}.items()}
        for summary in hparams(params, {}):
            self.w.file_writer.add_summary(summary)
        for tag, d in (("config", config), ("lineage", lineage)):
            self.w.add_text(tag, "```\n" + json.dumps(d, indent=2, default=str) + "\n```", 0)
        self.w.flush()

    def log(self, step, values):
        for k, v in values.items():
            self.w.add_scalar(k, v, step)
        self.w.flush()

    def events(self, step, new, every):
        for e in new:
            self.w.add_text(f"health/{e['rule']}", event_text(e), e["step"])
        self.w.flush()

    def finish(self, status):
        self.w.add_text("status", status, 0)
        self.w.close()


class WandB(Tracker):
    name, local = "wandb", "wandb"
    COLUMNS = ("step", "rule", "severity", "metric", "value", "threshold", "detail", "message")

    def start(self, config, lineage):
        import wandb

        self.wandb = wandb
        resume = dict(id=self.resume_id, resume="allow") if self.resume_id else {}
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=self.run_name,
                              job_type=self.stage, dir=str(self.out), mode=os.environ.get("WANDB_MODE") or "offline",
                              config={**config, "lineage": lineage}, **resume,
                              settings=wandb.Settings(console="off", silent=True, save_code=False))
        self.run_id = self.run.id

    def log(self, step, values):
        self.run.log(values, step=step)

    def events(self, step, new, every):
        rows = [[str(e.get(c, "")) if c not in ("step",) else e["step"] for c in self.COLUMNS] for e in every]
        self.run.log({"health/events": self.wandb.Table(columns=list(self.COLUMNS), data=rows)}, step=step)
        for e in new:
            level = self.wandb.AlertLevel.ERROR if e["severity"] == "stop" else self.wandb.AlertLevel.WARN
            self.run.alert(title=f"align {self.stage}: {e['rule']}", text=event_text(e), level=level)

    def finish(self, status):
        self.run.finish(exit_code=0 if status == "complete" else 1)


class Trackio(Tracker):
    name, local, elsewhere = "trackio", "trackio", "TRACKIO_DIR"

    def start(self, config, lineage):
        if not os.environ.get("TRACKIO_DIR"):  # read when trackio is imported
            os.environ["TRACKIO_DIR"] = str(self.out / self.local)
        import inspect

        import trackio

        self.trackio = trackio
        wanted = dict(embed=False, auto_log_gpu=False, auto_log_cpu=False)  # no dashboard server, no sampler thread
        if self.resume_id:
            wanted["resume"] = "allow"  # the run of this name, continued
        known = inspect.signature(trackio.init).parameters
        with contextlib.redirect_stdout(io.StringIO()):  # its banner; the run's own console says where OUT is
            trackio.init(project=PROJECT, name=self.run_name, group=self.stage, config={**config, "lineage": lineage},
                         **{k: v for k, v in wanted.items() if k in known})
        self.run_id = self.run_name

    def log(self, step, values):
        self.trackio.log(values, step=step)

    def events(self, step, new, every):
        for e in new:
            level = self.trackio.AlertLevel.ERROR if e["severity"] == "stop" else self.trackio.AlertLevel.WARN
            with contextlib.redirect_stdout(io.StringIO()):  # printed already as align's health line
                self.trackio.alert(title=f"{e['rule']} ({e['severity']})", text=event_text(e), level=level)

    def finish(self, status):
        with contextlib.redirect_stdout(io.StringIO()):
            self.trackio.finish()


class MLflow(Tracker):
    name, local, elsewhere = "mlflow", "mlruns", "MLFLOW_TRACKING_URI"
    PARAM_MAX = 6000  # characters of a parameter's value MLflow stores

    def start(self, config, lineage):
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow >= 3.7 asks for an opt-in to it
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (self.out / self.local).resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        exp = self.client.get_experiment_by_name(name)
        eid = exp.experiment_id if exp else self.client.create_experiment(name)
        if self.resume_id and self._exists(self.resume_id):
            self.id = self.run_id = self.resume_id  # continued: its parameters are logged already (MLflow keeps
            self.client.update_run(self.id, status="RUNNING")  # a parameter's first value)
            return
        self.id = self.client.create_run(eid, run_name=self.run_name, tags={"align.stage": self.stage}).info.run_id
        self.run_id = self.id
        params = [Param(mlflow_name(k), str(v)[: self.PARAM_MAX])
                  for k, v in {**flat(config), **flat(lineage, "lineage.")}.items()]
        for i in range(0, len(params), 100):  # log_batch takes 100 parameters at a time
            self.client.log_batch(self.id, params=params[i : i + 100])

    def _exists(self, run_id: str) -> bool:
        try:
            self.client.get_run(run_id)
            return True
        except Exception:  # a store without it (another MLFLOW_TRACKING_URI): a new run
            return False

    def log(self, step, values):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.id, metrics=[Metric(mlflow_name(k), v, now, step) for k, v in values.items()])

    def events(self, step, new, every):
        for e in new:
            self.client.set_tag(self.id, f"health.{mlflow_name(e['rule'])}", event_text(e)[: self.PARAM_MAX])
        self.client.log_text(self.id, "".join(json.dumps(e) + "\n" for e in every), "health.jsonl")

    def finish(self, status):
        self.client.set_terminated(self.id, "FINISHED" if status == "complete" else "FAILED")


BACKENDS = {t.name: t for t in (TensorBoard, WandB, Trackio, MLflow)}


# ------------------------------------------------------------------------------------------------ the fan-out


class Trackers:
    """The chosen trackers of one run, started at the first row they get (after the checks before training, which
    may still refuse the run and put --out back as it was). A tracker that raises is warned about once and
    dropped; the others and the run carry on."""

    IDS = "trackers.json"  # {tracker: run id} in the run directory, for a --resume to continue

    def __init__(self, names: list[str], out: Path, record: dict, resume: bool = False):
        out = Path(out)
        self.pending = [BACKENDS[n](out, out.name, record.get("stage", "")) for n in names]
        self.active: list[Tracker] = []
        self.record, self.resume, self.out = record, resume, out
        self.every: list[dict] = []

    def _start(self) -> None:
        if not self.pending:
            return
        from align.lineage import chain

        pending, self.pending = self.pending, []
        lineage = lineage_params(self.record, chain(self.out, self.record))
        ids = self._ids() if self.resume else {}
        for t in pending:
            if not self.resume and t.local and not os.environ.get(t.elsewhere):
                shutil.rmtree(self.out / t.local, ignore_errors=True)  # a replaced run's curves
            t.resume_id = ids.get(t.name)
            if self._call(t, "start", self.record.get("config", {}), lineage):
                self.active.append(t)
        ids.update({t.name: t.run_id for t in self.active if t.run_id})
        write_json_atomic(self.out / self.IDS, ids)

    def _ids(self) -> dict:
        try:
            ids = json.loads((self.out / self.IDS).read_text())
            return ids if isinstance(ids, dict) else {}
        except (OSError, ValueError):
            return {}

    def _call(self, t: Tracker, method: str, *args) -> bool:
        try:
            getattr(t, method)(*args)
            return True
        except Exception as e:  # a tracker must never stop training
            warn(f"--report-to {t.name}: {method} failed ({type(e).__name__}: {str(e).strip()[:300]}); {t.name} "
                 "logs nothing more in this run, training goes on (metrics.jsonl has every metric).", once=True)
            if t in self.active:
                self.active.remove(t)
            return False

    def log(self, step: int, metrics: dict) -> None:
        self._start()
        values = numbers(metrics)
        for t in list(self.active):
            if values:
                self._call(t, "log", step, values)

    def events(self, events: list[dict]) -> None:
        """RLMonitor's new events (Event.to_dict()s), logged at the step of the latest."""
        if not events:
            return
        self._start()
        self.every += events
        step = max(e["step"] for e in events)
        for t in list(self.active):
            self._call(t, "events", step, events, self.every)

    def finish(self, status: str) -> None:
        for t in list(self.active):
            self._call(t, "finish", status)
        self.active, self.pending = [], []
