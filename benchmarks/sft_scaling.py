"""SFT throughput and memory: the same run on 1 process and on N processes (ZeRO-3), one table.

    python -m benchmarks.sft_scaling --preset small --steps 60 --batch-size 128 --nproc 1,2

Each run is a real `align sft` (subprocess); numbers come from its artifact.json: training tokens/s
(prompt + completion tokens, evaluation excluded), peak GPU memory per rank (torch max_memory_allocated;
on CPU the process RSS), and the final loss.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_sft(preset: str, steps: int, batch: int, nproc: int, out: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "align", "sft", "--model", preset, "--max-steps", str(steps),
           "--batch-size", str(batch), "--eval-every", "0", "--eval-samples", "64", "--nproc", str(nproc),
           "--out", str(out), *extra]
    t = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"failed: {' '.join(cmd)}")
    art = json.loads((out / "artifact.json").read_text())
    m = art["metrics"]
    return {"nproc": nproc, "cmd": " ".join(cmd[1:]), "tokens_per_s": m["tokens_per_s"],
            "peak_gib": m["peak_memory_gib_per_rank"], "loss": m["train/loss"], "params": m["parameters"],
            "train_s": m["train_seconds"], "wall_s": round(time.time() - t, 1), "pass@1": m.get("eval/pass@1")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--nproc", default="1,2")
    ap.add_argument("--out", default="")
    ap.add_argument("--json", default="", help="also write the rows to this JSON file")
    ap.add_argument("extra", nargs="*", help="extra flags passed to align sft")
    a = ap.parse_args()
    root = Path(a.out or tempfile.mkdtemp(prefix="align-bench-"))
    rows = [run_sft(a.preset, a.steps, a.batch_size, int(n), root / f"sft-n{n}", a.extra) for n in a.nproc.split(",")]
    base = rows[0]["tokens_per_s"]
    print(f"\nSFT {a.preset} ({rows[0]['params'] / 1e6:.1f}M params), {a.steps} steps, global batch {a.batch_size}")
    print(f"{'procs':>5} {'tokens/s':>10} {'speed-up':>8} {'peak GiB per rank':>22} {'loss':>7} {'train s':>8}")
    for r in rows:
        peaks = ", ".join(f"{p:.2f}" for p in r["peak_gib"])
        print(f"{r['nproc']:>5} {r['tokens_per_s']:>10.0f} {r['tokens_per_s'] / base:>8.2f} {peaks:>22} "
              f"{r['loss']:>7.4f} {r['train_s']:>8.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
