"""report: metrics.jsonl -> PNG grid of training curves."""

import json
import math
import subprocess
import sys
from pathlib import Path

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


def test_plot_report_writes_png(tmp_path):
    metrics = write_metrics(tmp_path / "metrics.jsonl")
    out = plot_report(metrics, tmp_path / "plots" / "curves.png", "PPO test run")
    assert out == tmp_path / "plots" / "curves.png"
    assert_png(out)
    assert [p.name for p in out.parent.iterdir()] == ["curves.png"]  # no temp file left behind


def test_plot_report_selected_keys_and_few_points(tmp_path):
    metrics = write_metrics(tmp_path / "metrics.jsonl", n=10)
    out = plot_report(metrics, tmp_path / "sel.png", "subset", keys=["loss", "missing"])
    assert_png(out)


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


def test_panels_lead_with_reward_gold_kl_entropy_pass_at_k_and_loss():
    from align.report import panel_order

    logged = ["lr", "grad_norm", "loss/value", "loss", "eval/pass@1/greedy", "time/update", "entropy", "kl_coef",
              "gold_reward", "completions/mean_length", "kl", "reward", "rewards/math", "train/loss",
              "eval/accuracy", "distinct_1"]
    assert panel_order(logged) == [
        "gold_reward", "reward", "rewards/math",  # the reward group, in file order
        "kl_coef", "kl", "entropy", "eval/pass@1/greedy", "eval/accuracy", "loss/value", "loss", "train/loss",
        "lr", "grad_norm", "time/update", "completions/mean_length", "distinct_1"]
