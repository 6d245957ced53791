"""Pipelines: a chain of stages from one TOML file, each stage run only when its config or inputs changed.

    [pipeline]
    out = "runs/default"      # stage NAME writes to <out>/NAME unless it sets `out`
    nproc = 1                 # default --nproc for every stage that has one
    seed = 0                  # default --seed for every stage that has one (`pipeline run --seed N`)
    report_to = "tensorboard" # default --report-to for every stage that has one (experiment trackers)

    [stages.base]             # NAME: the table name; the kind is `stage`, or NAME itself when NAME is a kind
    stage = "model-init"
    preset = "tiny"

    [stages.sft]
    model = "@base"           # "@NAME": the out dir of an earlier stage
    data = "data/arithmetic/train.jsonl"   # relative paths: relative to the TOML file's folder

A stage is skipped when its out dir holds a complete, untampered artifact (`verify_artifact`) whose
`.pipeline-fingerprint` equals the stage's fingerprint: sha256 over the kind, the fully resolved config and a
digest of every input (the artifact.json digest of a referenced stage, the sha256 of a data file or tree, of a
user's reward or verifier file).
A rerun upstream rewrites its artifact.json, so everything downstream of it reruns too.

This module holds the logic only; `align.pipeline_cli` is the typer front end.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from rich.markup import escape

from align import config as C
from align.artifacts import (ARTIFACT_FILE, artifact_digest, describe_code, hash_tree, read_artifact, sha256_file,
                             verify_artifact, write_text_atomic)
from align.console import console
from align.engine import checkpoint
from align.errors import UserError
from align.paths import split_spec
from align.registry import KINDS

PIPELINE_KEYS: dict[str, type] = {"out": str, "nproc": int, "seed": int, "report_to": str}
STAGE_DEFAULTS = ("nproc", "seed", "report_to")  # [pipeline] keys: defaults of every stage's option of that name
TOP_LEVEL = ("pipeline", "stages")
FINGERPRINT_FILE = ".pipeline-fingerprint"
RESUME_KEY_FILE = ".pipeline-resume-key"  # the stage's fingerprint without what a resumed run may change
STAGE_TOML = ".pipeline-stage.toml"


# ----------------------------------------------------------------------------------------------- model


@dataclass
class Stage:
    name: str
    kind: str
    values: dict  # field name (underscores) -> value as written in the TOML (refs unresolved)
    refs: dict[str, str] = field(default_factory=dict)  # field name -> referenced stage name
    ref_files: dict[str, str] = field(default_factory=dict)  # field name -> file inside it ("@tasks/test.jsonl")

    @property
    def command(self):
        return KINDS[self.kind]

    @property
    def config(self) -> type:
        return self.command.config_class()


@dataclass
class Pipeline:
    path: Path  # the TOML file, absolute
    out: Path  # [pipeline] out, absolute
    defaults: dict  # STAGE_DEFAULTS given in [pipeline]
    stages: list[Stage]

    @property
    def root(self) -> Path:
        return self.path.parent

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def names(self) -> list[str]:
        return [s.name for s in self.stages]


@dataclass
class Problem:
    key: str  # TOML key path, e.g. stages.sft.max_steps
    message: str
    line: int | None = None
    origin: str = ""  # where the key came from when not the file: "--set stages.sft.lr=x"

    def format(self, file: str) -> str:
        where = self.origin or (f"{file}:{self.line}" if self.line else file)
        return f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"


# ----------------------------------------------------------------------------------------- line numbers

_HEADER = re.compile(r"^\s*\[(?!\[)\s*([^\]]+?)\s*\]\s*(#.*)?$")
_ARRAY_HEADER = re.compile(r"^\s*\[\[\s*([^\]]+?)\s*\]\]\s*(#.*)?$")
_KEY = r"""(?:"[^"]*"|'[^']*'|[A-Za-z0-9_\-]+)"""
_KEYLINE = re.compile(rf"^\s*({_KEY}(?:\s*\.\s*{_KEY})*)\s*=")
_PART = re.compile(r""""([^"]*)"|'([^']*)'|([A-Za-z0-9_\-]+)""")


def _dotted(text: str) -> tuple[str, ...]:
    return tuple(a or b or c for a, b, c in _PART.findall(text))


class Locator:
    """Finds the line of a TOML key path in the raw text (headers, dotted keys; best effort, 1-based)."""

    def __init__(self, text: str):
        self.entries: list[tuple[int, tuple[str, ...], tuple[str, ...]]] = []  # (line, table, key)
        table: tuple[str, ...] = ()
        for n, line in enumerate(text.splitlines(), 1):
            m = _HEADER.match(line) or _ARRAY_HEADER.match(line)
            if m:
                table = _dotted(m.group(1))
                self.entries.append((n, table, ()))
                continue
            m = _KEYLINE.match(line)
            if m:
                self.entries.append((n, table, _dotted(m.group(1))))

    def line(self, path: tuple[str, ...]) -> int | None:
        if not path:
            return None
        for n, table, key in self.entries:
            if table + key == path:
                return n
        for n, table, key in self.entries:  # a table only seen through its sub-tables ([stages.x] for `stages`)
            if (table + key)[: len(path)] == path:
                return n
        return self.line(path[:-1])  # not found (e.g. inside an inline table): point at the enclosing table


# --------------------------------------------------------------------------------------------- parsing


def _close(word: str, options) -> str:
    m = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean {m[0]}?)" if m else ""


def reference(value) -> tuple[str, str] | None:
    """A stage value's `@STAGE` or `@STAGE/FILE` reference as (STAGE, FILE or ''); None for any other value."""
    if isinstance(value, str) and value.startswith("@"):
        target, _, inside = value[1:].partition("/")
        return target, inside
    return None


def _path_fields(cls) -> set[str]:
    return {f.name for f in C.fields(cls) if f.metadata.get("path")}


DATA_KEYS = ("data", "eval_data", "pass_data", "ptx_data")  # a file, DIR[:SPLIT] or a Hub dataset NAME[:SPLIT]


def _exists(path: str | Path) -> bool:
    """A path that exists as written, or a data value DIR:SPLIT whose folder does."""
    return Path(path).exists() or Path(split_spec(str(path))[0]).exists()


def _is_preset(key: str, value: str, root: Path | None = None) -> bool:
    """A path key's value that names no file: a model preset, or a hub id (owner/name) with no such local path; a
    held-out data option's `auto`; a data key's Hub dataset NAME[:SPLIT] with no such path (under `root`, the
    pipeline file's folder: relative paths are read from there)."""
    from align.data import is_hub_name  # light: no torch at import time
    from align.models import HUB_ID, PRESETS

    if key in DATA_KEYS:
        name = split_spec(value)[0]
        return value == C.AUTO or (is_hub_name(name) and not _exists(_resolve_path(root or Path.cwd(), name)))
    return key in ("model", "from_model", "reward_model", "judge") and (value in PRESETS or (
        HUB_ID.fullmatch(value) is not None and not Path(value).exists()))


def _resolve_path(root: Path, value: str) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else root / p


def _toml_error_line(e: tomllib.TOMLDecodeError) -> tuple[int | None, str]:
    msg = str(e)
    m = re.search(r"\(at line (\d+), column (\d+)\)", msg)
    if m:
        return int(m.group(1)), msg[: m.start()].strip() + f" (column {m.group(2)})"
    return None, msg


def apply_overrides(data: dict, overrides: list[str]) -> tuple[list[Problem], dict[tuple[str, ...], str]]:
    """`--set stages.sft.model=DIR`: each KEY.PATH=VALUE replaces (or adds) one key of the parsed file. VALUE is
    read as a TOML value (1e-5, true, [1, 2], "text") and else taken as a string (a relative path in it is
    relative to the current directory: `parse` resolves it so). Returns (problems, {key path: the --set item}
    for each key it set and each table it made)."""
    problems, origins = [], {}
    for item in overrides:
        key, eq, raw = item.partition("=")
        keys = tuple(k.strip() for k in key.split("."))
        if not eq or not all(keys):
            problems.append(Problem("", "write KEY.PATH=VALUE, e.g. --set stages.sft.model=DIR", origin=f"--set {item}"))
            continue
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        table = data
        for n, k in enumerate(keys[:-1], 1):
            if k not in table:
                origins.setdefault(keys[:n], item)
            table = table.setdefault(k, {})
            if not isinstance(table, dict):
                problems.append(Problem("", f"{k!r} is not a table", origin=f"--set {item}"))
                break
        else:
            table[keys[-1]] = value
            origins[keys] = item
    return problems, origins


def parse(path: str | Path, overrides: list[str] = ()) -> tuple[Pipeline | None, list[Problem]]:
    """Read and check a pipeline file (with `--set` overrides); returns (pipeline, problems). The pipeline is None
    on any problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, [Problem("", "pipeline file not found")]
    except (OSError, UnicodeDecodeError) as e:
        return None, [Problem("", f"cannot read the pipeline file ({e})")]
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        line, msg = _toml_error_line(e)
        return None, [Problem("", f"invalid TOML: {msg}", line)]

    loc = Locator(text)
    problems, origins = apply_overrides(data, list(overrides))

    def set_by(keys: tuple[str, ...]) -> str | None:
        """The --set item a key (or the table holding it) comes from; None: the file."""
        return next((origins[keys[:n]] for n in range(len(keys), 0, -1) if keys[:n] in origins), None)

    def problem(keys: tuple[str, ...], message: str) -> None:
        item = set_by(tuple(keys))
        if item:  # the value came from --set, not from a line of the file
            problems.append(Problem(".".join(keys), message, origin=f"--set {item}"))
        else:
            problems.append(Problem(".".join(keys), message, loc.line(keys)))

    root = path.resolve().parent
    for k in data:
        if k not in TOP_LEVEL:
            problem((k,), f"unknown top-level table or key{_close(k, TOP_LEVEL)}; "
                          "a pipeline has a `pipeline` table and `stages.NAME` tables")

    # ---- [pipeline]
    head = data.get("pipeline", {})
    out, defaults = f"runs/{path.stem}", {}
    if not isinstance(head, dict):
        problem(("pipeline",), "must be a table")
        head = {}
    for k, v in head.items():
        key = k.replace("-", "_")
        if key not in PIPELINE_KEYS:
            problem(("pipeline", k), f"unknown key{_close(key, PIPELINE_KEYS)} "
                                     f"(pipeline keys: {', '.join(PIPELINE_KEYS)})")
            continue
        want = PIPELINE_KEYS[key]
        if not isinstance(v, want) or isinstance(v, bool):
            problem(("pipeline", k), f"must be {want.__name__}, got {type(v).__name__} {v!r}")
        elif key == "out":
            out = str(_resolve_path(Path.cwd(), v)) if set_by(("pipeline", k)) else v
        else:  # nproc, seed, report_to: each stage's option of that name, with its range
            try:
                defaults[key] = C.check_value(C.StageConfig, key, v, "pipeline")
                if key == "report_to":
                    from align import trackers

                    trackers.check(v)
            except UserError as e:
                problem(("pipeline", k), str(e).removeprefix("pipeline: ").rstrip("."))

    # ---- [stages.NAME], in file order: a @ref must name a stage above
    tables = data.get("stages", {})
    if not isinstance(tables, dict):
        problem(("stages",), "must be a table of stage tables (stages.NAME)")
        tables = {}
    if not tables:
        problem(("stages",) if "stages" in data else (), "empty pipeline: add at least one stage table (stages.NAME)")
    names = list(tables)
    stages: list[Stage] = []
    outs: dict[Path, str] = {}
    pipeline_out = _resolve_path(root, out)
    for name, table in tables.items():
        stage = _check_stage(name, table, names, root, defaults, problem, set_by)
        if stage is None:
            continue
        o = stage_out(root, pipeline_out, stage)
        if o in outs:
            problem(("stages", name) + (("out",) if "out" in stage.values else ()),
                    f"writes to {o}, like stage {outs[o]!r}; give each stage its own out directory")
            continue
        outs[o] = name
        stages.append(stage)

    if problems:
        problems.sort(key=lambda pr: pr.line or 1 << 30)  # file order; those without a line last
        return None, problems
    return Pipeline(path.resolve(), _resolve_path(root, out), defaults, stages), []


def _check_stage(name: str, table, names: list[str], root: Path, defaults: dict, problem, set_by) -> Stage | None:
    """Check one [stages.NAME] table, reporting every problem through `problem`; the Stage if it has none. A
    relative path is relative to `root`, the file's folder, or when `set_by(key path)` (a --set value) to the
    current directory (made absolute here)."""
    at = ("stages", name)
    i = names.index(name)
    if not isinstance(table, dict):
        problem(at, "must be a table")
        return None
    kind = table.get("stage", name if name in KINDS else None)
    if "stage" in table and not isinstance(kind, str):
        problem(at + ("stage",), f"must be a string naming the kind ({', '.join(KINDS)})")
        kind = None
    elif kind is None:
        problem(at, f"no stage kind: add stage = \"KIND\" (kinds: {', '.join(KINDS)}), "
                    "or name the table after its kind")
    elif kind not in KINDS:
        problem(at + ("stage",) if "stage" in table else at,
                f"unknown stage kind {kind!r}{_close(kind, KINDS)} (kinds: {', '.join(KINDS)})")
        kind = None

    cls = KINDS[kind].config_class() if kind else None
    types = C.field_types(cls) if cls else {}
    paths = _path_fields(cls) if cls else set()
    values: dict = {}
    refs: dict[str, str] = {}
    ref_files: dict[str, str] = {}
    bad_stage = kind is None
    for k, v in table.items():
        if k == "stage":
            continue
        key = k.replace("-", "_")
        kp = at + (k,)
        if cls and key not in types:
            hint = _close(key, types) or f" (keys of a {kind} stage: {', '.join(types)})"
            problem(kp, f"unknown key{hint}")
            bad_stage = True
            continue
        if key in values:
            problem(kp, f"given twice (as {key!r} and with dashes)")
            bad_stage = True
            continue
        if (ref := reference(v)) is not None:
            target, inside = ref
            if cls and key not in paths:
                problem(kp, f"{v}: a @stage reference only fits a path-valued key "
                            f"({', '.join(sorted(paths - {'out'}))})")
                bad_stage = True
            elif key == "out":
                problem(kp, f"{v}: `out` cannot be a reference; it is this stage's own output directory")
                bad_stage = True
            elif target == name:
                problem(kp, f"{v}: a stage cannot use its own output")
                bad_stage = True
            elif target not in names:
                hint = _close(target, names).replace("mean ", "mean @")
                problem(kp, f"{v}: no stage named {target!r}{hint} (stages: {', '.join(names)})")
                bad_stage = True
            elif names.index(target) > i:
                problem(kp, f"{v}: stage {target!r} comes later in the file; a stage can only use "
                            "the outputs of stages above it")
                bad_stage = True
            else:
                refs[key] = target
                if inside:
                    ref_files[key] = inside
            values[key] = v
            continue
        if cls:
            where = ".".join(kp)
            try:
                v = C.check_value(cls, key, v, where)
            except UserError as e:  # "<where>: 'key' must be int, got str 'x'."
                problem(kp, str(e).removeprefix(f"{where}: ").rstrip("."))
                bad_stage = True
                continue
            if key in paths and v and not _is_preset(key, v, Path.cwd() if set_by(kp) else root):
                p = _resolve_path(Path.cwd() if set_by(kp) else root, v)
                if key != "out" and not _exists(p):
                    what = " (not a preset or @stage either)" if key == "model" else ""
                    problem(kp, f"no such file or directory: {v}{what}"
                                + (f" (looked for {p})" if not Path(v).is_absolute() else ""))
                    bad_stage = True
                elif set_by(kp):
                    v = str(p)
        values[key] = v

    if bad_stage or cls is None:
        return None
    stage = Stage(name, kind, values, refs, ref_files)
    return stage if _validate_stage(stage, table, root, defaults, problem) else None


def _validate_stage(stage: Stage, table: dict, root: Path, defaults: dict, problem) -> bool:
    """The stage's own checks (ranges, choices, --schedule with --warmup-steps, its --deepspeed file, ...) on the
    config it will run with (relative paths read from `root`); a problem points at the key the message names."""
    cls, at = stage.config, ("stages", stage.name)
    paths = _path_fields(cls)
    try:
        cls(**{k: str(_resolve_path(root, v)) if k in paths and k not in stage.refs and v and not _is_preset(k, v, root)
               else v for k, v in _code_paths(cls, _base_values(stage, defaults), root).items()}).validate()
    except UserError as e:
        # the option at fault (e.option), or the first flag the message names (--schedule -> stages.NAME.schedule)
        raw = {k.replace("-", "_"): k for k in table}
        flags = [e.option] if e.option else [f.replace("-", "_") for f in re.findall(r"--([a-z][a-z0-9-]*)", str(e))]
        named = [raw[f] for f in flags if f in raw]
        problem(at + tuple(named[:1]), str(e).rstrip("."))
        return False
    except (TypeError, ValueError) as e:
        problem(at, f"invalid config ({e})")
        return False
    return True


def load(path: str | Path, overrides: list[str] = ()) -> Pipeline:
    """The checked pipeline, or a UserError that lists every problem (one per line) with its key and line."""
    p, problems = parse(path, overrides)
    if problems:
        file = str(path)
        lines = [pr.format(file) for pr in problems]
        n = len(problems)
        raise UserError(f"{file}: {n} problem{'s' if n > 1 else ''} in the pipeline:\n" + "\n".join(lines))
    return p


# ------------------------------------------------------------------------------------------ resolution


def stage_out(root: Path, pipeline_out: Path, stage: Stage) -> Path:
    if stage.values.get("out"):
        return _resolve_path(root, stage.values["out"])
    return pipeline_out / stage.name


def _code_paths(cls, values: dict, root: Path) -> dict:
    """`values` with each relative Python file the code options name (--reward, --tools, --env:
    path/to/file.py:NAME specs) read from `root`, the pipeline file's folder, where it is there."""
    from align.rewards import spec_file

    def fix(spec):
        file = spec_file(spec) if isinstance(spec, str) else None
        if file is None or Path(file).is_absolute() or not (root / file).is_file():
            return spec
        return str(root / file) + spec[len(file):]

    out = dict(values)
    for f in C.fields(cls):
        if f.metadata.get("code") and f.name in out:
            v = out[f.name]
            out[f.name] = [fix(x) for x in v] if isinstance(v, list) else fix(v)
    return out


def _base_values(stage: Stage, defaults: dict) -> dict:
    """The stage's values with the pipeline defaults (nproc, seed) applied where the stage has the option and does
    not set it (refs left as written)."""
    fields = C.field_types(stage.config)
    values = {k: v for k, v in defaults.items() if k in fields}
    values.update(stage.values)
    return values


def resolve(p: Pipeline, stage: Stage) -> dict:
    """The full config the stage runs with: every field, refs -> absolute out dirs, paths -> absolute."""
    cls = stage.config
    cfg = C.as_dict(cls())
    cfg.update(_code_paths(cls, _base_values(stage, p.defaults), p.root))
    for key in _path_fields(cls):
        v = cfg.get(key)
        if key in stage.refs:
            cfg[key] = str(stage_out(p.root, p.out, p.stage(stage.refs[key])) / stage.ref_files.get(key, ""))
        elif key == "out":
            cfg[key] = str(stage_out(p.root, p.out, stage))
        elif isinstance(v, str) and v and not _is_preset(key, v, p.root):
            cfg[key] = str(_resolve_path(p.root, v))
    return cfg


def _input_digest(p: Pipeline, stage: Stage, key: str, value: str):
    if key in stage.refs:
        out = stage_out(p.root, p.out, p.stage(stage.refs[key]))
        f = out / ARTIFACT_FILE
        return {"stage": stage.refs[key], "artifact": artifact_digest(out) if f.is_file() else None}
    if not value or _is_preset(key, value, p.root):
        return value
    path = Path(value) if Path(value).exists() else Path(split_spec(value)[0])
    if path.is_file():
        return sha256_file(path)
    if path.is_dir():
        tree = hash_tree(path)
        return hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest()
    return "missing"


def fingerprint(p: Pipeline, stage: Stage, cfg: dict | None = None) -> str:
    """sha256 of json(kind, resolved config, digest of every input: upstream artifact.json / data file / tree, and
    of every user Python file the config names: a --reward / --verifier file.py:FUNCTION, read where the stage
    reads it)."""
    cfg = cfg if cfg is not None else resolve(p, stage)
    inputs = {k: _input_digest(p, stage, k, cfg[k]) for k in sorted(_path_fields(stage.config))
              if k != "out" and k in cfg}
    code = describe_code(C.user_code(stage.config, cfg))
    cfg = {k: v for k, v in cfg.items() if k not in C.PREFLIGHT}
    # (no "code" key without user files: a stage without any keeps the fingerprint it had)
    blob = json.dumps({"kind": stage.kind, "config": cfg, "inputs": inputs, **({"code": code} if code else {})},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def resume_key(p: Pipeline, stage: Stage, cfg: dict) -> str:
    """The fingerprint of what a checkpoint's run is made of: the config without the settings a --resume may change
    (checkpoint.RESUMABLE, APPLIED), and every input's digest."""
    fixed = checkpoint.RESUMABLE | checkpoint.APPLIED
    return fingerprint(p, stage, {k: v for k, v in cfg.items() if k not in fixed})


# ---------------------------------------------------------------------------------------------- status


@dataclass
class State:
    status: str  # complete | stale | incomplete | missing
    detail: str

    @property
    def up_to_date(self) -> bool:
        return self.status == "complete"

    def describe(self) -> str:
        return f"{self.status} ({self.detail})" if self.detail else self.status


def state(out: Path, fp: str) -> State:
    """complete (up to date) / stale (config or inputs changed) / incomplete (running, failed, tampered) / missing."""
    try:
        art = read_artifact(out)
    except UserError:
        return State("incomplete", "unreadable artifact.json")
    if art is None:
        return State("missing", "")
    if art.get("status") != "complete":
        return State("incomplete", f"{art.get('status')} artifact")
    try:
        verify_artifact(out)
    except UserError:
        return State("incomplete", "files changed or missing since it finished")
    f = out / FINGERPRINT_FILE
    try:
        have = f.read_text().strip()
    except OSError:
        return State("stale", "not made by this pipeline")
    if have != fp:
        return State("stale", "config or inputs changed")
    return State("complete", "up to date")


def check_outs(p: Pipeline) -> None:
    """A stage's out holds its own kind's artifact or none: a stage rerun replaces its own stale artifact
    (`pipeline run` passes --overwrite), never another stage's (refused before any stage runs)."""
    problems = []
    for stage in p.stages:
        out = stage_out(p.root, p.out, stage)
        try:
            art = read_artifact(out)
        except UserError:
            continue  # a damaged artifact.json: the stage's own rerun replaces it
        if art is not None and art.get("stage") != stage.kind:
            problems.append(f"stage {stage.name!r} ({stage.kind}): its out {out} holds a {art.get('status')} "
                            f"{art.get('stage')} artifact")
    if problems:
        raise UserError("; ".join(problems) + ". Give the stage another `out` (or move that artifact away): a "
                        "pipeline never replaces another stage's artifact.")


def from_index(p: Pipeline, from_stage: str | None) -> int | None:
    """Index of the `--from` stage (None: no --from); a UserError listing the stages for an unknown name."""
    if from_stage is None:
        return None
    if from_stage not in p.names():
        raise UserError(f"--from {from_stage}: no such stage{_close(from_stage, p.names())}; "
                        f"stages: {', '.join(p.names())}.")
    return p.names().index(from_stage)


@dataclass
class Plan:
    stage: Stage
    config: dict
    out: Path
    fingerprint: str
    state: State
    run: bool  # whether `run` will (re)run it
    reason: str


def plan(p: Pipeline, from_stage: str | None = None) -> list[Plan]:
    """What `run` would do now: each stage's state and whether it runs (forced, not up to date, or upstream runs)."""
    start = from_index(p, from_stage)
    plans: list[Plan] = []
    running: set[str] = set()
    for i, stage in enumerate(p.stages):
        cfg = resolve(p, stage)
        out = Path(cfg["out"])
        fp = fingerprint(p, stage, cfg)
        st = state(out, fp)
        upstream = sorted({r for r in stage.refs.values() if r in running})
        if start is not None and i >= start:
            run, reason = True, f"forced by --from {from_stage}"
        elif not st.up_to_date:
            run, reason = True, st.describe()
        elif upstream:
            run, reason = True, f"upstream reruns: {', '.join('@' + u for u in upstream)}"
        else:
            run, reason = False, "up to date"
        if run:
            running.add(stage.name)
        plans.append(Plan(stage, cfg, out, fp, st, run, reason))
    return plans


# ------------------------------------------------------------------------------------------------- run


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        r = repr(v)
        return r if any(c in r for c in ".enai") else r + ".0"
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} to a stage TOML")


def write_stage_toml(path: Path, cfg: dict, comment: str = "") -> None:
    lines = [f"# {comment}"] if comment else []
    lines += [f"{k} = {toml_value(v)}" for k, v in cfg.items()]
    write_text_atomic(path, "\n".join(lines) + "\n")


def command(stage: Stage, stage_toml: Path) -> list[str]:
    return [sys.executable, "-m", "align", *stage.command.words, "--config", str(stage_toml)]


def stage_processes(stages: list[Stage]):
    """Where the stages' processes come from: a multiprocessing fork server that imports what they import
    (torch, transformers, deepspeed, the stage modules: ~8 s a stage on 2 CPU cores) once, then forks one fresh
    process per stage. None (a new interpreter per stage) where forking is not safe: not POSIX, or a CUDA/ROCm
    torch (a GPU driver initialised before a fork is unusable after it; there the imports are a small part of a
    stage anyway). The server never computes, so its children start with clean thread pools."""
    if os.name != "posix":
        return None
    import multiprocessing

    import torch

    if torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None:
        return None
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "deepspeed", "align.cli", *RUN_IMPORTS,
                                *sorted({st.command.module for st in stages})])
    return ctx


# What a stage imports only once it runs (transformers' lazy modules: model loading, masks, its DeepSpeed glue; the
# report's plots): ~2.5 s of CPU in each forked stage otherwise, paid once in the fork server instead.
RUN_IMPORTS = ("transformers.modeling_utils", "transformers.masking_utils", "transformers.modeling_layers",
               "transformers.utils.type_validators", "transformers.integrations.deepspeed",
               "transformers.configuration_utils", "transformers.tokenization_utils_base",
               "transformers.tokenization_utils_tokenizers", "transformers.models.auto.auto_mappings",
               "matplotlib.figure", "matplotlib.backends.backend_agg", "align.report")


def _stage_main(argv: list[str]) -> None:
    """A forked stage process: what `python -m align ARGV` runs. Its SystemExit code is the process's exit code."""
    import runpy

    sys.argv = ["align", *argv]
    runpy.run_module("align", run_name="__main__", alter_sys=True)


def run_stage(cmd: list[str], processes) -> int:
    """Run one stage's `align` command in a process of its own and return its exit code: forked from
    `stage_processes`' server when there is one (the same process boundary: its own distributed group, memory
    and signals, without paying the imports again), else a new interpreter running `cmd`. Ctrl-C reaches the stage
    too (one process group): it is left to take its own way out (finish the step, checkpoint, mark its artifact),
    however often Ctrl-C comes, and KeyboardInterrupt is raised once it has."""
    sys.stdout.flush()
    sys.stderr.flush()
    if processes is None:
        proc = subprocess.Popen(cmd)
        wait = proc.wait
    else:
        proc = processes.Process(target=_stage_main, args=(cmd[3:],), name=" ".join(cmd[3:5]))
        proc.start()
        wait = lambda: proc.join() or proc.exitcode  # noqa: E731
    interrupted = False
    while True:
        try:
            rc = wait()
            break
        except KeyboardInterrupt:
            interrupted = True
    if interrupted:
        raise KeyboardInterrupt
    return rc


def continuation(p: Pipeline, stage: Stage, out: Path, cfg: dict, st: State) -> str | None:
    """The checkpoint ("stepN") a stage continues from, the rule of `--resume`: an interrupted stage made of the same
    config and inputs (its resume key), and a complete one whose max_steps alone changed (with its lr); None where
    it starts over. A max_steps change the checkpoint cannot continue (checkpoint.budget_conflict) is a UserError
    naming the two ways on."""
    if "resume" not in cfg or st.status not in ("incomplete", "stale"):
        return None
    try:
        key = (out / RESUME_KEY_FILE).read_text().strip()
        saved = checkpoint.read_state(out)
    except (OSError, UserError, json.JSONDecodeError):
        return None
    old, new = saved["config"].get("max_steps"), cfg.get("max_steps")
    auto = {k: v for k, (v, _) in stage.config(**cfg).automatic().items()}  # what the stage makes of --lr 0, ...
    # as the stage runs it: held-out options left at auto made concrete, --lr 0 / --warmup-steps -1 resolved
    now = C.as_dict(stage.config(**cfg).resolved())
    changed = {k for k in (checkpoint.RESUMABLE | checkpoint.APPLIED) - {"out", "resume", *C.PREFLIGHT}
               if saved["config"].get(k) != now.get(k)}
    if (key != resume_key(p, stage, cfg) or (st.status == "stale" and changed != {"max_steps"})
            or checkpoint.conflicts({k: saved["config"].get(k) for k in auto}, auto)):  # a warmup a new budget changes
        return None
    why = checkpoint.budget_conflict(saved["config"], now, saved["step"])
    if why:
        raise UserError(f"stage {stage.name!r}: max_steps {old} -> {new}: {why}. Set stages.{stage.name}.max_steps back "
                        f"to {old} to continue from its checkpoint, or rerun with --from {stage.name} to start it over "
                        f"with {new} steps.")
    return checkpoint.latest(out)


@dataclass
class Result:
    name: str
    kind: str
    status: str  # ran | skipped (up to date) | would run | failed
    reason: str = ""
    seconds: float | None = None
    metrics: dict = field(default_factory=dict)
    exit_code: int = 0
    out: Path | None = None
    compile_seconds: float | None = None  # torch.compile's time in the stage's process (a training stage that ran)


class StageFailed(UserError):
    """A stage's process failed: the pipeline stops with that stage's exit code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


HEADLINE = ("pass@", "accuracy", "reward", "kl", "loss")


def headline_metrics(out: Path, n: int = 3) -> dict:
    """A few numeric metrics from the stage's artifact.json, the most telling first (pass@k, accuracy, loss...);
    standard errors and the input model's figures (start/...) are left to the artifact."""
    try:
        art = read_artifact(out) or {}
    except UserError:
        return {}
    metrics = art.get("metrics") or {}
    numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
               and not k.endswith("_stderr") and not k.startswith("start/")}  # the result, not its error or input

    def rank(k: str) -> int:
        for i, word in enumerate(HEADLINE):
            if word in k:
                return i
        return len(HEADLINE)

    return dict(sorted(numeric.items(), key=lambda kv: rank(kv[0]))[:n])


def run(path: str | Path, from_stage: str | None = None, dry_run: bool = False, echo=console.print,
        overrides: list[str] = ()) -> list[Result]:
    """Run the pipeline; returns one Result per stage. The first stage that does not end up to date (failed,
    refused, interrupted by Ctrl-C) stops it: the stages after it are 'not run'."""
    p = load(path, overrides)
    check_outs(p)
    if dry_run:
        return [Result(pl.stage.name, pl.stage.kind, "would run" if pl.run else "skipped (up to date)", pl.reason,
                       out=pl.out) for pl in plan(p, from_stage)]
    start = from_index(p, from_stage)
    spawn = _Spawner(p)
    results: list[Result] = []
    for i, stage in enumerate(p.stages):
        forced = start is not None and i >= start
        try:
            r = _run_one(p, stage, f"forced by --from {from_stage}" if forced else None, str(path), echo, spawn)
        except KeyboardInterrupt:
            r = _interrupted(stage, stage_out(p.root, p.out, stage))
        results.append(r)
        if r.status not in ("ran", "skipped (up to date)"):
            results += [Result(s.name, s.kind, "not run") for s in p.stages[i + 1 :]]
            break
    return results


class _Spawner:
    """Where stage processes come from, decided when the first stage runs (an up-to-date pipeline imports nothing)."""

    def __init__(self, p: Pipeline):
        self.p, self.processes, self.decided = p, None, False

    def run(self, cmd: list[str], stage: Stage) -> int:
        if not self.decided:
            self.processes, self.decided = stage_processes(self.p.stages[self.p.stages.index(stage) :]), True
        return run_stage(cmd, self.processes)


def _run_one(p: Pipeline, stage: Stage, forced: str | None, path: str, echo, spawn: _Spawner) -> Result:
    """Skip, continue or (re)run one stage; its Result. Fingerprints are computed only now, after the stages above
    have (re)run."""
    cfg = resolve(p, stage)
    out = Path(cfg["out"])
    fp = fingerprint(p, stage, cfg)
    st = state(out, fp)
    if st.up_to_date and not forced:
        echo(f"[dim]= {escape(stage.name)} ({stage.kind}): up to date, skipped[/]")
        return Result(stage.name, stage.kind, "skipped (up to date)", "", None, headline_metrics(out), out=out)
    reason = forced or st.describe()
    try:
        tag = None if forced else continuation(p, stage, out, cfg, st)
    except UserError as e:
        return Result(stage.name, stage.kind, "refused", str(e), exit_code=2, out=out)
    run_cfg = {**cfg, "overwrite": True}  # the stage's own artifact, stale (check_outs: no other stage's)
    if tag:  # a stage that continues resumes from its checkpoint
        run_cfg["resume"] = True
    reason += f", resuming from its {tag} checkpoint" if tag else ""
    out.mkdir(parents=True, exist_ok=True)
    (out / FINGERPRINT_FILE).unlink(missing_ok=True)  # a half-done rerun must never look up to date
    write_text_atomic(out / RESUME_KEY_FILE, resume_key(p, stage, cfg) + "\n")  # what its checkpoints are made of
    stage_toml = out / STAGE_TOML
    write_stage_toml(stage_toml, run_cfg, f"written by `align pipeline run {path}` for stage {stage.name!r}")
    echo(f"[bold]> {escape(stage.name)}[/] ({stage.kind}, {reason}): align {' '.join(stage.command.words)} "
         f"--config {escape(str(stage_toml))}")
    t0 = time.time()
    rc = spawn.run(command(stage, stage_toml), stage)
    seconds = time.time() - t0
    if rc in (130, -signal.SIGINT):  # the stage alone was interrupted (SIGINT sent to it, not to the pipeline)
        return _interrupted(stage, out, seconds)
    if rc != 0:
        return Result(stage.name, stage.kind, "failed", reason, seconds, {}, rc, out)
    # the stage must have left a complete artifact; only then is it recorded as up to date
    try:
        verify_artifact(out)
    except UserError as e:
        return Result(stage.name, stage.kind, "failed", f"no complete artifact: {e}", seconds, {}, 1, out)
    write_text_atomic(out / FINGERPRINT_FILE, fp + "\n")  # what it was run on
    compiled = (read_artifact(out) or {}).get("metrics", {}).get("time/compile")
    return Result(stage.name, stage.kind, "ran", reason, seconds, headline_metrics(out), out=out,
                  compile_seconds=compiled)


def _interrupted(stage: Stage, out: Path, seconds: float | None = None) -> Result:
    """The Result of a stage Ctrl-C stopped: what its artifact says, and what a rerun does with it."""
    try:
        art = read_artifact(out) or {}
    except UserError:
        art = {}
    tag = checkpoint.latest(out)
    if art.get("status") == "complete":  # done before the interrupt reached the pipeline
        why = "complete, not yet recorded as up to date: the rerun runs it again"
    elif tag:
        why = f"{art.get('status', 'no')} artifact, checkpoint {tag}: the rerun continues from it"
    else:
        why = f"{art.get('status', 'no')} artifact, no checkpoint: the rerun starts it over"
    return Result(stage.name, stage.kind, "interrupted", why, seconds, {}, 130, out)


def raise_for_failure(results: list[Result]) -> None:
    for r in results:
        if r.status == "refused":
            raise StageFailed(r.reason, r.exit_code)
        if r.status == "failed":
            code = r.exit_code if r.exit_code > 0 else (128 - r.exit_code if r.exit_code < 0 else 1)
            raise StageFailed(f"pipeline stopped: stage {r.name!r} ({r.kind}) failed with exit code {r.exit_code}"
                              + (f" ({r.reason})" if r.reason.startswith("no complete") else "")
                              + f"; its output is in {r.out}. Fix it and rerun `align pipeline run` "
                              "(stages above it are kept).", code)
