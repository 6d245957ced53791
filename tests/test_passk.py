"""pass@k: hand-computed values, the evaluate metric agrees with align.passk and loads offline."""

import json
import os
import subprocess
import sys
from math import comb
from pathlib import Path

import pytest

from align.errors import UserError
from align.metrics import available_metrics, load_metric
from align.passk import mean_pass_at_k, pass_at_k

ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 1, 0.4),
    (5, 2, 2, 1 - comb(3, 2) / comb(5, 2)),  # 0.7
    (5, 0, 1, 0.0),
    (5, 0, 5, 0.0),
    (5, 5, 1, 1.0),
    (5, 3, 3, 1.0),  # n - c = 2 < k: every 3-subset holds a correct sample
    (1, 1, 1, 1.0),
])
def test_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_matches_binomial_formula_and_stays_finite_for_large_n():
    for n in range(1, 25):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)
    assert 0 < pass_at_k(2000, 3, 10) < 1


@pytest.mark.parametrize("n, c, k", [(5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6), (0, 0, 1)])
def test_invalid_counts_raise(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_mean_over_problems_and_k_larger_than_some_n():
    out = mean_pass_at_k(ns=[5, 5, 3], cs=[2, 0, 3], ks=[1, 2, 4])
    assert out["pass@1"] == pytest.approx((0.4 + 0 + 1) / 3)
    assert out["pass@2"] == pytest.approx((0.7 + 0 + 1) / 3)
    assert out["pass@4"] is None  # the third problem has only 3 samples
    assert mean_pass_at_k([], [], [1]) == {"pass@1": None}


def test_unknown_metric_is_a_user_error():
    assert "pass_at_k" in available_metrics()
    with pytest.raises(UserError, match="pass_at_k"):
        load_metric("pass_at_kk")


def test_evaluate_module_agrees_and_loads_offline(tmp_path):
    """In a fresh process with the Hub switched off and an empty HF cache."""
    code = """
import json, sys
from align.metrics import load_metric
lazy = "evaluate" not in sys.modules
m = load_metric("pass_at_k")
print(json.dumps({
    "lazy": lazy,
    "a": m.compute(predictions=[2, 0, 5, 3], references=[5, 5, 5, 8], k=[1, 2, 8]),
    "b": m.compute(predictions=[1], references=[4]),
}))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["lazy"]
    ns, cs = [5, 5, 5, 8], [2, 0, 5, 3]
    for k in (1, 2):
        assert out["a"][f"pass@{k}"] == pytest.approx(sum(pass_at_k(n, c, k) for n, c in zip(ns, cs)) / 4)
    assert out["a"]["pass@8"] is None
    assert out["b"] == {"pass@1": pytest.approx(0.25)}
