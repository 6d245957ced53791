"""Where a compiled transformer block's first training step spends its compile time, per compile setting.

    python -m benchmarks.compile_probe [--model 135m] [--variants dynamic-ckpt,dynamic,auto-ckpt,static-ckpt]
                                       [--profile dynamic-ckpt]

Each variant runs in a fresh process with an empty inductor cache: a random-weight model of the config (bf16, on
the GPU), its blocks compiled the way `align.engine.build.compile_blocks` does with the variant's setting, then a
forward + backward at two sequence lengths. Prints per variant: each step's seconds, torch.compile's total,
the forward / backward compiler and Scheduler.codegen times, and with --profile the functions that took the
time (cProfile, top 25 by own time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def one(model: str, variant: str, profile: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from align.engine import build as B
    from benchmarks.vs_trl import config

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = config(model)
    if dev == "cpu":
        cfg.num_hidden_layers = 2
    m = AutoModelForCausalLM.from_config(cfg).to(dev, torch.bfloat16).train()
    ckpt = variant.endswith("-ckpt")
    if ckpt:
        m.gradient_checkpointing_enable()
    kind = variant.split("-")[0]
    if kind == "dynamic":
        B.compile_blocks(m)
    else:
        if ckpt:
            m.gradient_checkpointing_disable()
        for b in B.blocks(m):
            if ckpt:
                b.forward = B._recomputed(b, b.forward)
            b.compile(dynamic=None if kind == "auto" else False)
    import torch._dynamo.utils as U

    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    steps = []
    for t_len in (300, 420, 333):
        ids = torch.randint(0, 1000, (16, t_len), device=dev)
        t = time.time()
        out = m(input_ids=ids, use_cache=False)
        out.logits.float().mean().backward()
        if dev == "cuda":
            torch.cuda.synchronize()
        steps.append(round(time.time() - t, 2))
    if prof:
        prof.disable()
        import io
        import pstats

        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        print(s.getvalue()[-6000:], file=sys.stderr)
    keys = ("fw_compiler_base", "bw_compiler", "Scheduler.codegen", "async_compile.wait", "PyCodeCache.load_by_key_path")
    times = {}
    for line in U.compile_times(repr="str").splitlines():
        for k in keys:
            if k in line:
                times[k] = line.split()[-1]
    return {"variant": variant, "steps": steps, "compile": round(U.calculate_time_spent().get("total_wall_time", 0), 1),
            **times, "compile_threads": __import__("torch._inductor.config").\
            _inductor.config.compile_threads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="135m")
    ap.add_argument("--variants", default="dynamic-ckpt,dynamic,auto-ckpt,static-ckpt")
    ap.add_argument("--profile", default="")
    ap.add_argument("--one", default="")
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(one(a.model, a.one, a.one in a.profile.split(","))), flush=True)
        return
    for v in a.variants.split(","):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="probe-")}
        t = time.time()
        p = subprocess.run([sys.executable, "-m", "benchmarks.compile_probe", "--model", a.model, "--one", v,
                            "--profile", a.profile], env=env, capture_output=True, text=True, timeout=400)
        res = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        print(res[-1][7:] if res else f"{v}: failed\n{p.stderr[-3000:]}", f"(process {time.time() - t:.0f} s)",
              flush=True)
        if v in a.profile.split(","):
            print(p.stderr[-6000:], flush=True)


if __name__ == "__main__":
    main()
