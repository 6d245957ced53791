"""Console output on rank 0 only: messages, a progress bar with ETA and live metrics, summary tables."""

from __future__ import annotations

import math
import os
import time

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

# emoji=False: a message quoting the user's input (--reward math:abc) is printed as written, never with an emoji
# for a :name: code; markup in such a message is escaped where it is printed (`warn`, the CLI's error line)
console = Console(highlight=False, emoji=False)


def is_main() -> bool:
    return os.environ.get("RANK", "0") == "0"


_said: set[str] = set()  # the messages printed so far (rank 0): `once` prints a message a single time


def _print(text: str, msg: str, once: bool) -> None:
    if is_main() and not (once and msg in _said):
        _said.add(msg)
        console.print(text)


def info(msg: str, once: bool = False) -> None:
    """A line on rank 0; `once`: not again in this process."""
    _print(msg, msg, once)


def warn(msg: str, once: bool = False) -> None:
    """A warning on rank 0, printed as written (no markup); `once`: not again in this process."""
    _print(f"[yellow]warning:[/] {escape(msg)}", "warning: " + msg, once)


def fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.3e}"
        return f"{v:.4g}"
    return str(v)


class TrainProgress:
    """`with TrainProgress("sft", total) as p: p.update(step, {"loss": ...})`: a bar with ETA and live metrics on a
    terminal; elsewhere (a log file, CI, a pipe) a plain line every `total // 20` steps and at the last."""

    def __init__(self, title: str, total: int, start: int = 0, keys: tuple[str, ...] = ()):
        self.title, self.total, self.start, self.keys = title, total, start, keys
        self.enabled = is_main()
        self.live = self.enabled and console.is_terminal
        self.every = max(1, total // 20)
        self.t0 = time.time()
        self.progress = Progress(
            TextColumn(f"[bold]{title}[/]"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[metrics]}"),
            console=console,
            transient=False,
            disable=not self.live,
        )
        self.task = None
        self.done = self.shown = start

    def advance(self, n: int) -> None:
        """n more items done (generation batches: a plain line whenever a twentieth is passed)."""
        self.done += n
        self.update(self.done, {})

    def __enter__(self):
        self.progress.__enter__()
        self.task = self.progress.add_task("train", total=self.total, completed=self.start, metrics="")
        return self

    def update(self, step: int, metrics: dict) -> None:
        shown = {k: metrics[k] for k in (self.keys or metrics) if k in metrics}
        text = "  ".join(f"{k} {fmt(v)}" for k, v in shown.items())
        if self.live:
            self.progress.update(self.task, completed=step, metrics=text)
        elif self.enabled and (step // self.every > self.shown // self.every or step == self.total):
            self.shown = step
            elapsed = time.time() - self.t0
            eta = elapsed / max(step - self.start, 1) * (self.total - step)
            console.print(f"{self.title} {step}/{self.total} {_clock(elapsed)} eta {_clock(eta)}  {text}",
                          markup=False, soft_wrap=True)

    def print(self, msg: str) -> None:
        if self.enabled:
            self.progress.console.print(msg)

    def __exit__(self, *exc):
        self.progress.__exit__(*exc)


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}"


def summary_table(title: str, rows: dict) -> None:
    if not is_main():
        return
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in rows.items():
        table.add_row(k, fmt(v))
    console.print(table)


def table(title: str, header: list[str], rows: list[list[str]], footer: list[str] = ()) -> None:
    """Columns of text (the first left-aligned, the others right): a rich table on a terminal, plain aligned lines
    elsewhere (a log file, a pipe); `footer` lines below it."""
    if not is_main():
        return
    if console.is_terminal:
        t = Table(title=title, header_style="bold")
        for i, h in enumerate(header):
            t.add_column(h, justify="left" if i == 0 else "right")
        for r in rows:
            t.add_row(*r)
        console.print(t)
    else:
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        console.print(title, markup=False, soft_wrap=True)
        for r in [header, *rows]:
            cells = [str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
            console.print("  " + "  ".join(cells).rstrip(), markup=False, soft_wrap=True)
    for line in footer:
        console.print(line, markup=False, soft_wrap=True)
