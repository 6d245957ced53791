"""Cold start: the first GRPO step of a fresh process, compiling from nothing, then from align's compile cache.

    python -m benchmarks.cold_start [--models 135m] [--runs 2] [--steps 3] [--out DIR] [--ours-extra "..."]
                                    [--gradient-checkpointing]

Runs the vs-TRL harness' `align grpo` command (random init at the model's shape, 8 prompts x G 8, 512 new
tokens, micro 16; see benchmarks.grpo_vs_trl) at align's defaults otherwise — no gradient checkpointing, which
the memory plan does not need at this shape; the harness' TRL comparison turns it on for both sides, and
--gradient-checkpointing does here — `--runs` times, each a fresh process with
the compile cache in OUT/cache (ALIGN_CACHE_DIR; empty before the first run, TORCHINDUCTOR_CACHE_DIR unset), and
prints per run: the process' wall time, step 1's time/step, time/generate, time/update and time/compile (the
seconds torch.compile took inside the step), and the median of the later steps. Measured on one H200 at 135M:
step 1 19 s on the first run (the compiles) and 6.5 s on the next (the cache), against ~1.6 s steady.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

from benchmarks import vs_trl as V
from benchmarks.grpo_vs_trl import long_prompts, ours_command, shape_args

KEYS = ("time/step", "time/generate", "time/update", "time/compile")


def one_run(model: Path, a, out: Path, cache: Path) -> dict | None:
    """One fresh `align grpo` process: its wall time, step 1's KEYS and the later steps' median time/step."""
    env = {"ALIGN_CACHE_DIR": str(cache), "TORCHINDUCTOR_CACHE_DIR": ""}  # "" = unset for use_persistent_cache
    t = time.time()
    if not V.run(ours_command(model, a, 1, out, a.prompts), out.parent / (out.name + ".log"), env=env, timeout=900):
        return None
    wall = time.time() - t
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "time/generate" in r]
    later = [r["time/step"] for r in steps[1:]]
    return {"wall": wall, **{k: steps[0].get(k, float("nan")) for k in KEYS},
            "steady": statistics.median(later) if later else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    V.harness_args(ap, models="135m", steps=3)
    ap.add_argument("--runs", type=int, default=2)
    shape_args(ap)
    ap.add_argument("--gradient-checkpointing", dest="gradient_checkpointing", action="store_true")
    ap.set_defaults(gradient_checkpointing=False)
    a = ap.parse_args()
    a.multi_extra = ""
    root = V.out_root(a.out, "align-cold-start-")
    long_prompts(a, root)
    lines = ["| model | run | process wall (s) | step 1 (s) | generate | update | compile | later steps (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for name in a.models.split(","):
        model, cache = V.make_model(name, root), root / f"cache-{name}"
        shutil.rmtree(cache, ignore_errors=True)
        for i in range(1, a.runs + 1):
            shutil.rmtree(root / f"{name}-run{i}", ignore_errors=True)
            r = one_run(model, a, root / f"{name}-run{i}", cache)
            if r:
                lines.append(f"| {name} | {i}{' (empty cache)' if i == 1 else ''} | {r['wall']:.1f} | "
                             f"{r['time/step']:.2f} | {r['time/generate']:.2f} | {r['time/update']:.2f} | "
                             f"{r['time/compile']:.2f} | {r['steady']:.2f} |")
    print("\n".join(lines))
    (root / "cold_start.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
