"""Training-curve plots from metrics.jsonl.

matplotlib is imported inside the plotting functions (Agg canvas, no pyplot state), so
`import align.report` is instant and plotting works on headless machines and in threads.
"""

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from align.config import Options, opt
from align.errors import UserError

RAW_POINTS_MAX = 50  # above this many points, draw raw values faint and an EMA line on top


def read_metrics(path: Path) -> list:
    """Rows of a metrics.jsonl file. Blank and unparsable lines (e.g. a half-written last line
    while training is still running) and rows without a numeric "step" are skipped."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and _is_number(row.get("step")):
            rows.append(row)
    return rows


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def numeric_keys(rows: list) -> list:
    """Keys (other than "step") that carry a finite number in at least one row, in first-seen order."""
    keys = {}
    for row in rows:
        for k, v in row.items():
            if k != "step" and _is_number(v):
                keys[k] = None
    return list(keys)


# The dashboard: what a person looks at first, in this order (one panel each, several series drawn together where
# they belong together): the proxy reward with the gold reward, its components, held-out pass@1 (points with their
# standard error), the KL with its coefficient β, the entropy, the completion length, the loss. Then every other
# metric in file order, then throughput, memory and timing. Constant series are left out, and a series identical to
# one drawn already (`reward` and `rewards/math` with a single reward) is drawn once.
KEY_PANELS = (
    ("reward", "objective/scores", "objective/rlhf_reward", "online/reward"),  # the proxy, first one logged
    ("gold_reward",),  # drawn with the proxy when both are logged
    ("kl", "objective/kl"),
    ("kl_coef", "beta"),  # drawn with the KL when both are logged
    ("entropy",),
    ("completions/mean_length",),
    ("loss", "train/loss"),
)
GROUPS = ("key", "other", "throughput", "memory", "timing")
STDERR = "_stderr"  # a metric K with a K_stderr beside it is drawn with error bars, K_stderr no panel of its own


@dataclass
class Panel:
    """One subplot: `series` (metric names) against step, titled by their names; `points`: evaluations, drawn as
    points (with `stderr`: {series: its standard-error metric}) rather than lines."""

    series: list
    group: str = "other"
    points: bool = False
    stderr: dict = field(default_factory=dict)

    @property
    def title(self) -> str:
        return ", ".join(self.series)


def group_of(key: str) -> str:
    if key.startswith("time/"):
        return "timing"
    if "memory" in key:
        return "memory"
    if key.endswith("_per_s") or key in ("tokens", "pairs"):
        return "throughput"
    return "other"


def is_eval(key: str) -> bool:
    return key.startswith("eval/")


def _signature(runs: list, key: str) -> tuple:
    """The series' points, values to 6 significant digits: a float32 metric and its float64 twin (the reward and
    its one reward function's mean) are the same curve."""
    return tuple(tuple((x, float(f"{y:.6g}")) for x, y in zip(*series(rows, "step", key))) for rows in runs)


def _constant(runs: list, key: str) -> bool:
    """Two or more values, all equal, in every run (a single evaluation is a point worth showing)."""
    values = [v for rows in runs for v in series(rows, "step", key)[1]]
    return len(values) > 1 and all(v == values[0] for v in values)


def choose_panels(runs: list) -> list:
    """The dashboard's panels for one run's metrics rows, or several runs' (a list of row lists, overlaid): a pure
    function of the rows (no drawing), in the order described above."""
    runs = [runs] if runs and isinstance(runs[0], dict) else runs
    keys = list(dict.fromkeys(k for rows in runs for k in numeric_keys(rows)))
    stderr = {k[: -len(STDERR)]: k for k in keys if k.endswith(STDERR) and k[: -len(STDERR)] in keys}
    keys = [k for k in keys if k not in stderr.values() and not _constant(runs, k)]
    seen, kept = set(), []
    for k in _key_first(keys):  # of identical series, the first in dashboard order is drawn
        sig = _signature(runs, k)
        if sig not in seen:
            seen.add(sig)
            kept.append(k)
    return _panels([k for k in keys if k in kept], stderr)


def _key_first(keys: list) -> list:
    named = [k for names in KEY_PANELS for k in names if k in keys]
    passk = [k for k in keys if is_eval(k) and "pass@1" in k]
    return list(dict.fromkeys(named + passk + [k for k in keys if k.startswith("rewards/")] + keys))


def _panels(keys: list, stderr: dict) -> list:
    def first(names):
        return next((k for k in names if k in keys), None)

    proxy, gold, kl, beta, entropy, length, loss = (first(names) for names in KEY_PANELS)
    key = [Panel([k for k in (proxy, gold) if k], "key")] if proxy or gold else []
    key += [Panel([k], "key") for k in keys if k.startswith("rewards/")]
    key += [Panel([k], "key", True, {k: stderr[k]} if k in stderr else {}) for k in keys if is_eval(k) and "pass@1" in k]
    key += [Panel([k for k in (kl, beta) if k], "key")] if kl or beta else []
    key += [Panel([k], "key") for k in (entropy, length, loss) if k]
    used = {k for p in key for k in p.series}
    rest = [Panel([k], group_of(k), is_eval(k), {k: stderr[k]} if k in stderr else {}) for k in keys if k not in used]
    return key + sorted(rest, key=lambda p: GROUPS.index(p.group))  # stable: file order within a group


def series(rows: list, x: str, y: str) -> tuple:
    """(xs, ys) over the rows where both x and y are finite numbers."""
    pairs = [(r[x], r[y]) for r in rows if _is_number(r.get(x)) and _is_number(r.get(y))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def ema(values: list, span: float) -> list:
    """Exponential moving average with alpha = 2 / (span + 1), started at the first value."""
    alpha, out = 2 / (span + 1), []
    for v in values:
        out.append(v if not out else out[-1] + alpha * (v - out[-1]))
    return out


def _save_atomic(fig, out_png: Path) -> Path:
    """Write the figure to a temp file next to out_png, then rename it into place."""
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_png.parent, prefix=f".{out_png.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=100)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, out_png)
    except BaseException:
        os.unlink(tmp)
        raise
    return out_png


# Deterministic or already-averaged series: an EMA would only add lag.
UNSMOOTHED = ("lr", "tokens_per_s")


def _draw(ax, xs: list, ys: list, color: str = "C0", label: str | None = None, smooth: bool = True,
          style: str = "-"):
    """Raw points (faint when many, with an EMA line on top) of one curve, its line in `style` ("-", "--")."""
    if not smooth:
        ax.plot(xs, ys, style, color=color, linewidth=1.5, label=label)
    elif len(xs) > RAW_POINTS_MAX:
        ax.plot(xs, ys, ".", color=color, alpha=0.3, markersize=3)
        ax.plot(xs, ema(ys, span=max(2, len(ys) // 20)), style, color=color, linewidth=1.5, label=label)
    else:
        ax.plot(xs, ys, "." + style, color=color, linewidth=1, markersize=4, label=label)


def _draw_panel(ax, panel: Panel, runs: list, labels: list) -> None:
    """Every series of `panel` for every run: a run's colour, a series' line style (the second series of a panel
    on its own right-hand axis: β beside the KL, the gold reward beside the proxy); evaluations as points."""
    many, sides = len(runs) > 1, []
    for i, key in enumerate(panel.series[:2]):
        side = ax if i == 0 else ax.twinx()
        sides.append(side)
        for j, rows in enumerate(runs):
            xs, ys = series(rows, "step", key)
            if not xs:
                continue
            color = f"C{j if many else i}"
            label = f"{labels[j]}: {key}" if many and len(panel.series) > 1 else (labels[j] if many else key)
            if panel.points:
                err = series(rows, "step", panel.stderr[key])[1] if key in panel.stderr else None
                side.errorbar(xs, ys, yerr=err if err and len(err) == len(ys) else None, fmt="o", color=color,
                              markersize=4, capsize=3, label=label)
            else:
                _draw(side, xs, ys, color=color, label=label, smooth=key not in UNSMOOTHED,
                      style="--" if i else "-")
        side.tick_params(labelsize=7)
        if len(panel.series) > 1:
            side.set_ylabel(key, fontsize=8)
    ax.set_title(panel.title, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.grid(alpha=0.3)
    if many or len(panel.series) > 1:
        ax.legend(handles=[h for side in sides for h in side.get_legend_handles_labels()[0]], fontsize=6)


def _draw_xy(ax, rows: list, xy: tuple) -> bool:
    """The panel of xy[1]'s metrics (left and right axis) against metric xy[0]; False when there is nothing."""
    pairs = [c for c in ((y, *series(rows, xy[0], y)) for y in xy[1]) if c[1]]
    if not pairs:
        return False
    for i, (y, xs, ys) in enumerate(pairs[:2]):
        side = ax if i == 0 else ax.twinx()
        # noisy per-step points, faint; the trajectory as EMAs of both coordinates (in step order) on top
        side.plot(xs, ys, ".", color=f"C{i}", alpha=0.3, markersize=3)
        span = max(2, len(xs) // 5)
        side.plot(ema(xs, span), ema(ys, span), "-", color=f"C{i}", linewidth=1.5, label=y)
        side.set_ylabel(y, fontsize=8, color=f"C{i}")
        side.tick_params(labelsize=7)
    ax.set_title(" and ".join(p[0] for p in pairs[:2]) + f" vs {xy[0]}", fontsize=9)
    ax.set_xlabel(xy[0], fontsize=8)
    ax.grid(alpha=0.3)
    return True


def plot_runs(runs: list, out_png: Path, title: str, labels: list | None = None, panels: list | None = None,
              xy: tuple | None = None) -> Path | None:
    """The dashboard of one run's metrics rows, or of several runs' overlaid (`runs`: a list of row lists, `labels`
    naming them), into out_png: `panels` (by default `choose_panels`), three to a row. `xy = (x, [y1, y2])` adds,
    after the key panels of one run, a panel of y1 (left axis) and y2 (right axis) against metric x, e.g. PPO's
    proxy and gold reward against KL (the over-optimisation curve). None when there is nothing to draw."""
    panels = choose_panels(runs) if panels is None else panels
    labels = labels or [f"run {i + 1}" for i in range(len(runs))]
    with_xy = bool(xy) and len(runs) == 1 and any(series(runs[0], xy[0], y)[0] for y in xy[1])
    if not panels:
        return None
    from matplotlib.figure import Figure

    n = len(panels) + with_xy
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    height = 2.8 * nrows + 0.5
    fig = Figure(figsize=(4 * ncols, height))
    # fixed margins, not a layout engine: constrained layout solved for ~1.5 s per report (every run's end)
    fig.subplots_adjust(left=0.07, right=0.93, bottom=0.5 / height, top=1 - 0.75 / height, wspace=0.35, hspace=0.55)
    fig.suptitle(title, y=1 - 0.15 / height)
    axes = list(fig.subplots(nrows, ncols, squeeze=False).ravel())
    at = sum(p.group == "key" for p in panels)  # the xy panel follows the key panels
    for panel in panels[:at]:
        _draw_panel(axes.pop(0), panel, runs, labels)
    if with_xy:
        _draw_xy(axes.pop(0), runs[0], xy)
    for panel in panels[at:]:
        _draw_panel(axes.pop(0), panel, runs, labels)
    for ax in axes:
        ax.set_axis_off()
    return _save_atomic(fig, out_png)


def plot_report(metrics_path: Path, out_png: Path, title: str, keys: list | None = None,
                xy: tuple | None = None) -> Path | None:
    """The dashboard of one run's metrics.jsonl (`plot_runs`); `keys`: only these metrics, one panel each.
    Returns the PNG path, or None when there is nothing to plot (no file, no rows, no data for any of the keys)."""
    rows = read_metrics(metrics_path) if Path(metrics_path).exists() else []
    panels = None
    if keys is not None:
        panels = [Panel([k], points=is_eval(k)) for k in keys if series(rows, "step", k)[0]]
    return plot_runs([rows], out_png, title, panels=panels, xy=xy) if rows else None


def run_metrics(run: Path) -> Path:
    """The metrics.jsonl of a run directory (or the file itself); a UserError when there is none."""
    run = Path(run)
    f = run if run.is_file() else run / "metrics.jsonl"
    if not f.is_file():
        raise UserError(f"{run}: no metrics.jsonl; give a run directory (a stage's --out) or a metrics.jsonl file.")
    return f


# ----------------------------------------------------------------------------------------- `align report`


@dataclass(frozen=True)
class ReportConfig(Options):
    runs: list[str] = opt([], "Run directories (a stage's --out) or metrics.jsonl files; several are overlaid.")
    out: str = opt("", "The PNG to write (default: RUN/report.png for one run, report.png here for several).")
    title: str = opt("", "The figure's title (default: the stage and model of one run, the runs' names of several).")


def labels_of(runs: list) -> list:
    """Short names of the runs: their directory names, or their whole paths where those repeat."""
    names = [Path(r).name if Path(r).is_dir() else Path(r).parent.name for r in runs]
    return names if len(set(names)) == len(names) else [str(r) for r in runs]


def run_report(cfg) -> Path:
    """`align report RUN [RUN...]`: the dashboard of one run, or of several overlaid."""
    from align.console import info

    if not cfg.runs:
        raise UserError("align report: name at least one run directory (a stage's --out) or metrics.jsonl file.")
    files = [run_metrics(r) for r in cfg.runs]
    runs = [read_metrics(f) for f in files]
    one = len(runs) == 1
    out = Path(cfg.out) if cfg.out else (files[0].parent / "report.png" if one else Path("report.png"))
    title = cfg.title or (_run_title(files[0].parent) if one else " vs ".join(labels_of(cfg.runs)))
    if plot_runs(runs, out, title, labels=labels_of(cfg.runs)) is None:
        raise UserError(f"{', '.join(map(str, files))}: no numeric metrics to plot.")
    info(f"report → {out}")
    return out


def _run_title(run: Path) -> str:
    try:
        art = json.loads((run / "artifact.json").read_text())
        return f"{art['stage']} — {art['config']['model']}"
    except (OSError, ValueError, KeyError, TypeError):
        return run.name
