"""--report-to: each experiment tracker gets what metrics.jsonl gets (names and values), the run's config and lineage
as its parameters and RLMonitor's events, read back here through each tracker's own reader from its local store
in the run directory. A tracker that is not installed is skipped; one that fails mid-run never stops training."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from align import trackers as T
from align.artifacts import sha256_file
from align.errors import UserError
from tests.conftest import assert_user_error, output, run_align, small_sft

INSTALLED = [n for n in T.MODULES if __import__("importlib.util").util.find_spec(T.MODULES[n])]
ARGS = ["--max-steps", "4", "--batch-size", "8", "--eval-every", "2", "--eval-samples", "4", "--max-new-tokens", "4",
        "--lr", "3e-3", "--warmup-steps", "2", *small_sft()]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """One tiny SFT run reporting to every installed tracker, with an RLMonitor warning at step 1."""
    if not INSTALLED:
        pytest.skip("no tracker installed")
    tmp = tmp_path_factory.mktemp("trackers")
    rules = tmp / "rules.toml"
    rules.write_text('[grad_explode]\nmax_value = 1e-9\nseverity = "warn"\n')  # any gradient norm fires it
    out = tmp / "sft"
    with pytest.MonkeyPatch.context() as mp:
        for k in ("WANDB_MODE", "TRACKIO_DIR", "MLFLOW_TRACKING_URI"):  # unset: the local stores in the run dir
            mp.delenv(k, raising=False)
        proc = run_align("sft", "--out", out, "--monitor", rules, "--report-to", ",".join(INSTALLED), *ARGS)
    assert "warning" not in output(proc), output(proc)[-3000:]
    assert proc.returncode == 0, output(proc)[-3000:]
    return out


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def expected(out: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl as {metric: {step: value}} (the numbers a tracker can plot)."""
    series: dict[str, dict[int, float]] = {}
    for row in jsonl(out / "metrics.jsonl"):
        for k, v in T.numbers({k: v for k, v in row.items() if k != "step"}).items():
            series.setdefault(k, {})[row["step"]] = v
    return series


def assert_same_series(got: dict, want: dict, rel: float = 1e-12) -> None:
    assert set(got) == set(want)
    for k in want:
        assert set(got[k]) == set(want[k]), k
        for step, v in want[k].items():
            assert got[k][step] == pytest.approx(v, rel=rel, abs=1e-30), (k, step)


def test_metrics_jsonl_has_evaluations_and_an_event(run):
    series = expected(run)
    assert {"loss", "grad_norm", "lr", "eval/loss", "eval/pass@1"} <= set(series)
    assert set(series["eval/loss"]) == {2, 4}
    assert [e["rule"] for e in jsonl(run / "health.jsonl")] == ["grad_explode"]


def test_tensorboard(run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    got = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    assert_same_series(got, expected(run), rel=1e-6)  # TensorBoard stores float32
    start = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hp = plugin_data_pb2.HParamsPluginData.FromString(start).session_start_info.hparams
    assert hp["lr"].number_value == 3e-3 and hp["max_steps"].number_value == 4
    assert hp["lineage.stage"].string_value == "sft" and hp["lineage.model"].string_value == "tiny"
    data = {k.removeprefix("lineage.data."): v.string_value for k, v in hp.items() if k.startswith("lineage.data.")}
    assert data == {p: sha256_file(Path(p)) for p in small_sft()[1::2]}  # the data files and their sha256
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors("health/grad_explode/text_summary")}
    assert list(texts) == [1] and "grad_explode" in texts[1]


def wandb_records(path: Path):
    """The records of a W&B offline run file (wandb's protobuf Records in its LevelDB-style log blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf = path.read_bytes(), 7, b""  # header: ":W&B", a 2-byte magic, a version byte
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a record header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        buf, pos = buf + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            yield pb.Record.FromString(buf)
            buf = b""


def test_wandb_offline(run):
    pytest.importorskip("wandb")
    (run_dir,) = (run / "wandb").glob("offline-run-*")
    records = list(wandb_records(next(run_dir.glob("run-*.wandb"))))
    got: dict[str, dict[int, float]] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            step = r.history.step.num
            for item in r.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith(("_", "health/")):
                    got.setdefault(key, {})[step] = float(json.loads(item.value_json))
    assert_same_series(got, expected(run))
    (head,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {i.key: json.loads(i.value_json) for i in head.config.update}
    assert config["lr"] == 3e-3 and config["max_steps"] == 4 and config["lineage"]["stage"] == "sft"
    alerts = [r.alert for r in records if r.WhichOneof("record_type") == "alert"]
    assert len(alerts) == 1 and "grad_explode" in alerts[0].text
    (table,) = (run_dir / "files" / "media" / "table" / "health").glob("events_*.table.json")
    rows = json.loads(table.read_text())
    assert rows["data"][0][:3] == [1, "grad_explode", "warn"]


def test_trackio_local(run):
    pytest.importorskip("trackio")
    code = ("import json, sys\nfrom trackio.sqlite_storage import SQLiteStorage as S\n"
            "print(json.dumps({'logs': S.get_logs('align', sys.argv[1]), 'config': S.get_run_config('align', "
            "sys.argv[1]), 'alerts': S.get_alerts('align', run_name=sys.argv[1])}, default=str))")
    proc = subprocess.run([sys.executable, "-c", code, run.name], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TRACKIO_DIR": str(run / "trackio")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    store = json.loads(proc.stdout.strip().splitlines()[-1])
    got: dict[str, dict[int, float]] = {}
    for row in store["logs"]:
        for k, v in row.items():
            if k not in ("step", "timestamp") and isinstance(v, (int, float)):
                got.setdefault(k, {})[row["step"]] = v
    assert_same_series(got, expected(run))
    assert store["config"]["lr"] == 3e-3 and store["config"]["lineage"]["stage"] == "sft"
    assert [(a["step"], "grad_explode" in a["text"]) for a in store["alerts"]] == [(1, True)]


def test_mlflow_file_store(run, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(run / "mlruns").as_uri())
    (found,) = client.search_runs([client.get_experiment_by_name("align").experiment_id])
    want = expected(run)
    got = {k: {m.step: m.value for m in client.get_metric_history(found.info.run_id, T.mlflow_name(k))} for k in want}
    assert_same_series(got, want)
    assert "eval/pass_at_1" in found.data.metrics  # MLflow refuses '@' in a name
    params = found.data.params
    assert float(params["lr"]) == 3e-3 and params["lineage.stage"] == "sft" and params["lineage.model"] == "tiny"
    assert found.info.status == "FINISHED" and found.data.tags["align.stage"] == "sft"
    assert "grad_explode" in found.data.tags["health.grad_explode"]
    events = client.download_artifacts(found.info.run_id, "health.jsonl")
    assert [e["rule"] for e in jsonl(Path(events))] == ["grad_explode"]


def test_a_resumed_run_continues_its_tracker_runs(tmp_path, monkeypatch):
    """--resume continues the tracker runs of the interrupted run: one MLflow run and one Trackio run with every
    step, W&B's offline runs under one run id, TensorBoard in the same folder."""
    names = [n for n in INSTALLED if n != "tensorboard"]
    if not names:
        pytest.skip("no tracker installed")
    for k in ("WANDB_MODE", "TRACKIO_DIR", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    i = ARGS.index("--max-steps")
    out, args = tmp_path / "sft", ARGS[:i] + ARGS[i + 2:]
    for steps, more in (("2", []), ("4", ["--resume"])):
        proc = run_align("sft", "--out", out, "--report-to", ",".join(names), "--max-steps", steps, "--save-every",
                         "2", "--schedule", "constant", *args, *more)
        assert proc.returncode == 0, output(proc)[-3000:]
    ids = json.loads((out / "trackers.json").read_text())
    assert set(ids) == set(names)
    want = sorted(expected(out)["loss"])
    assert want == [1, 2, 3, 4]
    if "mlflow" in names:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
        (found,) = client.search_runs([client.get_experiment_by_name("align").experiment_id])
        assert found.info.run_id == ids["mlflow"] and found.info.status == "FINISHED"
        assert sorted(m.step for m in client.get_metric_history(found.info.run_id, "loss")) == want
    if "trackio" in names:
        code = ("import json, sys\nfrom trackio.sqlite_storage import SQLiteStorage as S\n"
                "print(json.dumps([r['step'] for r in S.get_logs('align', sys.argv[1]) if 'loss' in r]))")
        proc = subprocess.run([sys.executable, "-c", code, out.name], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "TRACKIO_DIR": str(out / "trackio")})
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert sorted(json.loads(proc.stdout.strip().splitlines()[-1])) == want
    if "wandb" in names:
        runs = sorted((out / "wandb").glob("offline-run-*"))
        heads = [r.run for d in runs for r in wandb_records(next(d.glob("run-*.wandb")))
                 if r.WhichOneof("record_type") == "run"]
        assert len(runs) == 2 and {h.run_id for h in heads} == {ids["wandb"]}


# ----------------------------------------------------------------------------------- choosing and failing


def test_report_to_names_are_checked_before_anything_runs(tmp_path, monkeypatch):
    assert T.parse("") == [] and T.parse("none") == [] and T.parse(" TensorBoard, wandb,tensorboard") == [
        "tensorboard", "wandb"]
    proc = run_align("sft", "--out", tmp_path / "x", "--report-to", "tensorbord", *ARGS)
    assert_user_error(proc, "--report-to", "'tensorbord'", "tensorboard, wandb, trackio, mlflow")
    assert not (tmp_path / "x").exists()
    monkeypatch.setattr(T.importlib.util, "find_spec", lambda name: None)  # as if none were installed
    from align import config as C
    from stages.sft import SFTConfig

    with pytest.raises(UserError, match=r"--report-to wandb: the wandb package is not installed; install it with "
                                        r"pip install 'align\[wandb\]'") as e:
        C.build(SFTConfig, None, {"report_to": "wandb"})
    assert e.value.option == "report_to"


class Flaky(T.Tracker):
    """A tracker whose log raises from its second call on."""

    name, calls = "flaky", []

    def start(self, config, lineage):
        self.calls.append(("start", config["lr"], lineage["stage"]))

    def log(self, step, values):
        self.calls.append(("log", step))
        if len(self.calls) > 2:
            raise ConnectionError("server went away")


class Steady(Flaky):
    name, calls = "steady", []

    def log(self, step, values):
        self.calls.append(("log", step, values))

    def finish(self, status):
        self.calls.append(("finish", status))


def test_a_failing_tracker_is_warned_about_once_and_dropped(tmp_path, monkeypatch):
    said = []
    monkeypatch.setattr(T, "warn", lambda msg, once=False: said.append(msg))
    monkeypatch.setitem(T.BACKENDS, "flaky", Flaky)
    monkeypatch.setitem(T.BACKENDS, "steady", Steady)
    record = {"stage": "sft", "config": {"lr": 0.5}, "inputs": {"model": {"spec": "tiny"}, "data": {}}}
    sink = T.Trackers(["flaky", "steady"], tmp_path, record)
    for step in (1, 2, 3):
        sink.log(step, {"loss": 1.0 / step, "tag": "x", "bad": math.nan, "flag": True})
    sink.finish("complete")
    assert Flaky.calls == [("start", 0.5, "sft"), ("log", 1), ("log", 2)]  # dropped after its failure
    assert Steady.calls == [("start", 0.5, "sft"), *[("log", s, {"loss": 1.0 / s}) for s in (1, 2, 3)],
                            ("finish", "complete")]
    assert len(said) == 1 and said[0].startswith("--report-to flaky: log failed (ConnectionError: server went away)")


def test_the_trackers_hear_the_artifacts_own_status(tmp_path):
    """A run --on-alarm stop ended is "stopped" in artifact.json and to every tracker, not "complete"."""
    from align.artifacts import ArtifactWriter

    heard = []
    sink = type("Sink", (), {"finish": lambda self, status: heard.append(status)})()
    for status in ("stopped", "complete"):
        writer = ArtifactWriter(tmp_path / status, "grpo", {"lr": 0.1}, {}, True)
        writer.sinks.append(sink)
        writer.complete({}, status=status)
        assert json.loads((tmp_path / status / "artifact.json").read_text())["status"] == status
    assert heard == ["stopped", "complete"]


def test_pipeline_report_to_is_every_stages_default_and_not_in_the_fingerprint(tmp_path):
    from align import pipeline as P

    (tmp_path / "t.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    f = tmp_path / "p.toml"
    f.write_text('[pipeline]\nreport_to = "tensorboard"\n\n[stages.base]\nstage = "model-init"\n\n'
                 '[stages.eval]\nmodel = "@base"\ndata = "t.jsonl"\n\n'
                 '[stages.eval2]\nstage = "eval"\nmodel = "@base"\ndata = "t.jsonl"\nreport_to = ""\n')
    p = P.load(f)
    base, ev, ev2 = (P.resolve(p, s) for s in p.stages)
    assert "report_to" not in base and ev["report_to"] == "tensorboard" and ev2["report_to"] == ""
    quiet = P.load(f, ['stages.eval.report_to=""'])
    assert P.resolve(quiet, quiet.stage("eval"))["report_to"] == ""
    assert P.fingerprint(quiet, quiet.stage("eval")) == P.fingerprint(p, p.stage("eval"))  # reporting is not training
    f.write_text('[pipeline]\nreport_to = "tensorboard,neptune"\n\n[stages.base]\nstage = "model-init"\n')
    _, problems = P.parse(f)
    assert [pr.format("p.toml") for pr in problems] == [
        "p.toml:2: pipeline.report_to: --report-to: unknown tracker 'neptune'; choose from tensorboard, wandb, "
        "trackio, mlflow (comma-separated), or none"]
