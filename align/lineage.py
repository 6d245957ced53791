"""A run's lineage, read from artifact.json files: the chain of align artifacts it was made from (its model's,
its reference's, its reward model's, and theirs), upstream first, each with its data hashes, final metrics and
RLMonitor events. Experiment trackers log it as the run's parameters; `align export` writes it into the model card.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from align.artifacts import read_artifact
from align.errors import UserError


def digest(value) -> str:
    """A file's sha256 as recorded, or one sha256 over a recorded tree of them ({relative path: sha256})."""
    if isinstance(value, dict):
        return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()
    return str(value)


def input_artifacts(record: dict) -> dict[str, Path]:
    """The align artifacts among a record's inputs: {input name (model, ref_model, ...): artifact dir}."""
    return {name: Path(v["artifact"]) for name, v in record.get("inputs", {}).items()
            if isinstance(v, dict) and v.get("artifact")}


def read_events(out: Path) -> list[dict]:
    """RLMonitor's events of a run (its health.jsonl; [] when it has none)."""
    f = Path(out) / "health.jsonl"
    events = []
    for line in (f.read_text().splitlines() if f.is_file() else []):
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut off by a killed run
    return events


def entry(out: Path, record: dict) -> dict:
    """One artifact of a lineage: what it is, what it was made from, how it ended."""
    inputs = record.get("inputs", {})
    model = inputs.get("model", {}) if isinstance(inputs.get("model"), dict) else {}
    return {"stage": record.get("stage"), "out": str(out), "status": record.get("status"),
            "finished": record.get("finished"), "git_commit": record.get("git_commit"),
            "model": model.get("spec"), "model_sha256": model.get("sha256") or (digest(model["files"])
                                                                               if "files" in model else None),
            "data": {path: digest(v) for path, v in inputs.get("data", {}).items()},
            "upstream": {name: str(p) for name, p in input_artifacts(record).items()},
            "metrics": record.get("metrics", {}), "health": record.get("health", {}), "events": read_events(out)}


def chain(out: Path, record: dict | None = None) -> list[dict]:
    """The lineage of the run in `out` (its artifact.json, or `record` when given): every artifact it was made from,
    upstream first, each once, then the run itself. An input artifact that is gone is listed with status
    "missing"."""
    out = Path(out)
    seen: dict[str, dict] = {}

    def visit(path: Path, rec: dict | None) -> None:
        key = str(path.resolve())
        if key in seen:
            return
        if rec is None:
            try:
                rec = read_artifact(path)
            except UserError:
                rec = None
            if rec is None:
                seen[key] = {"stage": None, "out": str(path), "status": "missing"}
                return
        for up in input_artifacts(rec).values():
            visit(up, None)
        seen[key] = entry(path, rec)

    visit(out, record)
    return list(seen.values())
