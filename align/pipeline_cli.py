"""`align pipeline run|validate|show FILE.toml` (the logic is in align.pipeline; align.cli mounts `app`)."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from align import pipeline as P
from align.console import console, fmt

app = typer.Typer(help="Run a chain of stages from a TOML file.", no_args_is_help=True, rich_markup_mode="rich")

FILE = typer.Argument("pipelines.toml", help="Pipeline TOML file ([pipeline] + [stages.NAME] tables).")
SET = typer.Option([], "--set", help="Override a key of the file: stages.NAME.KEY=VALUE (repeatable), e.g. "
                   "--set stages.sft.model=./my-model; paths relative to the current directory.")


def _rel(path: Path) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return str(path)
    return rel if not rel.startswith(".." + os.sep + "..") else str(path)


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.1f}s" if s < 120 else f"{int(s // 60)}m{int(s % 60):02d}s"


def _metrics(m: dict) -> str:
    return "  ".join(f"{k} {fmt(v)}" for k, v in m.items())


STATUS_STYLE = {"ran": "green", "skipped (up to date)": "dim", "would run": "yellow", "failed": "bold red",
                "refused": "bold red", "interrupted": "yellow", "not run": "dim", "complete": "green",
                "stale": "yellow", "incomplete": "red", "missing": "dim"}


@app.command("validate")
def validate(file: str = FILE, set_: list[str] = SET):
    """Check a pipeline file: every problem is reported (key path and line), none is run."""
    p = P.load(file, set_)
    chain = ", ".join(f"{s.name} ({s.kind})" for s in p.stages)
    n = len(p.stages)
    console.print(f"[green]ok[/] {escape(file)}: {n} stage{'s' if n > 1 else ''}: {escape(chain)}")


@app.command("show")
def show(file: str = FILE, set_: list[str] = SET):
    """The plan: each stage's kind, inputs, out dir and status (complete / stale / incomplete / missing)."""
    p = P.load(file, set_)
    table = Table(title=f"pipeline {escape(file)}", header_style="bold")
    for col in ("stage", "kind", "inputs", "out", "status", "next run"):
        table.add_column(col, overflow="fold")
    for pl in P.plan(p):
        inputs = ", ".join(f"{k}=@{v}" + (f"/{pl.stage.ref_files[k]}" if k in pl.stage.ref_files else "")
                           for k, v in pl.stage.refs.items()) or "-"
        style = STATUS_STYLE.get(pl.state.status, "")
        nxt = "[dim]skip[/]"
        if pl.run:
            nxt = "[yellow]runs[/]" + (f" ({escape(pl.reason)})" if pl.reason != pl.state.describe() else "")
        table.add_row(escape(pl.stage.name), pl.stage.kind, escape(inputs), escape(_rel(pl.out)),
                      f"[{style}]{escape(pl.state.describe())}[/]", nxt)
    console.print(table)


@app.command("run")
def run(
    file: str = FILE,
    from_: Optional[str] = typer.Option(None, "--from", help="Rerun this stage and every stage after it."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only say which stages would run."),
    set_: list[str] = SET,
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed of every stage that has one (= --set "
                                       "pipeline.seed=N); keep another seed's chain with --set pipeline.out=DIR."),
    report_to: Optional[str] = typer.Option(None, "--report-to", help="Experiment trackers of every stage that has "
                                            "--report-to (= --set pipeline.report_to=...): comma-separated "
                                            "tensorboard, wandb, trackio, mlflow."),
):
    """Run the stages in order, skipping those whose artifact is complete and whose config and inputs are unchanged."""
    mine = [*([f"pipeline.seed={seed}"] if seed is not None else []),
            *([f"pipeline.report_to={json.dumps(report_to)}"] if report_to is not None else [])]
    overrides = [*set_, *mine]
    results = P.run(file, from_stage=from_, dry_run=dry_run, echo=console.print, overrides=overrides)
    table = Table(title=f"pipeline {escape(file)}" + (" (dry run)" if dry_run else ""), header_style="bold")
    for col in ("stage", "status", "wall", "compile", "metrics"):
        table.add_column(col)
    for r in results:
        style = STATUS_STYLE.get(r.status, "")
        status = r.status + (f" ({r.reason})" if r.status in ("would run", "interrupted") else "")
        if r.status == "failed":
            status += f" (exit {r.exit_code})"
        table.add_row(escape(r.name), f"[{style}]{escape(status)}[/]", _seconds(r.seconds), _seconds(r.compile_seconds),
                      escape(_metrics(r.metrics)))
    console.print(table)
    names = [r.name for r in results]
    if "interrupted" in (r.status for r in results):
        stopped = next(i for i, r in enumerate(results) if r.status == "interrupted")
        # --from is kept only while the stage it forces has not been reached: from there on it would start the
        # interrupted stage over instead of continuing it
        keep_from = from_ is not None and names.index(from_) > stopped
        rerun = ["align", "pipeline", "run", file, *(["--from", from_] if keep_from else []),
                 *[a for o in set_ for a in ("--set", o)], *(["--seed", str(seed)] if seed is not None else []),
                 *(["--report-to", report_to] if report_to is not None else [])]
        console.print(f"[yellow]interrupted: the stages that finished are kept; to continue, run[/]\n"
                      f"  {escape(shlex.join(rerun))}", soft_wrap=True)
        raise SystemExit(130)
    P.raise_for_failure(results)
