"""Where a rollout's time goes in the fast decoder (one GPU): the same rollout under variants of the decoder.

    python -m benchmarks.rollout_probe --model qwen2.5-1.5b --rows 64 --prompt 96 --new 512

Per variant: the first rollout (compile + graph capture), the median of three replays, and a rollout after a
simulated training step (the decoder's `release`, a large allocation and free, `load_weights`: what GRPO does
between rollouts), with the graph re-captures it cost. Variants: the default (the decoder reads the module's own
weights: separate q/k/v and gate/up matmuls), a weight copy (fused q/k/v and gate/up), one graph over the whole
cache (no 256-slot buckets), greedy decoding (no keyed sampling noise, no sampler log-probs), the fused SDPA
kernel in place of the split-KV decode attention (align.rollout.fast.decode_attention), and FP8 rollouts (E4M3
q/k/v, o, gate/up and down with row scales: align.rollout.fast.fp8).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from align.rollout.generation import Sampling
from benchmarks import vs_trl as V

VARIANTS = {"default": {}, "copy (fused qkv, gate/up)": {"ALIGN_FAST_DECODER_COPY": "1"},
            "one graph (bucket 4096)": {"ALIGN_DECODE_BUCKET": "4096"}, "greedy": {},
            "SDPA attention": {"ALIGN_DECODE_ATTN": "sdpa"}, "fp8 (E4M3 linear layers)": {}}


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def profile(gen, name: str, top: int, new: int) -> None:
    """The `top` GPU kernels by total time over one rollout (kernels inside the replayed CUDA graphs included)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as run

    with run(activities=[ProfilerActivity.CUDA]) as prof:
        gen()
        torch.cuda.synchronize()
    ev = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in ev)
    print(f"\n#### {name}: GPU kernels over one rollout, {total / 1e3:.1f} ms in all ({total / new / 1e3:.3f} ms/token)")
    print("| kernel | calls | total (ms) | share |\n|---|---|---|---|")
    for e in sorted(ev, key=lambda e: -e.device_time_total)[:top]:
        print(f"| {e.key[:90]} | {e.count} | {e.device_time_total / 1e3:.1f} | {e.device_time_total / total:.1%} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=96)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--variants", default=";".join(VARIANTS), help="names from VARIANTS, separated by ';'")
    ap.add_argument("--profile", type=int, default=0, help="also print each variant's N costliest GPU kernels over "
                    "one replayed rollout (torch.profiler; 0: none)")
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from align.rollout.fast.decoder import FastDecoder
    from align.runtime import attention_backends

    attention_backends()  # the attention kernels a stage's decoder runs (align.runtime.init sets the same)

    d = V.make_model(a.model, Path("/tmp/rollout-probe"))
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 1000, (a.prompt,), generator=g).tolist() for _ in range(a.rows)]
    keys = list(range(a.rows))
    rows = []
    for name in a.variants.split(";"):
        env = VARIANTS[name]
        for k, v in env.items():
            os.environ[k] = v
        s = Sampling(max_new_tokens=a.new, temperature=0.0 if name == "greedy" else 1.0)
        dec = FastDecoder(m, "cuda", precision="fp8" if name.startswith("fp8") else "")
        dec.load_weights(m)
        gen = lambda: dec.generate(prompts, s, eos=-1, pad=0, keys=None if s.greedy else keys)  # noqa: E731
        first = timed(gen)
        replay = statistics.median(timed(gen) for _ in range(3))

        def after_training():
            dec.release()
            junk = torch.empty(8 << 30, dtype=torch.uint8, device="cuda")  # a training step's activations
            del junk
            dec.load_weights(m)
            gen()

        if a.profile:
            profile(gen, name, a.profile, a.new)
        before = dec.recaptures
        again = statistics.median(timed(after_training) for _ in range(3))
        rows.append((name, first, replay, again, dec.recaptures - before))
        causes = dict(dec.recaptured_for)
        for k in env:
            del os.environ[k]
        dec = gen = None  # the next variant builds its own (graphs, cache)
        torch.cuda.empty_cache()
        print(f"{name}: first {first:.3f} s, replay {replay:.3f} s ({replay / a.new * 1e3:.2f} ms/token), "
              f"after a training step {again:.3f} s, re-captures {rows[-1][4]} {causes}", flush=True)
    print(f"\n### rollout of {a.rows} rows x {a.new} new tokens, prompt {a.prompt}, {a.model}, "
          f"{torch.cuda.get_device_name()}")
    print("| variant | first (s) | replay (s) | ms/token | after a training step (s) | re-captures (3 rollouts) |")
    print("|---|---|---|---|---|---|")
    for name, first, replay, again, rec in rows:
        print(f"| {name} | {first:.3f} | {replay:.3f} | {replay / a.new * 1e3:.2f} | {again:.3f} | {rec} |")


if __name__ == "__main__":
    main()
