"""Local `evaluate` metrics (one folder each, loaded from disk, never from the Hub).

`import evaluate` takes seconds, so it happens inside load_metric only.
"""

from pathlib import Path

from align.errors import UserError
from align.passk import mean_pass_at_k, pass_at_k  # noqa: F401  (re-exported)

METRICS_DIR = Path(__file__).parent


def available_metrics() -> list:
    """Names of the metric folders shipped here (folder <name> holding <name>.py)."""
    return sorted(p.name for p in METRICS_DIR.iterdir() if (p / f"{p.name}.py").is_file())


def load_metric(name: str, **kwargs):
    """`evaluate.load` of the local metric folder `name`; works offline.

    keep_in_memory defaults to True so computing writes no cache files (no locks under ~/.cache).
    """
    path = METRICS_DIR / name
    if not (path / f"{name}.py").is_file():
        raise UserError(f"unknown metric {name!r}; available: {', '.join(available_metrics())}")
    import evaluate

    kwargs.setdefault("keep_in_memory", True)
    return evaluate.load(str(path), **kwargs)
