"""Where a FastDecoder decode step spends its time (one GPU): eager step, graph replay, and the top kernels.

    python -m benchmarks.decode_probe --model 135m --rows 64 --new 128
"""

from __future__ import annotations

import argparse
import time

import torch

from align.rollout.fast.decoder import FastDecoder
from align.rollout.generation import Sampling
from benchmarks import vs_trl as V


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="135m")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    d = V.make_model(a.model, __import__("pathlib").Path("/tmp/probe"))
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda()
    s = Sampling(max_new_tokens=a.new, temperature=1.0)
    prompts = [[1] + list(range(5, 40))] * a.rows
    for graphs in (False, True):
        dec = FastDecoder(m, "cuda", use_graphs=graphs)
        dec.load_weights(m)
        dec.generate(prompts, s, eos=-1, pad=0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        dec.generate(prompts, s, eos=-1, pad=0)
        torch.cuda.synchronize()
        print(f"graphs={graphs}: {(time.perf_counter() - t) / a.new * 1e3:.2f} ms per token", flush=True)
    runner = dec._runner(s, -1, 0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            dec.widx.fill_(40), dec.sidx.fill_(1)
            runner()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=70))


if __name__ == "__main__":
    main()
