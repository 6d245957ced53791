"""Throughput and memory of a training stage on 1 process and on N processes (ZeRO-3), one table.

    python -m benchmarks.scaling --stage sft --preset small --steps 60 --batch-size 128 --nproc 1,2
    python -m benchmarks.scaling --stage rm  --preset small --steps 60 --batch-size 64 --nproc 1,2
    python -m benchmarks.scaling --stage dpo --preset small --steps 60 --batch-size 64 --nproc 1,2

Each run is a real `align <stage>` (subprocess); numbers come from its artifact.json: training tokens/s
(evaluation excluded; SFT: prompt + completion tokens; RM/DPO: tokens through the policy per pair, i.e. the
prompt twice + chosen + rejected + 2 EOS, measured on the data with the model's tokenizer), peak GPU memory
per rank (torch max_memory_allocated; on CPU the process RSS), and the final loss.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


STAGE_ARGS = {
    "sft": (["sft"], ["--eval-every", "0", "--eval-samples", "64"]),
    "rm": (["rm", "train"], ["--eval-every", "0", "--normalize-samples", "64"]),
    "dpo": (["dpo"], ["--eval-every", "0", "--eval-pairs", "64", "--eval-samples", "16"]),
}


def tokens_per_pair(data: str) -> float:
    from align import data as D
    from align.models import load_tokenizer, resolve

    tok = load_tokenizer(resolve("tiny"))
    rows = D.load_rows(data, "preference")[:2000]
    p = D.encode_prompts(tok, [r["prompt"] for r in rows])
    c = D.encode_completions(tok, [r["chosen"] for r in rows])
    r = D.encode_completions(tok, [r["rejected"] for r in rows])
    return sum(2 * len(a) + len(b) + len(d) for a, b, d in zip(p, c, r)) / len(rows)


def run_stage(stage: str, preset: str, steps: int, batch: int, nproc: int, out: Path, extra: list[str]) -> dict:
    words, defaults = STAGE_ARGS[stage]
    cmd = [sys.executable, "-m", "align", *words, "--model", preset, "--max-steps", str(steps),
           "--batch-size", str(batch), *defaults, "--nproc", str(nproc), "--out", str(out), *extra]
    t = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"failed: {' '.join(cmd)}")
    art = json.loads((out / "artifact.json").read_text())
    m = art["metrics"]
    if "tokens_per_s" in m:
        tps = m["tokens_per_s"]
    else:  # preference stages report pairs/s
        tps = m["pairs_per_s"] * tokens_per_pair(art["config"]["data"])
    return {"nproc": nproc, "cmd": " ".join(cmd[1:]), "tokens_per_s": tps, "peak_gib": m["peak_memory_gib_per_rank"],
            "loss": m["train/loss"], "params": m.get("parameters"), "train_s": m["train_seconds"],
            "wall_s": round(time.time() - t, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", default="sft", choices=sorted(STAGE_ARGS))
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--nproc", default="1,2")
    ap.add_argument("--out", default="")
    ap.add_argument("--json", default="", help="also write the rows to this JSON file")
    ap.add_argument("extra", nargs="*", help="extra flags passed to align sft")
    a = ap.parse_args()
    root = Path(a.out or tempfile.mkdtemp(prefix="align-bench-"))
    rows = [run_stage(a.stage, a.preset, a.steps, a.batch_size, int(n), root / f"{a.stage}-n{n}", a.extra)
            for n in a.nproc.split(",")]
    base = rows[0]["tokens_per_s"]
    params = f"{rows[0]['params'] / 1e6:.1f}M params" if rows[0]["params"] else "params n/a"
    print(f"\n{a.stage} {a.preset} ({params}), {a.steps} steps, global batch {a.batch_size}")
    print(f"{'procs':>5} {'tokens/s':>10} {'speed-up':>8} {'peak GiB per rank':>22} {'loss':>7} {'train s':>8}")
    for r in rows:
        peaks = ", ".join(f"{p:.2f}" for p in r["peak_gib"])
        print(f"{r['nproc']:>5} {r['tokens_per_s']:>10.0f} {r['tokens_per_s'] / base:>8.2f} {peaks:>22} "
              f"{r['loss']:>7.4f} {r['train_s']:>8.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
