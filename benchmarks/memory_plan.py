"""The memory plan (align.engine.plan) of GRPO on real model shapes, from the harness' configs
(benchmarks.vs_trl.MODELS: nothing is downloaded or built): a sanity check of the estimate against what a GPU run
reports.

    python -m benchmarks.memory_plan [--free-gib 141] [--prompts 8] [--generations 8] [--prompt-tokens 256]
                                     [--new-tokens 3840] [--models qwen2.5-1.5b,qwen3-4b,llama3.1-8b] [-- FLAGS]

FLAGS are `align grpo` flags (e.g. -- --gradient-checkpointing --lora-r 16). For each model: the plan table, and
when it does not fit, the smallest change that does.
"""

from __future__ import annotations

import argparse
import shlex

NAMES = ("qwen2.5-1.5b", "qwen3-4b", "llama3.1-8b")  # real configs, benchmarks.vs_trl.MODELS


def config(name: str) -> dict:
    """The config.json dict of a harness model (benchmarks.vs_trl.MODELS)."""
    from benchmarks.vs_trl import MODELS

    model_type, kw = MODELS[name]
    return {"model_type": model_type, **kw}


def print_plans(names=NAMES, free_gib: float = 141.0, prompts: int = 8, generations: int = 8,
                prompt_tokens: int = 256, new_tokens: int = 3840, extra: tuple[str, ...] = ()) -> dict:
    """Print the GRPO plan of each named config on one GPU with `free_gib` free; returns {name: Plan}."""
    from align import config as C
    from align.console import console
    from align.engine import plan as P
    from stages.grpo import GRPOConfig, GRPOPlan

    flags = {"model": "plan-only", "prompts_per_step": prompts, "num_generations": generations,
             "max_new_tokens": new_tokens, **_parse(GRPOConfig, extra)}
    stage = GRPOPlan(C.build(GRPOConfig, None, flags))
    from align.rollout.fast.support import enabled_by_env

    device = P.Device("cuda", free_gib * 2**30, 1, True, enabled_by_env(), f"{free_gib:g} GiB free, one GPU")
    plans = {}
    for name in names:
        model = P.Model("policy", P.arch(config(name)))
        plans[name] = p = P.estimate(stage, {"policy": model}, device, P.Data(prompt_tokens))
        console.print(f"\n[bold]{name}[/]: {model.params / 1e9:.2f}B parameters, {prompts} prompts x G "
                      f"{generations} x ({prompt_tokens} + {new_tokens} tokens)")
        P.show(p, device.source)
        if not p.fits:
            found = P.smallest_change(stage, {"policy": model}, device, P.Data(prompt_tokens))
            console.print(f"smallest change that fits: {found[0]} (peak {P.gib(found[1].peak)})" if found else
                          "no change tried fits")
    return plans


def _parse(cls, extra: tuple[str, ...]) -> dict:
    """--flag value / --flag / --no-flag pairs into config values (typed as the dataclass says)."""
    from align import config as C

    types, out, args = C.field_types(cls), {}, list(extra)
    while args:
        key = args.pop(0).lstrip("-").replace("-", "_")
        if key.startswith("no_") and types.get(key[3:]) is bool:
            out[key[3:]] = False
        elif types.get(key) is bool:
            out[key] = True
        else:
            out[key] = types[key](args.pop(0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(NAMES), help="names in benchmarks.vs_trl.MODELS")
    ap.add_argument("--free-gib", type=float, default=141.0)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=3840)
    ap.add_argument("extra", nargs="*", help="align grpo flags, after --")
    a = ap.parse_args()
    print_plans(a.models.split(","), a.free_gib, a.prompts, a.generations, a.prompt_tokens, a.new_tokens,
                tuple(shlex.split(" ".join(a.extra))))


if __name__ == "__main__":
    main()
