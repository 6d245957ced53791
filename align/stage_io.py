"""What a stage records about its inputs, and small input helpers shared by the stages."""

from __future__ import annotations

from pathlib import Path

from align.artifacts import artifact_digest, hash_tree, sha256_file
from align.config import load_toml


def describe_inputs(ref, *data_paths: str) -> dict:
    """{'model': {...}, 'data': {path: sha256}} for artifact.json (what this run was made from)."""
    model = {"spec": ref.spec}
    if ref.artifact is not None:
        model.update(artifact=str(Path(ref.spec).resolve()), sha256=artifact_digest(Path(ref.spec)),
                     stage=ref.artifact.get("stage"))
    elif ref.model_dir is not None:
        model.update(dir=str(ref.model_dir.resolve()), files=hash_tree(ref.model_dir))
    data = {}
    for p in data_paths:
        if p:
            path = Path(p)
            data[str(path)] = sha256_file(path) if path.is_file() else hash_tree(path)
    return {"model": model, "data": data}


def monitor_overrides(path: str) -> dict | None:
    """RLMonitor rule overrides from a TOML file: either top-level rule tables or a [monitor] table."""
    if not path:
        return None
    data = load_toml(path)
    return data.get("monitor", data)
