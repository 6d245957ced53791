"""What holds the GPU memory at a training step's peak: one `align` stage run in this process, one step recorded.

    python -m benchmarks.memory_peak --out /tmp/mem -- grpo --model DIR --max-steps 3 ...

Step 0 warms up (allocator growth, compiles); step 1 runs under torch.cuda.memory's allocation history (Python
stacks). The history is replayed to find the moment of the step's peak allocated bytes, and the blocks live at
that moment are grouped by where they were allocated: the innermost frame in align/ or stages/ and the innermost
frame overall (a transformers layer, a torch function). Blocks allocated before the step (weights, gradients,
optimiser state) are counted as one "resident" line. The table goes to stdout and to --out/memory_peak.txt;
with --snapshot PATH, the raw snapshot too (for https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import argparse
import pickle
from collections import defaultdict
from pathlib import Path

OURS = ("/align/", "/stages/")


def _site(frames: list[dict]) -> str:
    """'ours-file:line fn <- innermost-file:line fn' for a block's allocation stack (innermost frame first)."""
    def fmt(f):
        return f"{'/'.join(f['filename'].split('/')[-2:])}:{f['line']} {f['name']}"

    py = [f for f in frames if f["filename"].endswith(".py")]
    ours = next((f for f in py if any(s in f["filename"] for s in OURS)), None)
    inner = py[0] if py else None
    if ours is None and inner is None:
        return "(no Python frame)"
    if ours is None or ours is inner:
        return fmt(ours or inner)
    return f"{fmt(ours)} <- {fmt(inner)}"


def peak_blocks(events: list[dict], resident: int) -> tuple[int, int, list[tuple[str, int, int]]]:
    """Replay an allocation trace (torch.cuda.memory._snapshot()['device_traces'][d]): (peak bytes, index of the
    peak event, [(site, bytes, blocks, largest block)] live at the peak, most bytes first). Blocks the autograd
    engine allocates in its own thread (most gradients) have no Python frame. `resident`: bytes allocated before the
    trace began (they are live throughout)."""
    live: dict[int, tuple[int, str]] = {}
    now = best = resident
    best_i, best_live = -1, {}
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _site(e.get("frames", [])))
            now += e["size"]
            if now > best:
                best, best_i, best_live = now, i, dict(live)
        elif e["action"] == "free_requested" and e["addr"] in live:
            now -= live.pop(e["addr"])[0]
    sites: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for size, site in best_live.values():
        sites[site][0] += size
        sites[site][1] += 1
        sites[site][2] = max(sites[site][2], size)
    return best, best_i, sorted(((s, *v) for s, v in sites.items()), key=lambda x: -x[1])


def report(snapshot: dict, resident: int, rows: int) -> str:
    events = snapshot["device_traces"][0]
    peak, at, sites = peak_blocks(events, resident)
    gib = 2**30
    lines = [f"peak allocated during the recorded step: {peak / gib:.2f} GiB (event {at} of {len(events)}); "
             f"resident before it: {resident / gib:.2f} GiB", "", "| GiB | blocks | largest (MiB) | allocated at |",
             "|---|---|---|---|",
             f"| {resident / gib:.3f} | - | - | resident before the step (weights, gradients, optimiser state) |"]
    lines += [f"| {b / gib:.3f} | {n} | {m / 2**20:.1f} | {s} |" for s, b, n, m in sites[:rows]]
    rest = sites[rows:]
    if rest:
        lines.append(f"| {sum(r[1] for r in rest) / gib:.3f} | {sum(r[2] for r in rest)} | - | {len(rest)} other sites |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="memory")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--snapshot", default="", help="also write the raw snapshot here (for pytorch.org/memory_viz)")
    ap.add_argument("--record-step", type=int, default=1, help="the (0-based) step recorded; earlier ones warm up")
    ap.add_argument("stage_args", nargs=argparse.REMAINDER, help="-- then an align command, e.g. -- grpo --model DIR")
    a = ap.parse_args()
    args = a.stage_args[1:] if a.stage_args[:1] == ["--"] else a.stage_args
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch

    from benchmarks.inprocess import run_with_step_hook

    if not torch.cuda.is_available():
        raise SystemExit("memory_peak needs a CUDA device")
    state: dict = {}

    def hook(step):  # `step` is 1-based: called after optimiser step `step - 1`
        if step == a.record_step:
            torch.cuda.synchronize()
            state["resident"] = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        elif step == a.record_step + 1 and "resident" in state:
            torch.cuda.synchronize()
            state["snapshot"] = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)

    run_with_step_hook(args, hook)
    if "snapshot" not in state:
        raise SystemExit(f"the run ended before step {a.record_step + 1}: pass --max-steps {a.record_step + 2} or more")
    if a.snapshot:
        with open(a.snapshot, "wb") as f:
            pickle.dump(state["snapshot"], f)
    text = f"command: align {' '.join(args)}\n" + report(state["snapshot"], state["resident"], a.rows)
    (out / "memory_peak.txt").write_text(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
