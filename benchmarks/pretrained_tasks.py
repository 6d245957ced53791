"""The pretrained pipeline (`pipelines/pretrained.toml`) on several reasoning-gym tasks, only the task changed, each
beside GRPO alone from the base model given as many policy-training steps as the chain's DPO + PPO + GRPO stages.

Every run goes at once, each on one GPU (a 135M model leaves most of an H200 idle; several GPUs share the runs out): per task one `align pipeline run` of
the chain and one of a two-stage pipeline (the same `tasks` stage, then the chain's `grpo` stage with the base model
and the summed step count). Rerun the command to continue: complete stages are skipped, an interrupted one resumes
from its checkpoint. At the end, one table: held-out greedy pass@1 after every stage, the reward model's held-out
pair accuracy, GRPO alone, RLMonitor events, and the checks (every stage >= its input - 2 points, RM >= 0.75, the
chain's final model >= GRPO alone).

    python -m benchmarks.pretrained_tasks --model /root/smollm2 --out /root/pt [--tasks add,pm,aiw] [--limit 540]
        [--set stages.grpo.max_steps=200 ...]   (a variant of the recipe, for the chain and GRPO alone alike)
        [--variant 'alike:stages.prefs.pair_by="form"' ...]   (a second chain per task, sharing GRPO alone)
        [--set order=dpo,ppo,grpo]   (the policy stages in another order, each from the one before it; also in a
                                      --variant, e.g. --variant 'early_ppo:order=dpo,ppo,grpo')
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from align.artifacts import read_artifact
from align.pipeline import apply_overrides, reference, toml_value
from align.rollout.evaluation import EVAL_SAMPLES

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "pipelines" / "pretrained.toml"
FLAT = ["allow_parentheses=false", "allow_negation=false"]
# name: (reasoning-gym task, its parameters), each with more distinct prompts than the recipe's 4,000 + 200. Base
# greedy pass@1 of SmolLM2-135M-Instruct (`math` verifier, 64 new tokens): docs/results-history.md.
TASKS = {
    "add": ("rg:basic_arithmetic", ["min_terms=2", "max_terms=2", "max_digits=2", "operators=['+']", *FLAT]),
    "pm": ("rg:basic_arithmetic", ["min_terms=2", "max_terms=2", "max_digits=2", "operators=['+','-']", *FLAT]),
    # the same sums asked four ways ("What is 23 + 45?", "Compute ..."): the splits share no expression
    "nat": ("rg:basic_arithmetic", ["min_terms=2", "max_terms=2", "max_digits=2", "operators=['+']", *FLAT,
                                    "format_style=natural"]),
    "circuit": ("rg:circuit_logic", ["min_terms=2", "max_terms=3", "max_inputs=3"]),  # the output bit, 0 or 1
    # "pick the largest/smallest of: 526.007000 5.26274e+02 ...": 2-5 candidates up to 1e9, or 2 up to 1,000
    "numfmt": ("rg:number_format", []),
    "numfmt2": ("rg:number_format", ["min_num_candidates=2", "max_num_candidates=2", "min_n=10", "max_n=1000"]),
    "chain": ("rg:chain_sum", []),
    "aiw": ("rg:aiw", []),  # "Alice has 3 brothers and 2 sisters. How many sisters does her brother have?"
    "legs": ("rg:leg_counting", ["min_animals=1", "max_animals=2", "max_instances=3"]),
    "letters": ("rg:letter_counting", []),
}
MODEL_KEYS = ("model", "from_model")  # the keys of a stage that name the model it starts from
POLICY_STAGES = ["dpo", "ppo", "grpo"]  # the chain's policy stages (their order: the pipeline file's)


def task_overrides(name: str) -> list[str]:
    task, params = TASKS[name]
    return [f"stages.tasks.task={json.dumps(task)}", f"stages.tasks.param={toml_value(params)}"]


def grpo_alone_toml(pipe: dict, name: str, model: str, out: Path) -> str:
    """A pipeline of the chain's `tasks` stage (this task) and its `grpo` stage from the base model, with as many
    steps as DPO + PPO + GRPO have together."""
    stages = pipe["stages"]
    steps = sum(int(stages[s]["max_steps"]) for s in POLICY_STAGES)
    tasks = dict(stages["tasks"], task=TASKS[name][0], param=TASKS[name][1])
    grpo = {"stage": "grpo", **dict(stages["grpo"], model=model, max_steps=steps)}
    return (f"# GRPO alone from the base model, {steps} steps (= {' + '.join(POLICY_STAGES)} of the chain)\n"
            + pipeline_toml({"pipeline": {"out": str(out)}, "stages": {"tasks": tasks, "grpo_alone": grpo}}))


def recipe(path: str, overrides: list[str]) -> dict:
    """The chain's pipeline file as a dict, with the --set overrides a variant of the recipe gives (the same ones
    go to the chain's `align pipeline run`, so GRPO alone gets the variant's step count and GRPO settings) and its
    policy stages in the override `order=` (if any)."""
    order, overrides = split_order(overrides)
    pipe = tomllib.loads(Path(path).read_text())
    pipe = reorder(pipe, order) if order else pipe
    problems, _ = apply_overrides(pipe, overrides)
    if problems:
        sys.exit(f"error: {problems[0].message} ({problems[0].origin})")
    return pipe


def policy_order(pipe: dict) -> list[str]:
    """The policy stages in the order a pipeline lists them."""
    return [s for s in pipe["stages"] if s in POLICY_STAGES]


def file_order(path: str | Path) -> list[str]:
    """The policy stages in the order a pipeline file lists them."""
    return policy_order(tomllib.loads(Path(path).read_text()))


def split_order(overrides: list[str], default: list[str] | None = None) -> tuple[list[str] | None, list[str]]:
    """(the policy stages' order, the other overrides): the benchmark's own key `order=dpo,grpo,ppo` (the last
    one given wins; none: `default`, the file's order where None) out of a list of --set overrides."""
    order, rest = default, []
    for o in overrides:
        key, _, value = o.partition("=")
        if key.strip() != "order":
            rest.append(o)
            continue
        order = [v.strip() for v in value.strip().strip("\"'").split(",")]
        if sorted(order) != sorted(POLICY_STAGES):
            sys.exit(f"error: {o!r}: the order names each of {', '.join(POLICY_STAGES)} once")
    return order, rest


def reads_policy(stage: dict) -> list[str]:
    """The policy stages a stage's values refer to (`@grpo`, `@dpo/...`)."""
    return [ref[0] for v in stage.values() if (ref := reference(v)) and ref[0] in POLICY_STAGES]


def reorder(pipe: dict, order: list[str]) -> dict:
    """The pipeline with its policy stages last, in `order`: the first starts from the model the file's first
    policy stage starts from, each next one from the one before it (`model = "@previous"`). A file whose other
    stages read a policy stage (pairs the GRPO policy makes) has no such reordering: an error."""
    stages = pipe["stages"]
    if order == policy_order(pipe):
        return pipe
    if readers := {k: used for k, v in stages.items() if k not in POLICY_STAGES and (used := reads_policy(v))}:
        k, used = next(iter(readers.items()))
        sys.exit(f"error: order={','.join(order)}: stage {k!r} reads {', '.join('@' + s for s in used)}; the policy "
                 "stages can be reordered only where no other stage reads them (edit the pipeline file instead)")
    start = stages[next(s for s in stages if s in POLICY_STAGES)]["model"]
    moved = {s: dict(stages[s], model=start if i == 0 else f"@{order[i - 1]}") for i, s in enumerate(order)}
    return dict(pipe, stages={**{k: v for k, v in stages.items() if k not in POLICY_STAGES}, **moved})


def base_model_keys(pipe: dict) -> list[str]:
    """The keys that name the base model (`--set` to the benchmark's --model): every stage's `model` or `from_model`
    that is not another stage's output (`@NAME`)."""
    return [f"stages.{s}.{k}" for s, v in pipe["stages"].items() for k in MODEL_KEYS
            if isinstance(v.get(k), str) and reference(v[k]) is None]


def pipeline_toml(pipe: dict) -> str:
    """A pipeline dict as a TOML file (tables of scalars and lists, as pipeline files are)."""
    lines = []
    for table, values in [("pipeline", pipe.get("pipeline", {})), *((f"stages.{k}", v) for k, v in
                                                                     pipe["stages"].items())]:
        lines += [f"[{table}]", *(f"{k} = {toml_value(v)}" for k, v in values.items()), ""]
    return "\n".join(lines)


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def launch(args, out: Path, chains: dict) -> list[tuple[str, subprocess.Popen]]:
    """Start every task's runs (`chains`: variant -> (its policy stages' order, its other overrides)). On a machine
    with several GPUs each run gets one (CUDA_VISIBLE_DEVICES), spread so that a task's chain and its GRPO alone sit
    on different GPUs where there are two or more."""
    pipe, raw = recipe(args.pipeline, args.set), tomllib.loads(Path(args.pipeline).read_text())
    own_order = policy_order(raw)
    runs, gpus = [], gpu_count()
    for t, name in enumerate(args.tasks):
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        alone_file = d / "alone.toml"
        alone_file.write_text(grpo_alone_toml(pipe, name, args.model, (d / "alone").resolve()))
        commands = {} if args.no_alone else {"alone": [sys.executable, "-m", "align", "pipeline", "run",
                                                        str(alone_file)]}
        for variant, (order, overrides) in chains.items():
            pipeline, chain = args.pipeline, reorder(raw, order)
            if order != own_order:  # the file with its policy stages reordered, beside the runs
                pipeline = d / f"{chain_dir(variant)}.toml"
                pipeline.write_text(pipeline_toml(chain))
            commands[chain_dir(variant)] = [
                sys.executable, "-m", "align", "pipeline", "run", str(pipeline),
                "--set", f"pipeline.out={d / chain_dir(variant)}",
                *[a for k in base_model_keys(chain) for a in ("--set", f"{k}={args.model}")],
                *[a for o in [*overrides, *task_overrides(name)] for a in ("--set", o)]]
        for k, (kind, cmd) in enumerate(commands.items()):
            log = open(d / f"{kind}.log", "a")
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=str((t + k) % gpus)) if gpus > 1 else None
            runs.append((f"{name}/{kind}", subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                             start_new_session=True, cwd=ROOT)))
    return runs


def chain_dir(variant: str) -> str:
    return f"chain-{variant}" if variant else "chain"


def parse_variant(spec: str, pipeline: str, base: list[str]) -> tuple[str, list[str]]:
    """NAME:KEY=VALUE[;KEY=VALUE...] -> (NAME, overrides): a second chain beside the recipe's, sharing its GRPO alone,
    so it may not change what GRPO alone runs (the grpo stage, or the policy stages' step counts)."""
    name, colon, rest = spec.partition(":")
    if not colon or not name.isidentifier() or not rest:
        sys.exit(f"error: --variant {spec!r}: write NAME:KEY=VALUE[;KEY=VALUE...]")
    overrides = [o for o in rest.split(";") if o]
    first, second = recipe(pipeline, base), recipe(pipeline, [*base, *overrides])
    grpo = [{k: v for k, v in p["stages"]["grpo"].items() if k != "model"} for p in (first, second)]
    if grpo[0] != grpo[1] or any(
            first["stages"][s].get("max_steps") != second["stages"][s].get("max_steps") for s in POLICY_STAGES):
        sys.exit(f"error: --variant {name}: it changes GRPO alone's run (the grpo stage or a policy stage's "
                 "max_steps); run it with --set and its own --out instead.")
    return name, overrides


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def wait_all(runs, limit: float, grace: float = 60) -> None:
    """Wait for every run; at `limit` seconds send SIGTERM to each run's process group (the stage in flight finishes
    its step, checkpoints and marks its artifact) and give them `grace` seconds in all to exit, then SIGKILL what
    is left (its stage resumes from its last checkpoint): the runs are over by limit + grace, whatever they do."""
    t0 = time.monotonic()
    while any(p.poll() is None for _, p in runs):
        if limit and time.monotonic() - t0 > limit:
            for _, p in runs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
            break
        time.sleep(5)
    deadline = time.monotonic() + grace
    while any(group_alive(p.pid) for _, p in runs) and time.monotonic() < deadline:
        time.sleep(2)  # a stage process outlives its pipeline's while it checkpoints
    for _, p in runs:
        if group_alive(p.pid):
            os.killpg(p.pid, signal.SIGKILL)
    for name, p in runs:
        print(f"{name}: exit {p.wait()} after {time.monotonic() - t0:.0f} s", flush=True)


def paired_difference(a: Path, b: Path) -> dict | None:
    """Held-out pass@1 of run `a` minus run `b` on the problems both evaluated last (their eval_samples.jsonl,
    matched by prompt), with the paired standard error sd(d)/sqrt(n) of the per-problem differences d = a_i - b_i
    in {-1, 0, 1}: both runs answer the same problems, so the noise of drawing 200 of them cancels and what is left
    is the runs' disagreement. None where either file is missing."""
    try:
        ra, rb = ({r["prompt"]: r["greedy_correct"] for r in map(json.loads, f.read_text().splitlines())}
                  for f in (a / EVAL_SAMPLES, b / EVAL_SAMPLES))
    except OSError:
        return None
    d = [int(ra[p]) - int(rb[p]) for p in ra if p in rb]
    if len(d) < 2:
        return None
    mean = sum(d) / len(d)
    var = sum((x - mean) ** 2 for x in d) / (len(d) - 1)
    return {"delta": mean, "se": (var / len(d)) ** 0.5, "n": len(d), "a_only": d.count(1), "b_only": d.count(-1)}


PASS_KEY = {"dpo": "pass@1/policy", "ppo": "eval/pass@1/greedy", "grpo": "eval/pass@1/greedy"}


def summarise(names, out: Path, variants=("",), orders: dict | None = None) -> dict:
    """One row per task and chain: held-out greedy pass@1 after each stage, in the chain's order (`orders`:
    variant -> its policy stages' order; default the file's), GRPO alone's, and the checks."""
    rows, orders = {}, orders or {v: file_order(PIPELINE) for v in variants}
    for name, variant in [(n, v) for n in names for v in variants]:
        order = orders[variant]
        c, a = out / name / chain_dir(variant), out / name / "alone"
        # policy_pairs: the GRPO policy's pairs for DPO, where the file has them
        art = {s: read_artifact(c / s) or {} for s in ["eval_base", "policy_pairs", "prefs", "rm", *POLICY_STAGES]}
        alone = read_artifact(a / "grpo_alone") or {}
        # a stage that did not complete has no result (a failed one may hold its start metrics)
        m = {s: v.get("metrics", {}) if v.get("status") == "complete" else {} for s, v in art.items()}
        alone_m = alone.get("metrics", {}) if alone.get("status") == "complete" else {}
        row = {"task": " ".join([TASKS[name][0], *TASKS[name][1]]),
               "base": m["eval_base"].get("pass@1/greedy"),
               "rm_heldout_accuracy": m["rm"].get("eval/accuracy"),
               **{s: m[s].get(PASS_KEY[s]) for s in POLICY_STAGES},
               "order": order,
               "final": m[order[-1]].get(PASS_KEY[order[-1]]),
               "grpo_alone": alone_m.get("eval/pass@1/greedy"),
               "pairs": (art["prefs"].get("metrics") or {}).get("rows"),
               "policy_pairs": (art["policy_pairs"].get("metrics") or {}).get("rows"),
               "status": {s: v.get("status", "-") for s, v in art.items()} | {"grpo_alone": alone.get("status", "-")},
               "health": {s: (v.get("health") or {}).get("counts", {}) for s, v in
                          [*[(s, art[s]) for s in order], ("grpo_alone", alone)]},
               "wall_s": {s: v.get("wall_seconds") for s, v in [*art.items(), ("grpo_alone", alone)]},
               "final_minus_alone": paired_difference(c / order[-1], a / "grpo_alone")}
        chain = [row["base"], *(row[s] for s in order)]
        if None not in chain and row["grpo_alone"] is not None and row["rm_heldout_accuracy"] is not None:
            steps_ok = all(b >= a - 0.02 - 1e-9 for a, b in zip(chain, chain[1:]))
            row["checks"] = {"every stage >= input - 2 points": steps_ok,
                             "rm held-out accuracy >= 0.75": row["rm_heldout_accuracy"] >= 0.75,
                             "final >= GRPO alone": row["final"] >= row["grpo_alone"]}
        rows[f"{name} ({variant})" if variant else name] = row
    return rows


def table(rows) -> str:
    f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    lines = ["| task | base | pairs (base model's / GRPO policy's) | RM acc | policy stages, in order | final | "
             "GRPO alone | final − alone (paired s.e.) | events | checks |", "|---" * 10 + "|"]
    for name, r in rows.items():
        events = "; ".join(f"{s}: {', '.join(f'{k} {n}' for k, n in c.items())}" for s, c in r["health"].items() if c)
        unmet = ", ".join(k for k, ok in r.get("checks", {}).items() if not ok)
        checks = unmet or ("all met" if "checks" in r else "-")
        if checks != "all met" and "checks" in r:
            checks = "unmet: " + checks
        d = r.get("final_minus_alone")
        diff = f"{d['delta']:+.3f} ({d['se']:.3f})" if d else "-"
        stages = " → ".join(f"{s} {f(r[s])}" for s in r["order"])
        pairs = f"{r['pairs'] or '-'}" + (f" / {r['policy_pairs']}" if r.get("policy_pairs") else "")
        lines.append(f"| {name}: {r['task']} | {f(r['base'])} | {pairs} | {f(r['rm_heldout_accuracy'])} | "
                     f"{stages} | {f(r['final'])} | {f(r['grpo_alone'])} | {diff} | {events or 'none'} | {checks} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="The base model's directory (e.g. /root/smollm2).")
    ap.add_argument("--out", required=True, help="Folder of the runs: OUT/TASK/{chain,alone}.")
    ap.add_argument("--pipeline", default=str(PIPELINE), help="The chain's pipeline file.")
    ap.add_argument("--tasks", default="pm,add,aiw", help=f"Comma-separated, of {', '.join(TASKS)}.")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="A variant of the recipe: override a key of the pipeline file (as `align pipeline run "
                         "--set`), for the chain and GRPO alone alike, e.g. --set stages.grpo.max_steps=200.")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[;KEY=VALUE]",
                    help="Another chain beside the recipe's, per task, in OUT/TASK/chain-NAME, sharing GRPO alone, "
                         "e.g. --variant 'alike:stages.prefs.pair_by=\"form\"' or 'early_ppo:order=dpo,ppo,grpo'.")
    ap.add_argument("--no-alone", action="store_true",
                    help="Run the chains only (GRPO alone from an earlier run of the same recipe and seed compares).")
    ap.add_argument("--limit", type=float, default=0, help="Stop the runs gracefully after this many seconds.")
    ap.add_argument("--summary-only", action="store_true", help="Only print the table of what is there.")
    args = ap.parse_args()
    args.tasks = [t for t in args.tasks.split(",") if t]
    if unknown := [t for t in args.tasks if t not in TASKS]:
        sys.exit(f"error: unknown task {unknown}; choose from {', '.join(TASKS)}")
    out = Path(args.out).resolve()
    args.pipeline = str(Path(args.pipeline).resolve())
    args.variant = [parse_variant(v, args.pipeline, args.set) for v in args.variant]
    base = file_order(args.pipeline)
    chains = {v: split_order([*args.set, *extra], base) for v, extra in [("", []), *args.variant]}
    if not args.summary_only:
        wait_all(launch(args, out, chains), args.limit)
    rows = summarise(args.tasks, out, list(chains), {v: order for v, (order, _) in chains.items()})
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
