"""GRPO on several GPUs: synchronous data-parallel against decoder ranks with staleness 1, weak and strong scaling.

    python -m benchmarks.async_scaling --models 0.5b --gpus 2,4,8 --steps 6 [--rollout-gpus 1,half]
        [--scaling weak,strong] [--with-default] [--sync-variants "--zero-stage 0"] [--skip-default-sync]

The batch shape is benchmarks.grpo_vs_trl's harness (a random-init bf16 model, arithmetic prompts, G = 8, 512 new
tokens, micro 16, gradient checkpointing, a noise reward so every group keeps its variance); --prompts (8) is the
prompts per step of ONE GPU. Weak scaling (the default reading): a run on N GPUs takes N × as many, so every GPU's
share of the work stays the 1-GPU run's; strong scaling: the N GPUs split the 1-GPU run's prompts. For every N:

- sync: `align grpo --rollout-gpus 0` on N processes, every one sampling and training (ZeRO-3 unless a
  --sync-variants flag set says otherwise, e.g. --zero-stage 0: replicas), the rollout from the current weights;
- async, for each --rollout-gpus R: the last R processes decode, the other N − R train, `--max-staleness 1
  --tis-cap 2` (the rollout of step t + 1 is sampled while step t trains);
- --with-default: the command with no flag of either kind (GRPO's own default on N GPUs).

The throughput is sampled completion tokens per second of wall time per step (the `tokens` and `time/step` each
run logs: every GPU together), median of steps 2..S (step 1 compiles the decoder); "vs 1 GPU" divides it by the
1-GPU synchronous run's. Also the step's phases (generate: the decoders' time with R; update; wait: the trainers'
wait for rollouts) and the peak memory per rank (trainers; a decoder's peak is in its own log).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import grpo_vs_trl as H
from benchmarks import vs_trl as V

KEYS = ["time/step", "tokens", "time/generate", "time/update", "time/wait", "rollout/staleness"]


def command(model: Path, a, gpus: int, decoders: int, out: Path, extra: str = "", scaling: str = "weak") -> list[str]:
    """The harness' command on `gpus` processes: `decoders` > 0 of them decode (staleness 1, TIS), 0: the
    synchronous run, -1: no flag (the default split); `extra`: more flags. Prompts per step: `gpus` × --prompts
    (weak scaling) or --prompts (strong), rounded down to a multiple of the trainers."""
    trainers = gpus - decoders if decoders >= 0 else gpus - gpus // 2  # -1: the default (auto) split
    prompts = (a.prompts * gpus if scaling == "weak" else a.prompts) // trainers * trainers
    cmd = H.ours_command(model, a, gpus, out, prompts)
    cmd[cmd.index("--micro-batch-size") + 1] = str(min(a.micro_batch_size, prompts * a.generations // trainers))
    if decoders > 0:
        cmd += ["--rollout-gpus", str(decoders), "--max-staleness", "1", "--tis-cap", "2"]
    elif decoders == 0:  # the synchronous run (on several GPUs the default is auto: -1)
        cmd += ["--rollout-gpus", "0"]
    return cmd + extra.split()


def measure(model: Path, a, gpus: int, decoders: int, out: Path, extra: str = "", scaling: str = "weak") -> dict | None:
    cmd = command(model, a, gpus, decoders, out, extra, scaling)
    if not V.run(cmd, out.parent / (out.name + ".log"), gpus=gpus):
        return None
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    med = V.median_rows([r for r in rows if "tokens" in r], KEYS)
    art = json.loads((out / "artifact.json").read_text())
    return {**med, "gpus": gpus, "decoders": decoders, "extra": extra, "scaling": scaling,
            "throughput": med["tokens"] / med["time/step"], "peak_per_rank": art["metrics"]["peak_memory_gib_per_rank"],
            "cmd": " ".join(cmd)}


def runs_on(a, gpus: int) -> list[tuple[int, str]]:
    """(decoders, extra flags) of every run on `gpus` GPUs: the synchronous default engine (unless
    --skip-default-sync), each --rollout-gpus count, the plain command (--with-default), each --sync-variants."""
    runs = [] if a.skip_default_sync else [(0, "")]
    runs += [(n, "") for n in decoder_counts(a.rollout_gpus, gpus)]
    runs += [(-1, "")] if a.with_default else []
    return runs + [(0, v.strip()) for v in a.sync_variants.split(";") if v.strip()]


def decoder_counts(spec: str, gpus: int) -> list[int]:
    """--rollout-gpus values for `gpus` GPUs: numbers, 'half' (gpus // 2) or 'quarter'; each leaves a trainer."""
    named = {"half": gpus // 2, "quarter": gpus // 4}
    counts = [named[x] if x in named else int(x) for x in spec.split(",")]
    return sorted({n for n in counts if 1 <= n < gpus})


def row(d: dict, base: dict) -> str:
    mode = (f"{d['decoders']} decode + {d['gpus'] - d['decoders']} train, K=1" if d["decoders"] > 0
            else "the defaults (no flags)" if d["decoders"] < 0 else "sync, data-parallel")
    mode += f" `{d['extra']}`" if d.get("extra") else ""
    return (f"| {d['gpus']} | {mode} | {d['tokens']:,.0f} | {d['time/step']:.3f} | {d['throughput']:,.0f} | "
            f"{d['throughput'] / base['throughput']:.2f} | {d['time/generate']:.3f} | {d['time/update']:.3f} | "
            f"{d.get('time/wait', 0.0):.3f} | {', '.join(f'{m:.1f}' for m in d['peak_per_rank'])} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    V.harness_args(ap, models="0.5b", steps=6)
    H.shape_args(ap)
    ap.add_argument("--gpus", default="2,4,8", help="GPU counts to compare with the 1-GPU run")
    ap.add_argument("--rollout-gpus", default="1,half", help="decoder counts per GPU count: numbers, half, quarter")
    ap.add_argument("--multi-extra", default="", help="extra flags for the runs on several GPUs (sync and async)")
    ap.add_argument("--skip-default-sync", action="store_true", help="leave out the synchronous run at the "
                    "default engine on several GPUs (ZeRO-3)")
    ap.add_argument("--scaling", default="weak", help="weak (prompts per step grow with the GPUs), strong (the "
                    "1-GPU run's prompts split over them), or both: weak,strong")
    ap.add_argument("--with-default", action="store_true", help="also run the plain command (its defaults) on "
                    "several GPUs")
    ap.add_argument("--sync-variants", default="", help="more synchronous runs on several GPUs, ';'-separated "
                    "flag sets, e.g. '--zero-stage 0' (replicas, compiled)")
    a = ap.parse_args()
    root = V.out_root(a.out, "align-async-scaling-")
    H.long_prompts(a, root)
    report, results = [], []
    for name in a.models.split(","):
        model = V.make_model(name, root)
        base = measure(model, a, 1, 0, root / f"{name}-g1-sync")
        if base is None:
            raise SystemExit("the 1-GPU run failed: see its log")
        results.append({**base, "model": name})
        for scaling in a.scaling.split(","):
            lines = [row(base, base)]
            for gpus in [int(g) for g in a.gpus.split(",")]:
                for i, (decoders, extra) in enumerate(runs_on(a, gpus)):
                    d = measure(model, a, gpus, decoders, root / f"{name}-{scaling}-g{gpus}-{i}", extra, scaling)
                    if d:
                        lines.append(row(d, base))
                        results.append({**d, "model": name})
            per = f"{a.prompts} prompts per GPU" if scaling == "weak" else f"{a.prompts} prompts over all GPUs"
            report += [f"\n### GRPO {name}: {per} x G={a.generations}, {a.max_new_tokens} new tokens ({scaling} "
                       f"scaling); median of steps 2..{a.steps}",
                       "| GPUs | mode | tokens per step | step (s) | tokens/s | vs 1 GPU | generate (s) | update (s) | "
                       "wait (s) | peak GiB per trainer |", "|---|---|---|---|---|---|---|---|---|---|", *lines]
    print("\n".join(report))
    V.write_json(root / "async_scaling.json", {"results": results, "argv": sys.argv})


if __name__ == "__main__":
    main()
