"""Training-curve plots from metrics.jsonl.

matplotlib is imported inside the plotting functions (Agg canvas, no pyplot state), so
`import align.report` is instant and plotting works on headless machines and in threads.
"""

import json
import math
import os
import tempfile
from pathlib import Path

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


# What a person looks at first, in this order: the reward (proxy and gold), the KL, the entropy, held-out
# pass@k / accuracy, the loss; every other metric after them, in file order.
PANEL_GROUPS = (
    lambda k: k in ("reward", "gold_reward", "objective/scores", "objective/rlhf_reward") or k.startswith("rewards/"),
    lambda k: k in ("kl", "objective/kl", "kl_coef"),
    lambda k: k == "entropy",
    lambda k: "pass@" in k or k.endswith("accuracy") or k.endswith("accuracies"),
    lambda k: k == "loss" or k.endswith("/loss") or k.startswith("loss/"),
)


def panel_order(keys: list) -> list:
    """`keys` with the PANEL_GROUPS first (group by group, file order within a group), then the rest."""
    def rank(k: str) -> int:
        return next((i for i, g in enumerate(PANEL_GROUPS) if g(k)), len(PANEL_GROUPS))

    return sorted(keys, key=rank)  # stable: file order within a group


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


def _draw(ax, xs: list, ys: list, color: str = "C0", label: str | None = None, smooth: bool = True):
    """Raw points (faint when many, with an EMA line on top) of one curve."""
    if not smooth:
        ax.plot(xs, ys, "-", color=color, linewidth=1.5, label=label)
    elif len(xs) > RAW_POINTS_MAX:
        ax.plot(xs, ys, ".", color=color, alpha=0.3, markersize=3)
        ax.plot(xs, ema(ys, span=max(2, len(ys) // 20)), "-", color=color, linewidth=1.5, label=label)
    else:
        ax.plot(xs, ys, ".-", color=color, linewidth=1, markersize=4, label=label)


def plot_report(metrics_path: Path, out_png: Path, title: str, keys: list | None = None,
                xy: tuple | None = None) -> Path | None:
    """Plot each numeric metric (or `keys`) against step, one small subplot each, into out_png: the panels a
    person looks at first lead (`panel_order`), then the rest in file order.

    `xy = (x, [y1, y2])` adds a first panel of y1 (left axis) and y2 (right axis) against metric x, e.g. PPO's
    proxy and gold reward against KL (the over-optimisation curve); left out when x or y1 was never logged.
    Returns the PNG path, or None when there is nothing to plot (no file, no rows, no data for
    any of the keys).
    """
    rows = read_metrics(metrics_path) if Path(metrics_path).exists() else []
    curves = [(k, *series(rows, "step", k)) for k in (keys or panel_order(numeric_keys(rows)))]
    curves = [c for c in curves if c[1]]
    pairs = [(y, *series(rows, xy[0], y)) for y in xy[1]] if xy else []
    pairs = [c for c in pairs if c[1]]
    if not curves:
        return None
    from matplotlib.figure import Figure

    n = len(curves) + bool(pairs)
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    height = 2.8 * nrows + 0.5
    fig = Figure(figsize=(4 * ncols, height))
    # fixed margins, not a layout engine: constrained layout solved for ~1.5 s per report (every run's end)
    fig.subplots_adjust(left=0.07, right=0.97, bottom=0.5 / height, top=1 - 0.75 / height, wspace=0.3, hspace=0.55)
    fig.suptitle(title, y=1 - 0.15 / height)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    if pairs:
        ax = axes[0]
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
        axes = axes[1:]
    for ax, (key, xs, ys) in zip(axes, curves):
        _draw(ax, xs, ys, smooth=key not in UNSMOOTHED)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in axes[len(curves) :]:
        ax.set_axis_off()
    return _save_atomic(fig, out_png)
