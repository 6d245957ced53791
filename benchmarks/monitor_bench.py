"""RLMonitor, measured: labelled runs of the tiny models on CPU, every default rule scored on them.

    python -m benchmarks.monitor_bench [--out runs/monitor_bench] [--write-docs] [--only NAME ...]

Healthy runs, runs that learn: the arithmetic chain's (pipelines/arithmetic.toml) SFT and reward models, trained
here with its recipe (the PPO and DPO runs start from them), and GRPO, PPO and DPO at several seeds and learning
rates (the chain's recipes, longer); and, replayed from their stored metrics (no training), three GRPO runs of a real
pretrained model (tests/fixtures/real_runs: SmolLM2-135M-Instruct on reasoning-gym basic_arithmetic, 100 steps,
whose held-out greedy pass@1 rose 0.07 -> 0.41-0.43 while the policy sharpened onto one answer template). Runs with a
known failure and the step it starts at, read from the run itself
(RUNS says how): a stale decoder weight copy or a NaN injected at step k with benchmarks.faults; a reward paid per
character (answers triple in length); a reward paid per "7" from the untrained model (entropy 6.2 -> below 0.1
nats), at two seeds; a KL blow-up, at two seeds; held-out degradation without proxy gain (PPO from the SFT model
against its RM with no KL and lr 2e-4); over-optimisation of a weak reward model (PPO without KL against a scalar
RM trained 40 steps: the verifier's held-out pass rate falls while the RM's score of the same answers rises). The
weak RM run is also run under --on-alarm stop and rollback (ON_ALARM).

Each run writes its metrics.jsonl once (kept in --out: a rerun of the benchmark only replays it); the metrics are
replayed through a fresh RLMonitor with the default rules, step by step as the run fed it (an evaluation's metrics
with its step's). Scored: per failure, the lead = steps from the labelled onset to the first event of the rules
written for it (held-out failures also in held-out evaluations); per rule, its detections on the failure runs
(an event at or after the onset), and its false alarms (events on healthy runs) per 1,000 healthy steps.

Trains everything in ~25 min on 2 CPU cores (one run at a time; SFT 1,500 steps ~2.5 min of it); a rerun that
finds the runs in --out replays them in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from align.monitor import RLMonitor, default_rules

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data"
DOCS = ROOT / "docs/monitor.md"
BEGIN, END = "<!-- monitor_bench:begin -->", "<!-- monitor_bench:end -->"
ARITH, ARITH_TEST = str(DATA / "arithmetic/train.jsonl"), str(DATA / "arithmetic/test.jsonl")
PREFS, PREFS_TEST = str(DATA / "prefs/train.jsonl"), str(DATA / "prefs/test.jsonl")


def _reward_file(name: str, body: str) -> str:
    f = Path(tempfile.gettempdir()) / f"align-bench-{name}.py"
    f.write_text(f"def {name}(prompt, completion, **row):\n    return {body}\n")
    return f"{f}:{name}"


def _tool_file(name: str, body: str) -> str:
    """A tool file for --tools: `mul(a, b)` whose body is `body` (e.g. a raise: a broken tool)."""
    f = Path(tempfile.gettempdir()) / f"align-bench-tool-{name}.py"
    f.write_text(f'def mul(a: int, b: int) -> int:\n    """Multiply two integers.\n\n    Args:\n        a: the first '
                 f'factor\n        b: the second factor\n    """\n    {body}\n')
    return f"{f}:mul"


def grpo_tools(seed: int, steps: int = 100, *extra, model: str = "@sft-tools", tools: str = "calculator",
               data: str = "data-mul", turns: int = 3, tokens: int = 40) -> list[str]:
    """pipelines/tools.toml's GRPO (the calculator, up to 3 turns) from its SFT model; held-out greedy pass@1 on 200
    products at the start, step 50 and the end."""
    return ["grpo", "--model", model, "--data", f"@{data}", "--eval-data", f"@{data}/test.jsonl", "--tools", tools,
            "--max-turns", str(turns), "--max-tool-tokens", "32", "--max-new-tokens", str(tokens), "--max-steps", str(steps),
            "--lr", "1e-4", "--eval-every", "50", "--eval-k", "1", "--eval-samples", "200", "--seed", str(seed),
            *extra]


def sft_tools(data: str, tools: str, tokens: int = 40) -> list[str]:
    """pipelines/tools.toml's SFT: 2,000 steps of 32 demonstrations (1 in 5 calls the tool), lr 1e-3."""
    return ["sft", "--model", "tiny", "--data", f"@{data}", "--eval-data", f"@{data}/test.jsonl", "--tools", tools,
            "--max-steps", "2000", "--batch-size", "32", "--lr", "1e-3", "--eval-every", "2000", "--max-new-tokens",
            str(tokens)]


def grpo(seed: int, lr: float, steps: int = 15, *extra, reward: str = "", model: str = "tiny",
         tokens: int = 12) -> list[str]:
    """GRPO of the tiny model on the arithmetic prompts, 4 prompts x 4 samples, no held-out evaluation."""
    reward = reward or _reward_file("parity", "float(len(completion) % 2)")
    return ["grpo", "--model", model, "--reward", reward, "--data", ARITH, "--eval-data", "", "--max-steps", str(steps),
            "--prompts-per-step", "4", "--num-generations", "4", "--max-new-tokens", str(tokens), "--seed", str(seed),
            "--lr", str(lr), "--warmup-steps", "0", *extra]


def grpo_chain(seed: int, lr: float, steps: int = 200, *extra) -> list[str]:
    """The chain's GRPO (verifier reward, T 1, z-score advantages) from its SFT model at 8 prompts x 8 samples, the
    held-out greedy pass rate on 100 problems every 25 steps."""
    return ["grpo", "--model", "@sft", "--data", ARITH, "--eval-data", ARITH_TEST, "--eval-samples", "100",
            "--eval-k", "1", "--eval-every", "25", "--max-steps", str(steps), "--prompts-per-step", "8",
            "--num-generations", "8", "--seed", str(seed), "--lr", str(lr), *extra]


def ppo(seed: int, lr: float, steps: int = 15, *extra, rm: str = "@rm", prompts: int = 16,
        epochs: int = 2) -> list[str]:
    return ["ppo", "--model", "@sft", "--reward-model", rm, "--max-steps", str(steps), "--seed", str(seed),
            "--lr", str(lr), "--prompts-per-step", str(prompts), "--minibatch-size", str(prompts),
            "--ppo-epochs", str(epochs), "--eval-samples", "100", *extra]


def dpo(seed: int, lr: float, steps: int = 200) -> list[str]:
    """The chain's DPO (β 0.5, RPO's NLL term on the chosen answer) from its SFT model; held-out pair accuracy every
    50 steps, greedy pass@1 on 100 held-out problems at the start and end."""
    return ["dpo", "--model", "@sft", "--data", PREFS, "--eval-data", PREFS_TEST, "--eval-samples", "100",
            "--max-steps", str(steps), "--batch-size", "32", "--lr", str(lr), "--seed", str(seed), "--eval-every",
            "50", "--eval-pairs", "64", "--beta", "0.5", "--nll-coef", "1.0", "--precompute-ref"]


@dataclass(frozen=True)
class Departs:
    """An onset read from the run: the first step from which every later value of `key` stays beyond `factor` x the
    mean of the run's first 3 steps (factor < 1: below it, > 1: above it)."""

    key: str
    factor: float

    def __call__(self, steps: dict) -> int | None:
        series = [(s, row[self.key]) for s, row in sorted(steps.items()) if self.key in row]
        bound = self.factor * statistics.fmean(v for _, v in series[:3])
        beyond = (lambda v: v < bound) if self.factor < 1 else (lambda v: v > bound)
        onset = None
        for s, v in series:
            onset = (onset or s) if beyond(v) else None
        return onset


@dataclass(frozen=True)
class Above:
    """An onset read from the run: the first step from which every later value of `key` stays above `value`."""

    key: str
    value: float

    def __call__(self, steps: dict) -> int | None:
        onset = None
        for s, row in sorted(steps.items()):
            if self.key in row:
                onset = (onset or s) if row[self.key] > self.value else None
        return onset


@dataclass(frozen=True)
class Run:
    args: list  # align's arguments; "@NAME": the out directory of run NAME (trained first)
    label: str | None = None  # the failure; None: a healthy run; "input": data other runs read (not scored)
    onset: int | Departs = 0  # the step (1-based, as logged) the failure starts at, or how to read it from the run
    rules: tuple = ()  # the rules written for the failure: its lead is the first event of any of them
    heldout: bool = False  # the failure shows in held-out evaluations: its lead is also counted in evaluations
    fault: str = "none"  # benchmarks.faults' fault, injected at 0-based step fault_step
    fault_step: int = 0
    stored: str = ""  # a metrics.jsonl in the repository (relative to its root): replayed as it is, not trained
    precision: str = "fp32"  # the run's --precision as it ran (rollout_mismatch's tolerance follows it)

    @property
    def stage(self) -> str:
        return self.args[0]

    @property
    def kind(self) -> str:
        """The run's line in the healthy-steps count: its stage, or "real-model" and its stage for a stored run."""
        return f"real-model {self.stage.upper()}" if self.stored else self.stage.upper()


def metrics_file(name: str, out: Path) -> Path:
    """Where run `name`'s metrics are: its stored file, or its out directory's metrics.jsonl."""
    r = RUNS[name]
    return ROOT / r.stored if r.stored else out / name / "metrics.jsonl"


USER_MUL = f"{ROOT / 'tests/fixtures/user_tools.py'}:mul"  # a user's tool: the sandbox runs it
CHAIN_PPO = ["--fixed-kl", "--init-kl-coef", "0.2", "--ptx-coef", "0.5"]  # the arithmetic chain's PPO settings
NO_KL = ["--init-kl-coef", "0", "--fixed-kl", "--ptx-coef", "0"]
# PPO without KL, 4 epochs a batch, against a scalar reward model trained 40 steps (near chance on held-out pairs):
# the verifier's held-out pass rate falls from the first updates while the reward model's score of the answers rises
WEAK_RM = ppo(0, 1e-4, 60, *NO_KL, rm="@rm-weak", prompts=32, epochs=4)
HELDOUT = ("heldout_degradation", "reward_hacking_heldout")
RUNS = {
    # healthy: the chain's SFT and reward models (pipelines/arithmetic.toml's recipes), and a weak reward model
    "sft": Run(["sft", "--model", "tiny", "--data", ARITH, "--eval-data", ARITH_TEST, "--max-steps", "1500",
                "--batch-size", "32", "--lr", "2e-3", "--eval-every", "500"]),
    "rm": Run(["rm", "train", "--model", "@sft", "--data", PREFS, "--eval-data", PREFS_TEST, "--head", "likelihood",
               "--max-steps", "150", "--batch-size", "64", "--lr", "2e-4", "--warmup-steps", "10",
               "--eval-every", "150"]),
    "rm-weak": Run(["rm", "train", "--model", "@sft", "--data", PREFS, "--eval-data", PREFS_TEST, "--head", "scalar",
                    "--max-steps", "40", "--batch-size", "16", "--lr", "1e-3", "--seed", "0"]),
    "grpo-s0-lr5e-5": Run(grpo(0, 5e-5)),
    "grpo-s1-lr5e-5": Run(grpo(1, 5e-5)),
    "grpo-s0-lr2e-4": Run(grpo(0, 2e-4)),
    "grpo-s2-lr2e-4-beta": Run(grpo(2, 2e-4, 15, "--beta", "0.04")),
    "grpo-chain-s0-lr5e-5": Run(grpo_chain(0, 5e-5)),
    "grpo-chain-s1-lr5e-5": Run(grpo_chain(1, 5e-5)),
    "grpo-chain-s2-lr1e-4": Run(grpo_chain(2, 1e-4)),
    "grpo-chain-s3-lr5e-5-beta": Run(grpo_chain(3, 5e-5, 200, "--beta", "0.04")),  # logs the KL the others do not
    "ppo-chain-s0-lr3e-5": Run(ppo(0, 3e-5, 60, *CHAIN_PPO)),
    "ppo-chain-s1-lr3e-5": Run(ppo(1, 3e-5, 60, *CHAIN_PPO)),
    "ppo-chain-s2-lr6e-5": Run(ppo(2, 6e-5, 60, *CHAIN_PPO)),
    "dpo-chain-s0-lr1e-4": Run(dpo(0, 1e-4)),
    "dpo-chain-s1-lr1e-4": Run(dpo(1, 1e-4)),
    "dpo-chain-s2-lr5e-5": Run(dpo(2, 5e-5)),
    # healthy, replayed: GRPO of SmolLM2-135M-Instruct on reasoning-gym basic_arithmetic (100 steps, 16 prompts x 8
    # samples, <= 64 new tokens, lr 1e-5), recorded by benchmarks/real_model.py. The policy sharpens onto one answer
    # template as it learns: entropy 1.8 -> 0.1 nats/token, distinct-1 0.15 -> 0.01, mean length 54 -> 14 tokens as
    # the truncated share falls 0.67 -> 0, the reward 0.003 -> 0.1; held-out greedy pass@1 (the last number) 0.07 ->
    # 0.41-0.43 on every seed
    **{f"real-smollm2-grpo-s{s}": Run(["grpo"], stored=f"tests/fixtures/real_runs/seed{s}-metrics.jsonl")
       for s in range(3)},
    # the same recipe on other data and seeds, recorded after the rules above were set (held out from their design):
    # `+` only (seed 3, pass@1 0.115 -> 0.725) and `+`/`-` (seed 4, 0.055 -> 0.395), held-out evaluations every 10
    # steps, bf16 on one H200 (the fast decoder's rollout/ metrics: rollout_mismatch's 16-bit tolerance). A third
    # run (chain_sum, 0.025 -> 0.05: it did not learn) is not a healthy run and is not here.
    "real-smollm2-grpo-plus-s3": Run(["grpo"], stored="tests/fixtures/real_runs/fresh/rA-seed3-metrics.jsonl",
                                     precision="bf16-pure"),
    "real-smollm2-grpo-plusminus-s4": Run(["grpo"], stored="tests/fixtures/real_runs/fresh/rB-seed4-metrics.jsonl",
                                          precision="bf16-pure"),
    # pipelines/pretrained.toml's GRPO stage (from its PPO stage's policy: entropy ~0.15 nats/token at the start), one
    # H200, bf16, held-out greedy pass@1 at steps 0/50/100: `add` (0.555 -> 0.70 -> 0.755) fired entropy_collapse's
    # floor path (0.15 -> 0.05) until that path asked for a start above 0.2: design data for that change; `aiw`
    # (0.23 -> 0.965 -> 1.0) was quiet before and after it. pm (0.32 -> 0.37 -> 0.36: it did not learn) is not here.
    **{f"real-smollm2-pretrained-grpo-{t}": Run(
        ["grpo"], stored=f"tests/fixtures/real_runs/pretrained/{t}-grpo-metrics.jsonl", precision="bf16-pure")
       for t in ("add", "aiw")},
    # failures
    "grpo-stale-decoder@6": Run(grpo(0, 5e-5), "stale decoder copy", 6, ("rollout_mismatch",), fault="stale_decoder",
                                fault_step=5),
    "grpo-nan@6": Run(grpo(1, 5e-5), "NaN loss", 6, ("nan",), fault="nan", fault_step=5),
    # per-character pay from the SFT model (answers ~15 tokens, room for 48): the onset is the step from which the
    # mean length stays 25 % above its start (then it reaches the 48-token cap within a few steps)
    "grpo-length-reward": Run(grpo(0, 1e-3, 40, reward=_reward_file("longer", "len(completion) / 40"), model="@sft",
                                   tokens=48), "length-exploitable reward", Departs("completions/mean_length", 1.25),
                              ("length_drift",)),
    # from the untrained model (entropy 6.2 nats) paid per "7": the onset is the step from which the entropy stays
    # 1 % below its start (~30x the step noise there); it is below 0.1 ~20 steps later
    "grpo-entropy-collapse": Run(grpo(0, 3e-3, 45, reward=_reward_file("sevens", "completion.count('7') / 12")),
                                 "entropy collapse", Departs("entropy", 0.99), ("entropy_collapse",)),
    "grpo-entropy-collapse-s1": Run(grpo(1, 3e-3, 45, reward=_reward_file("sevens", "completion.count('7') / 12")),
                                    "entropy collapse", Departs("entropy", 0.99), ("entropy_collapse",)),
    "grpo-kl-blowup": Run(grpo(0, 3e-3, 15, "--beta", "0.01", "--num-iterations", "2"), "KL blow-up", 1,
                          ("kl_high", "kl_spike")),
    "grpo-kl-blowup-s1": Run(grpo(1, 3e-3, 15, "--beta", "0.01", "--num-iterations", "2"), "KL blow-up", 1,
                             ("kl_high", "kl_spike")),
    "ppo-degradation": Run(["ppo", "--model", "@sft", "--reward-model", "@rm", *NO_KL, "--lr", "2e-4", "--seed", "11",
                            "--max-steps", "60"], "held-out degradation without proxy gain", 1, HELDOUT, True),
    "ppo-weak-rm": Run(WEAK_RM, "over-optimisation of a weak reward model", 1, ("reward_hacking", *HELDOUT), True),
    # tools (pipelines/tools.toml's recipe): products of 3-4 digit numbers, demonstrations that call the calculator
    # (or a user's `mul` in the JSON call format) 1 time in 5, SFT on them, then GRPO with the tool
    "data-mul": Run(["data", "make", "mul_tool", "--n", "4000", "--test-n", "200", "--param", "tool_rate=0.2"],
                    "input"),
    "data-mul-call": Run(["data", "make", "mul_tool", "--n", "4000", "--test-n", "200", "--param", "tool_rate=0.2",
                          "--param", "call=mul"], "input"),
    "sft-tools": Run(sft_tools("data-mul", "calculator")),
    # (the JSON call of `mul` takes ~50 of the tiny tokenizer's tokens: 96 new tokens leave room for it and the answer)
    "sft-tools-mul": Run(sft_tools("data-mul-call", USER_MUL, 96)),
    # healthy: the policy learns to call (held-out greedy pass@1 ~0.05 -> ~1.0)
    "grpo-tools-s0": Run(grpo_tools(0)),
    "grpo-tools-s1": Run(grpo_tools(1)),
    "grpo-tools-s2": Run(grpo_tools(2)),
    "grpo-user-tool-s0": Run(grpo_tools(0, 60, model="@sft-tools-mul", tools=USER_MUL, data="data-mul-call",
                                        tokens=96)),
    # failures: the user's tool raises on every call (a service down); a bonus for calling the tool (nanochat's +0.2,
    # design-notes/01) with --max-turns 1, too few for a call and an answer: every call ends its episode at the turn
    # limit unanswered, the bonus pays the loop all the same, and the policy learns to call (onset: the step from
    # which more than a quarter of the episodes end at the limit for good)
    "grpo-tool-broken": Run(grpo_tools(0, 20, model="@sft-tools-mul", tools=_tool_file(
        "broken", "raise ConnectionError('the multiplication service is down')"), data="data-mul-call", tokens=96),
        "broken tool", 1, ("tool_broken", "tool_errors_high")),
    "grpo-turn-loop": Run(grpo_tools(0, 60, "--reward", "math", "--reward", _reward_file(
        "tool_bonus", "0.2 * ('</calc>' in completion)"), turns=1), "turn-limit loop",
        Above("episodes/stop/max_turns", 0.25), ("turn_limit",)),
}
# --on-alarm on the weak reward model's over-optimisation: (run name, mode); not scored as rule runs
ON_ALARM = {"ppo-weak-rm-stop": ("ppo-weak-rm", "stop"), "ppo-weak-rm-rollback": ("ppo-weak-rm", "rollback")}
for _name, (_base, _mode) in ON_ALARM.items():
    RUNS[_name] = Run([*RUNS[_base].args, "--on-alarm", _mode], "on-alarm")


def run(name: str, out: Path) -> Path:
    """The run's out directory, trained (after the runs it names with "@") unless a finished one is there."""
    r = RUNS[name]
    if r.stored:
        return ROOT / r.stored
    args = [_at(a, out) for a in r.args]
    d = out / name
    art = d / "artifact.json"
    if art.is_file() and json.loads(art.read_text()).get("status") in ("complete", "failed", "stopped"):
        return d
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "benchmarks.faults", r.fault, str(r.fault_step), *args, "--out", str(d), "--overwrite"]
    print(f"  {name}: {' '.join(cmd[3:])}", flush=True)
    subprocess.run(cmd, cwd=ROOT, env={**env, "COLUMNS": "200"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return d


def _at(arg: str, out: Path) -> str:
    """"@NAME[/PATH]": run NAME's out directory (trained first), or PATH in it; any other argument as it is."""
    if not arg.startswith("@"):
        return arg
    name, _, rest = arg[1:].partition("/")
    d = run(name, out)
    return str(d / rest) if rest else str(d)


def by_step(f: Path) -> dict:
    """A run's metrics.jsonl as {step: metrics}, an evaluation's metrics merged with its step's."""
    steps: dict[int, dict] = {}
    for line in f.read_text().splitlines():
        row = json.loads(line)
        steps.setdefault(row.pop("step"), {}).update(row)
    return steps


def replay(f: Path, precision: str = "fp32") -> tuple[list, int, list]:
    """(events, training steps, steps with a held-out evaluation) of a run's metrics.jsonl replayed through the
    default rules for a run in `precision`: one update per step, an evaluation's metrics together with its step's
    (as StageRun feeds them)."""
    steps = by_step(f)
    m = RLMonitor()
    m.set_precision(precision)
    for step in sorted(steps):
        m.update(step, steps[step])
    last = max(steps, default=0)
    m.end(last)
    evals = [s for s, row in sorted(steps.items()) if any(k.startswith("eval/pass@1") for k in row)]
    return m.events, last, evals


def score(out: Path, names: list[str]) -> dict:
    """Per rule: detections, delays, false alarms; per failure: its lead; per run: the first event of each rule."""
    enabled = {r.name for r in default_rules() if r.enabled}
    rules = default_rules()
    table = {r.name: {"detected": 0, "delays": [], "false": 0, "watched": 0} for r in rules}
    healthy: dict[str, int] = {}
    leads, runs = [], []
    for name in names:
        r = RUNS[name]
        if r.label in ("on-alarm", "input"):
            continue
        f = metrics_file(name, out)
        if not f.is_file():
            runs.append((name, r, 0, 0, "did not run"))
            continue
        events, steps, evals = replay(f, r.precision)
        onset = r.onset(by_step(f)) if callable(r.onset) else r.onset
        first: dict[str, int] = {}
        for e in events:
            first.setdefault(e.rule, e.step)
        runs.append((name, r, onset, steps, ", ".join(f"{k}@{s}" for k, s in first.items()) or "-"))
        if r.label is None:
            healthy[r.kind] = healthy.get(r.kind, 0) + steps
            rows = [row for step, row in by_step(f).items() if step > 0]
            for rule in rules:  # the healthy steps that logged the rule's metrics
                table[rule.name]["watched"] += sum(any(k in row for k in rule.keys) for row in rows)
            for e in events:
                table[e.rule]["false"] += 1
            continue
        after = {}  # each rule's first event at or after the onset
        for e in events:
            if e.step >= onset:
                after.setdefault(e.rule, e.step)
        for k, s in after.items():
            table[k]["detected"] += 1
            table[k]["delays"].append(s - onset)
        at, rule = min(((s, k) for k, s in after.items() if k in r.rules), default=(None, None))
        n_evals = sum(onset <= s <= at for s in evals) if at is not None and r.heldout else None
        leads.append({"run": name, "onset": onset, "rule": rule, "lead": None if at is None else at - onset,
                      "evals": n_evals})
    false = sum(t["false"] for k, t in table.items() if k in enabled)
    return {"rules": table, "enabled": enabled, "healthy": healthy, "leads": leads, "runs": runs, "false": false}


def summary_line(s: dict) -> str:
    hs = sum(s["healthy"].values())
    found = [x["lead"] for x in s["leads"] if x["lead"] is not None]
    median = f"{statistics.median(found):g}" if found else "-"
    evals = [x["evals"] for x in s["leads"] if x["evals"] is not None]
    per_stage = ", ".join(f"{k} {v}" for k, v in s["healthy"].items())
    worst = max((t["false"], k) for k, t in s["rules"].items() if k in s["enabled"])
    return (f"**Labelled failures detected by their own rules: {len(found)}/{len(s['leads'])}; median lead "
            f"{median} steps after the onset (held-out failures: {', '.join(map(str, evals)) or '-'} held-out "
            f"evaluations); {hs} healthy steps ({per_stage}); false alarms of the default rules, warnings included: "
            f"{s['false']} ({1000 * s['false'] / max(hs, 1):.2f} per 1,000 healthy steps; the most of one rule: "
            f"{worst[0]}, {1000 * worst[0] / max(hs, 1):.2f} per 1,000).**")


def render(s: dict) -> str:
    hs = max(sum(s["healthy"].values()), 1)
    lines = [summary_line(s), "",
             "| failure run | onset step | its rules | first of them | lead (steps) | lead (held-out evaluations) |",
             "|---|---|---|---|---|---|"]
    for x in s["leads"]:
        r = RUNS[x["run"]]
        lead = "not detected" if x["lead"] is None else str(x["lead"])
        rule = f"`{x['rule']}`" if x["rule"] else "-"
        evals = "-" if x["evals"] is None else str(x["evals"])
        lines.append(f"| {x['run']} | {x['onset']} | {', '.join(f'`{k}`' for k in r.rules)} | {rule} | {lead} | "
                     f"{evals} |")
    lines += ["", "| rule | on by default | detections (failure runs) | mean delay from onset (steps) | healthy steps "
              "that logged its metric | false alarms (healthy runs) | per 1,000 healthy steps |",
              "|---|---|---|---|---|---|---|"]
    n_fail = len(s["leads"])
    for rule, t in s["rules"].items():
        delay = f"{sum(t['delays']) / len(t['delays']):.1f}" if t["delays"] else "-"
        on = "yes" if rule in s["enabled"] else "no"
        lines.append(f"| `{rule}` | {on} | {t['detected']} / {n_fail} | {delay} | {t['watched']} | {t['false']} | "
                     f"{1000 * t['false'] / hs:.2f} |")
    lines += ["", "Runs (first event of each rule, at its step):", "",
              "| run | failure (onset step) | steps | events |", "|---|---|---|---|"]
    for name, r, onset, steps, events in s["runs"]:
        what = f"{r.label} ({onset})" if r.label else "healthy, real model (stored metrics)" if r.stored else "healthy"
        lines.append(f"| {name} | {what} | {steps} | {events} |")
    return "\n".join(lines)


def on_alarm_table(out: Path) -> str:
    """--on-alarm stop / rollback on the over-optimising run: held-out greedy pass@1 at the start, the best
    evaluated, and what the run ended with (the artifact's: the kept evaluation's under stop, the last under
    rollback)."""
    lines = ["| run | status | held-out greedy pass@1: start | best evaluated (step) | the artifact's | "
             "what happened |", "|---|---|---|---|---|---|"]
    for name in ON_ALARM:
        d = out / name
        if not (d / "artifact.json").is_file():
            continue
        art = json.loads((d / "artifact.json").read_text())
        evals = [(s, row["eval/pass@1/greedy"]) for s, row in sorted(by_step(d / "metrics.jsonl").items())
                 if "eval/pass@1/greedy" in row]
        best_step, best = max(evals, key=lambda e: (e[1], -e[0]))
        what = (f"stopped at step {art['stopped']['step']} ({art['stopped']['rule']}), kept step "
                f"{art['stopped']['kept']['step']}" if "stopped" in art else "")
        if "rollback" in art:
            rb = art["rollback"]
            what = (f"rolled back at step {rb['at']} ({rb['rule']}) to step {rb['to']} with "
                    f"{', '.join(rb['changes'])}" + (f"; then {what}" if what else "; completed"))
        lines.append(f"| {name} | {art['status']} | {evals[0][1]:.3f} | {best:.3f} ({best_step}) | "
                     f"{art['metrics'].get('eval/pass@1/greedy', float('nan')):.3f} | {what} |")
    return "\n".join(lines)


def write_docs(text: str) -> None:
    doc = DOCS.read_text()
    if BEGIN not in doc:
        doc = doc.rstrip() + f"\n\n{BEGIN}\n{END}\n"
    head, rest = doc.split(BEGIN, 1)
    DOCS.write_text(f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "runs/monitor_bench"))
    ap.add_argument("--only", nargs="*", default=None, help="run names (default: all)")
    ap.add_argument("--write-docs", action="store_true", help="write the tables into docs/monitor.md")
    a = ap.parse_args(argv)
    out, names = Path(a.out), a.only or list(RUNS)
    t = time.time()
    for name in names:
        run(name, out)
    print(f"trained in {time.time() - t:.0f} s", flush=True)
    text = f"{render(score(out, names))}\n\n`--on-alarm` on the weak reward model's over-optimisation:\n\n{on_alarm_table(out)}"
    print(text)
    if a.write_docs:
        write_docs(text)


if __name__ == "__main__":
    main()
