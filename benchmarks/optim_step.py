"""The optimizer step alone at a real model's parameter shapes: align's AdamWSR (bf16 weights, moments and
gradients, fp32 arithmetic — on a GPU one compiled kernel per tensor, the multi-tensor path beside it — stochastic
rounding) against torch's fused AdamW on the same bf16 tensors
(TRL's bf16 path) and on fp32 master weights. A DPO step at 8B with short sequences is a few FLOP-light passes
plus one such step, so its share of the step decides how far below TRL's step ours can go.

    python -m benchmarks.optim_step [--models llama3.1-8b] [--steps 5]

Random gradients; prints the median step time and the bytes each optimizer keeps per parameter. Runs on CPU at
the `tiny` shape (a smoke test) and on a GPU at any size in `benchmarks.vs_trl.MODELS` (8B: ~16 GB of weights and
as much again per bf16 state tensor).
"""

from __future__ import annotations

import argparse
import statistics
import time


def shapes(name: str) -> list[tuple[int, ...]]:
    """The parameter shapes of `name`'s config (built on the meta device: no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.vs_trl import config

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(config(name))
    return [tuple(p.shape) for p in m.parameters()]


def time_steps(make, params, steps: int, device) -> float:
    """Median seconds of an optimizer step over `steps` (after one warm-up step)."""
    import torch

    opt = make(params)
    times = []
    for _ in range(steps + 1):
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def main() -> None:
    import torch

    from align.optim import AdamWSR

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama3.1-8b")
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names = a.models.split(",") if device.type == "cuda" else ["tiny"]
    print("| model | params | optimizer | bytes / param | step (s) |\n|---|---|---|---|---|")
    fused = {"fused": True} if device.type == "cuda" else {}
    runs = [("align AdamWSR, bf16 + SR", torch.bfloat16, lambda ps: AdamWSR(ps, lr=1e-5, weight_decay=0.0), 8),
            ("align AdamWSR multi-tensor (fused=False)", torch.bfloat16,
             lambda ps: AdamWSR(ps, lr=1e-5, weight_decay=0.0, fused=False), 8),
            ("torch AdamW, bf16 (TRL bf16)", torch.bfloat16,
             lambda ps: torch.optim.AdamW(ps, lr=1e-5, weight_decay=0.0, **fused), 8),
            ("torch AdamW, fp32", torch.float32, lambda ps: torch.optim.AdamW(ps, lr=1e-5, weight_decay=0.0, **fused),
             16)]
    for name in names:
        sh = shapes(name)
        n = sum(torch.Size(s).numel() for s in sh)
        for label, dtype, make, per in runs:
            params = [torch.nn.Parameter(torch.randn(s, dtype=dtype, device=device) * 0.02) for s in sh]
            try:
                t = f"{time_steps(make, params, a.steps, device):.3f}"
            except torch.OutOfMemoryError:
                t = "out of memory"
            print(f"| {name} | {n / 1e9:.2f}B | {label} | {per} | {t} |", flush=True)
            del params
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
