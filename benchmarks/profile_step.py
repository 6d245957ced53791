"""Where a training step's time goes: one `align` stage run in this process, its steps profiled.

    python -m benchmarks.profile_step --out /tmp/prof -- dpo --model DIR --max-steps 6 --batch-size 64

The first --warmup steps (default 2) warm up (compiles, allocator growth); the next two run under torch.profiler:
each phase the stage
marks (time/generate, time/update, ...) with its wall, GPU kernel time and top kernels; the table of the ops
that take the most GPU time and the most CPU time, and the GPU's busy fraction (kernel time / wall time) — a
step that keeps the GPU busy under ~50 % is bound by the CPU (Python, hooks, launches), not by the GPU.
The two after those run under cProfile: the Python functions with the most cumulative time (which library's
hooks, which of our functions). The run needs --warmup + 4 steps. Tables go to stdout and to --out.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path


def is_annotation(e, names: set[str]) -> bool:
    """A GPU-side copy of a `record_function` range (time/update, Optimizer.step#...; `names`: the ranges' names):
    it spans the range's kernels, it is not one, so kernel sums leave it out."""
    return bool(getattr(e, "is_user_annotation", False)) or e.name in names


def kernels_of(events) -> list:
    names = {x.name for x in events if x.device_type.name == "CPU" and getattr(x, "is_user_annotation", False)}
    return [e for e in events if e.device_type.name == "CUDA" and not is_annotation(e, names)]


def phases(events, rows: int) -> list[str]:
    """Each named phase of the profiled steps (the `time/...` ranges a stage marks): its wall time, the GPU kernel
    time launched inside it and the kernels that take the most of it. A phase whose kernels fill much less than
    its wall is bound by the host (Python, launches, synchronisations), not by the GPU."""
    kernels = kernels_of(events)
    ranges: dict[str, list] = {}
    for e in events:
        if e.device_type.name == "CPU" and e.name.startswith("time/"):
            ranges.setdefault(e.name, []).append(e.time_range)
    out = []
    for name, spans in sorted(ranges.items()):
        wall = sum(r.elapsed_us() for r in spans) / 1e6
        inside = [k for k in kernels if any(r.start <= k.time_range.start < r.end for r in spans)]
        by: dict[str, list[float]] = {}
        for k in inside:
            by.setdefault(k.name, []).append(k.time_range.elapsed_us() / 1e6)
        busy = sum(map(sum, by.values()))
        out += ["", f"phase {name} ({len(spans)} ranges): wall {wall:.3f} s, {len(inside)} kernels, GPU {busy:.3f} s "
                    f"({100 * busy / max(wall, 1e-9):.0f} % of the wall)", "  GPU s  | calls | kernel"]
        for k, ts in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:rows]:
            out.append(f"  {sum(ts):.4f} | {len(ts):5d} | {k[:110]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="profile")
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=2, help="steps before the profiled ones (compiles, warm-up)")
    ap.add_argument("stage_args", nargs=argparse.REMAINDER, help="-- then an align command, e.g. -- dpo --model DIR")
    a = ap.parse_args()
    args = a.stage_args[1:] if a.stage_args[:1] == ["--"] else a.stage_args
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.inprocess import run_with_step_hook

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    tp = profile(activities=acts)
    cp = cProfile.Profile()
    w = a.warmup
    walls: dict[str, float] = {}
    marks: dict[str, float] = {}

    def hook(step):  # `step` is 1-based: called after optimiser step `step - 1`
        if cuda:
            torch.cuda.synchronize()
        now = time.time()
        if step == w:
            tp.start()
            marks["torch"] = now
        elif step == w + 2:
            tp.stop()
            walls["torch"] = now - marks["torch"]
            cp.enable()
            marks["python"] = time.time()
        elif step == w + 4:
            cp.disable()
            walls["python"] = now - marks["python"]

    run_with_step_hook(args, hook)
    if "torch" not in walls or "python" not in walls:
        raise SystemExit(f"the run ended before step {w + 4}: pass --max-steps {w + 4} or more")

    lines = [f"command: align {' '.join(args)}"]
    ev = tp.key_averages()
    events = tp.events()
    busy = sum(e.time_range.elapsed_us() for e in kernels_of(events)) / 1e6 if cuda else 0.0
    lines.append(f"profiled steps {w}-{w + 1} (torch.profiler): wall {walls['torch']:.3f} s"
                 + (f", GPU kernels {busy:.3f} s = {100 * busy / walls['torch']:.1f} % busy" if cuda else ""))
    if cuda:
        lines += phases(events, a.rows)
        lines += ["", "top ops by self GPU time:", ev.table(sort_by="self_cuda_time_total", row_limit=a.rows)]
    lines += ["", "top ops by self CPU time:", ev.table(sort_by="self_cpu_time_total", row_limit=a.rows)]
    s = io.StringIO()
    pstats.Stats(cp, stream=s).sort_stats("cumulative").print_stats(a.rows * 2)
    lines += ["", f"profiled steps {w + 2}-{w + 3} (cProfile, adds overhead): wall {walls['python']:.3f} s", s.getvalue()]
    s = io.StringIO()
    pstats.Stats(cp, stream=s).sort_stats("tottime").print_stats(a.rows)
    lines += ["by own time:", s.getvalue()]
    text = "\n".join(lines)
    (out / "profile.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
