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


def _by_site(blocks) -> list[tuple[str, int, int, int]]:
    sites: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for size, site in blocks:
        sites[site][0] += size
        sites[site][1] += 1
        sites[site][2] = max(sites[site][2], size)
    return sorted(((s, *v) for s, v in sites.items()), key=lambda x: -x[1])


def peak_blocks(events: list[dict], resident: int, start: int = 0):
    """Replay an allocation trace (torch.cuda.memory._snapshot()['device_traces'][d]): (peak bytes, index of the
    peak event, [(site, bytes, blocks, largest block)] live at the peak, most bytes first, and the same list for
    the blocks allocated before event `start` and still live there). Blocks the autograd engine allocates in its
    own thread (most gradients) have no Python frame. `resident`: bytes allocated before the trace began (they are
    live throughout). The peak is looked for from event `start` on."""
    live: dict[int, tuple[int, str]] = {}
    now = resident
    best = -1
    best_i, best_live, before = -1, {}, {}
    for i, e in enumerate(events):
        if i == start:
            before = dict(live)
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _site(e.get("frames", [])))
            now += e["size"]
            if i >= start and now > best:
                best, best_i, best_live = now, i, dict(live)
        elif e["action"] == "free_requested" and e["addr"] in live:
            now -= live.pop(e["addr"])[0]
    return max(best, resident), best_i, _by_site(best_live.values()), _by_site(before.values())


def _table(sites, rows: int) -> list[str]:
    gib = 2**30
    lines = [f"| {b / gib:.3f} | {n} | {m / 2**20:.1f} | {s} |" for s, b, n, m in sites[:rows]]
    rest = sites[rows:]
    if rest:
        lines.append(f"| {sum(r[1] for r in rest) / gib:.3f} | {sum(r[2] for r in rest)} | - | {len(rest)} other sites |")
    return lines


def report(snapshot: dict, resident: int, rows: int, start: int = 0) -> str:
    """The recorded step's peak by allocation site. With `start` > 0 the history began `start` events (some steps)
    before the recorded step: what those steps allocated and left live at its start is listed first (what grows
    from step to step)."""
    events = snapshot["device_traces"][0]
    peak, at, sites, grown = peak_blocks(events, resident, start)
    gib = 2**30
    lines = []
    if start:
        lines += [f"allocated since the history began and live at the recorded step's start: "
                  f"{sum(g[1] for g in grown) / gib:.3f} GiB", "", "| GiB | blocks | largest (MiB) | allocated at |",
                  "|---|---|---|---|", *_table(grown, rows), ""]
    lines += [f"peak allocated during the recorded step: {peak / gib:.2f} GiB (event {at} of {len(events)}); "
              f"resident before the history: {resident / gib:.2f} GiB", "", "| GiB | blocks | largest (MiB) | allocated at |",
              "|---|---|---|---|",
              f"| {resident / gib:.3f} | - | - | resident before the history began (weights, gradients, optimiser state) |"]
    return "\n".join(lines + _table(sites, rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="memory")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--snapshot", default="", help="also write the raw snapshot here (for pytorch.org/memory_viz)")
    ap.add_argument("--record-step", type=int, default=1, help="the (0-based) step recorded; earlier ones warm up")
    ap.add_argument("--history-from", type=int, default=-1,
                    help="start the allocation history at this (0-based) step, before --record-step: what the steps between leave live (what grows step to step) is listed too")
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

    first = a.history_from if 0 <= a.history_from < a.record_step else a.record_step

    def hook(step):  # `step` is 1-based: called after optimiser step `step - 1`
        if step == first:
            torch.cuda.synchronize()
            state["resident"] = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
        if step == a.record_step and first < a.record_step:
            torch.cuda.synchronize()
            state["start"] = len(torch.cuda.memory._snapshot()["device_traces"][0])
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
    text = f"command: align {' '.join(args)}\n" + report(state["snapshot"], state["resident"], a.rows,
                                                                state.get("start", 0))
    (out / "memory_peak.txt").write_text(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
