"""The tiny model's training-step floor on this machine: plain PyTorch vs align's engine at ZeRO-0 and ZeRO-3.

    python -m benchmarks.cpu_floor [--steps 30] [--batch 32] [--seq 53]

One process, fp32, AdamW, gradient clipping 1.0, the default chain's SFT batch shape (32 rows of ~53 tokens).
Each engine runs in its own subprocess (a DeepSpeed engine leaves process-wide state behind). Prints seconds per
step (mean after 10 warm-up steps) and the share of it spent in aten::mm (torch.profiler): the matmuls are the
floor no engine removes; the rest is the engine's and the model's Python and small ops.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def one(engine: str, steps: int, batch: int, seq: int) -> dict:
    import time

    import torch
    from torch.profiler import profile
    from transformers import LlamaConfig, LlamaForCausalLM

    from align.models import PRESETS

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, **PRESETS["tiny"])
    x = torch.randint(0, 512, (batch, seq))
    if engine == "torch":
        model = LlamaForCausalLM(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step():
            model(input_ids=x, labels=x).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        import deepspeed

        from align.engine.build import ds_config, load_partitioned, wrap

        deepspeed.init_distributed("gloo")
        ds = ds_config(zero_stage=int(engine[-1]), micro_batch=batch, grad_accum=1, world_size=1, dtype=torch.float32)
        model, _link = load_partitioned(ds, lambda dtype: LlamaForCausalLM(cfg), torch.float32)
        eng = wrap(model, ds, torch.optim.AdamW(model.parameters(), lr=1e-3))

        def step():
            eng.backward(eng(input_ids=x, labels=x).loss)
            eng.step()
    for _ in range(10):
        step()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    sec = (time.perf_counter() - t) / steps
    with profile() as p:
        for _ in range(5):
            step()
    mm = sum(e.self_cpu_time_total for e in p.key_averages() if e.key == "aten::mm") / 1e6 / 5
    return {"engine": engine, "step_s": sec, "mm_s": mm, "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=53)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.steps, a.batch, a.seq)))
        return
    rows = []
    for engine in ("torch", "zero0", "zero3"):
        out = subprocess.run([sys.executable, "-m", "benchmarks.cpu_floor", "--one", engine, "--steps", str(a.steps),
                              "--batch", str(a.batch), "--seq", str(a.seq)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"tiny preset, batch {a.batch} x {a.seq} tokens, fp32, {rows[0]['threads']} threads, mean of {a.steps} steps")
    print(f"{'engine':<22}{'s/step':>8}{'aten::mm s':>12}{'mm share':>10}")
    names = {"torch": "plain PyTorch", "zero0": "align engine, ZeRO-0", "zero3": "align engine, ZeRO-3"}
    for r in rows:
        print(f"{names[r['engine']]:<22}{r['step_s']:>8.3f}{r['mm_s']:>12.3f}{r['mm_s'] / r['step_s']:>10.0%}")


if __name__ == "__main__":
    main()
