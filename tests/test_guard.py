"""The GPU speed guard's comparison (benchmarks/guard.py): which measured figures fail against a baseline."""

from benchmarks.guard import SMALL, compare, median_metrics


def test_a_phase_slower_than_the_tolerance_fails_and_memory_has_its_own():
    base = {"time/generate": 1.40, "time/update": 1.00, "time/reward": 0.002, "peak_gib": 13.87}
    now = {"time/generate": 1.45, "time/update": 1.029, "time/reward": 0.002 + SMALL / 2, "peak_gib": 14.0}
    got = {k: ok for k, _, _, ok in compare(base, now, tolerance=0.03, memory_tolerance=0.01)}
    # 3.6 % slower fails, 2.9 % passes; a 2-ms phase gets SMALL seconds of slack; +0.9 % memory passes
    assert got == {"time/generate": False, "time/update": True, "time/reward": True, "peak_gib": True}
    got = {k: ok for k, _, _, ok in compare(base, {**now, "peak_gib": 14.1}, 0.03, 0.01)}
    assert got["peak_gib"] is False  # +1.7 %
    got = {k: ok for k, _, _, ok in compare(base, {"time/update": 0.9}, 0.03, 0.01)}
    assert got == {"time/generate": False, "time/update": True, "time/reward": False, "peak_gib": False}  # missing


def test_repeated_runs_are_compared_by_each_metrics_median():
    runs = [{"time/step": 2.0, "peak_gib": 13.0}, {"time/step": 2.6, "peak_gib": 13.1},
            {"time/step": 2.1, "peak_gib": 13.0, "time/generate": 1.0}]
    assert median_metrics(runs) == {"peak_gib": 13.0, "time/step": 2.1}  # a metric not in every run is left out
    assert median_metrics(runs[:2]) == {"peak_gib": 13.05, "time/step": 2.3}
