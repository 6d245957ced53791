"""report: metrics.jsonl -> PNG grid of training curves."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from align.report import ema, numeric_keys, plot_report, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_metrics(path, n=120):
    """A run with train lines every step and an eval line every 20 steps, plus a torn last line."""
    lines = []
    for s in range(n):
        lines.append({"step": s, "loss": 1 / (1 + s), "reward": math.sin(s / 10), "kl": 0.001 * s, "stage": "ppo"})
        if s % 20 == 0:
            lines.append({"step": s, "eval/accuracy": s / n})
    path.write_text("\n".join(json.dumps(x) for x in lines) + '\n{"step": 120, "loss"')
    return path


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 5_000


def test_read_metrics_skips_torn_lines_and_finds_numeric_keys(tmp_path):
    rows = read_metrics(write_metrics(tmp_path / "metrics.jsonl"))
    assert len(rows) == 126
    assert numeric_keys(rows) == ["loss", "reward", "kl", "eval/accuracy"]


@pytest.fixture
def drawn(monkeypatch):
    """The panels of every figure saved during the test: [{title: [y values of each line]}] per figure, the
    panels that were switched off left out."""
    from matplotlib.figure import Figure

    figures, save = [], Figure.savefig

    def record(fig, *args, **kwargs):
        figures.append({ax.get_title(): [list(line.get_ydata()) for line in ax.get_lines()]
                        for ax in fig.axes if ax.axison and ax.get_title()})
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    return figures


def test_plot_report_writes_png(tmp_path, drawn):
    metrics = write_metrics(tmp_path / "metrics.jsonl")
    out = plot_report(metrics, tmp_path / "plots" / "curves.png", "PPO test run")
    assert out == tmp_path / "plots" / "curves.png"
    assert_png(out)
    assert [p.name for p in out.parent.iterdir()] == ["curves.png"]  # no temp file left behind
    (panels,) = drawn
    assert list(panels) == ["reward", "kl", "loss", "eval/accuracy"]  # every logged metric, the key ones first
    assert panels["eval/accuracy"] == [[s / 120 for s in range(0, 120, 20)]]  # few points: drawn as they are


def test_plot_report_selected_keys_and_few_points(tmp_path, drawn):
    metrics = write_metrics(tmp_path / "metrics.jsonl", n=10)
    out = plot_report(metrics, tmp_path / "sel.png", "subset", keys=["loss", "missing"])
    assert_png(out)
    (panels,) = drawn
    assert panels == {"loss": [[1 / (1 + s) for s in range(10)]]}  # only the key asked for and logged, each point


def test_nothing_to_plot_returns_none(tmp_path):
    empty = tmp_path / "metrics.jsonl"
    empty.write_text("")
    assert plot_report(empty, tmp_path / "a.png", "empty") is None
    assert plot_report(tmp_path / "absent.jsonl", tmp_path / "a.png", "absent") is None
    assert plot_report(write_metrics(empty), tmp_path / "a.png", "t", keys=["nope"]) is None
    assert not (tmp_path / "a.png").exists()


def test_ema():
    assert ema([1.0, 1.0, 1.0], span=3) == [1.0, 1.0, 1.0]
    assert ema([0.0, 2.0], span=3) == [0.0, 1.0]


def test_import_is_instant():
    code = "import sys, align.report; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


def dashboard_rows(n=30, shift=0.0):
    """A GRPO-like run: every step's metrics (a constant one, a duplicate of the reward) and evaluations."""
    rows = []
    for s in range(1, n + 1):
        rows.append({"step": s, "time/step": 0.1 + s / 1000, "tokens_per_s": 900 + s, "lr": 1e-3, "grad_norm": 2 / s,
                     "loss": 1 / s + shift, "reward": math.sin(s), "rewards/math": math.sin(s), "kl": 0.01 * s,
                     "kl_coef": 0.1 - 0.001 * s, "entropy": 2 - s / 100, "completions/mean_length": 10 + s,
                     "gold_reward": math.cos(s), "memory/peak_gib": 1 + s / 100, "distinct_1": 0.5 + s / 1000})
        if s % 10 == 0:
            rows.append({"step": s, "eval/pass@1/greedy": s / 40, "eval/pass@1/greedy_stderr": 0.05,
                         "eval/loss": 1 / s})
    return rows


def test_dashboard_panels_key_first_then_groups_constant_and_duplicate_series_left_out():
    from align.report import choose_panels

    panels = choose_panels(dashboard_rows())
    assert [(p.title, p.group) for p in panels] == [
        ("reward, gold_reward", "key"),  # the proxy with the gold reward; rewards/math, identical to it, is not drawn
        ("eval/pass@1/greedy", "key"), ("kl, kl_coef", "key"), ("entropy", "key"),
        ("completions/mean_length", "key"), ("loss", "key"),
        ("grad_norm", "other"), ("distinct_1", "other"), ("eval/loss", "other"),
        ("tokens_per_s", "throughput"), ("memory/peak_gib", "memory"), ("time/step", "timing")]
    drawn = {k for p in panels for k in p.series}
    assert "lr" not in drawn and "rewards/math" not in drawn and "eval/pass@1/greedy_stderr" not in drawn
    passk = panels[1]
    assert passk.points and passk.stderr == {"eval/pass@1/greedy": "eval/pass@1/greedy_stderr"}
    assert [p.points for p in panels] == [p.series[0].startswith("eval/") for p in panels]
    # a series that varies in one run only is drawn when runs are overlaid: lr differs between these two
    other = [{**r, "lr": 2e-3} if "lr" in r and r["step"] > 5 else r for r in dashboard_rows()]
    assert "lr" in {k for p in choose_panels([dashboard_rows(), other]) for k in p.series}


def test_a_float32_metric_and_its_float64_twin_are_one_curve():
    """The reward (float32 mean) and its one reward function's mean (float64) differ in the 8th digit: one panel."""
    import numpy as np

    from align.report import choose_panels

    rows = [{"step": s, "reward": float(np.float32(v)), "rewards/math": v, "loss": 1.0 / s}
            for s, v in enumerate([0.005262889045372105, 0.0121, 0.1003], start=1)]
    assert [p.title for p in choose_panels(rows)] == ["reward", "loss"]
    rows[1]["rewards/math"] += 1e-3  # a real difference is drawn
    assert [p.title for p in choose_panels(rows)] == ["reward", "rewards/math", "loss"]


def test_evaluations_are_drawn_as_points_with_error_bars():
    from matplotlib.figure import Figure

    from align.report import _draw_panel, choose_panels

    panels = {p.title: p for p in choose_panels(dashboard_rows())}
    ax = Figure().subplots()
    _draw_panel(ax, panels["eval/pass@1/greedy"], [dashboard_rows()], ["run"])
    (bar,) = ax.containers
    line, caps, (bars,) = bar  # the points, the caps and the bars of the standard errors
    assert line.get_linestyle() == "None" and line.get_marker() == "o"  # points, not a line
    assert list(line.get_xdata()) == [10, 20, 30]
    assert [seg[1][1] - seg[0][1] for seg in bars.get_segments()] == pytest.approx([0.1, 0.1, 0.1])
    ax = Figure().subplots()
    _draw_panel(ax, panels["loss"], [dashboard_rows()], ["run"])
    assert ax.get_lines()[0].get_linestyle() == "-"


def test_align_report_overlays_two_runs(tmp_path):
    from align.report import choose_panels
    from tests.conftest import output, run_align

    for name, shift in (("a", 0.0), ("b", 0.5)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in dashboard_rows(20, shift)))
    proc = run_align("report", tmp_path / "a", tmp_path / "b", "--out", tmp_path / "both.png")
    assert proc.returncode == 0, output(proc)
    assert_png(tmp_path / "both.png")
    runs = [read_metrics(tmp_path / n / "metrics.jsonl") for n in "ab"]
    from matplotlib.figure import Figure

    from align.report import _draw_panel

    loss = next(p for p in choose_panels(runs) if p.title == "loss")
    ax = Figure().subplots()
    _draw_panel(ax, loss, runs, ["a", "b"])
    a, b = ax.get_lines()
    assert (a.get_label(), b.get_label()) == ("a", "b") and a.get_color() != b.get_color()
    assert list(b.get_ydata()) == pytest.approx([y + 0.5 for y in a.get_ydata()])
    proc = run_align("report", tmp_path / "missing")
    assert proc.returncode == 2 and "no metrics.jsonl" in output(proc)
