"""torch.compile's work kept across runs, and the time it costs a run.

The GPU runs compile the transformer blocks (align.engine.build.compile_blocks) and the fast decoder's step
(align.rollout.fast): about a minute in a process's first steps. Inductor caches what it compiles — the FX
graph cache and the AOTAutograd cache (forward and backward), and the Triton kernels under the same directory —
keyed by the graph, the torch / Triton versions and the device, so a later process that compiles the same
graphs (the same command again, every stage of a pipeline on the same model shape) loads them instead of
compiling; Dynamo still traces each graph (seconds). torch's default directory is under /tmp
(/tmp/torchinductor_$USER), which many machines clear; align points it at the user's cache directory instead,
one directory per torch version (a new torch leaves the old one to delete).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"


def cache_root() -> Path:
    """align's cache directory: $ALIGN_CACHE_DIR, else $XDG_CACHE_HOME/align, else ~/.cache/align."""
    if os.environ.get("ALIGN_CACHE_DIR"):
        return Path(os.environ["ALIGN_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "align"


def use_persistent_cache() -> str:
    """Point inductor's caches at cache_root()/torch-compile/torch-VERSION, unless $TORCHINDUCTOR_CACHE_DIR is set
    (then that is kept). Call before anything compiles; inductor creates the directory when it first writes.
    Returns the directory in use."""
    if os.environ.get(INDUCTOR_ENV):
        return os.environ[INDUCTOR_ENV]
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch_version = version("torch")  # without importing torch: the CLI calls this first thing
    except PackageNotFoundError:
        torch_version = "unknown"
    path = cache_root() / "torch-compile" / f"torch-{torch_version}"
    os.environ[INDUCTOR_ENV] = str(path)
    return str(path)


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile so far: Dynamo's frame compiles (tracing, inductor's
    forward) and the backward graphs AOTAutograd compiles at their first call. 0.0 when nothing compiled (Dynamo
    not even imported)."""
    if "torch._dynamo" not in sys.modules:
        return 0.0
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))
