"""Stage configs: one dataclass per stage, filled from defaults < `--config FILE.toml` < command-line flags.

A field's `help` metadata is its --help text; the CLI options are generated from the dataclass, so a stage's
flags, TOML keys and artifact config are always the same names. A field also declares what it allows (`opt(...,
choices=..., ge=..., gt=...)`), checked here for every entry point: `check_value` as a flag or a TOML key is read,
`Options.validate` on the assembled config.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from align.errors import UserError
from align.models import PRESETS, preset_architecture
from align.paths import DATA_DIR

PRECISIONS = ("auto", "bf16", "bf16-mixed", "bf16-pure", "fp32")
SEED_MAX = 2**32 - 1  # the seeds are scaled and offset (seed * 1_000_003 + step ...): kept far below 2**63
# options that change what a command checks, prints or reports, never what it trains: left out of a pipeline
# stage's fingerprint and free to change on --resume
PREFLIGHT = ("plan", "plan_check", "overwrite", "report_to")
# the groups of options a command's --help shows, in this order, after the command's own options (those its config
# class declares itself): an option declares its group with `opt(..., group=...)`
GROUPS = {"data": "Model and data", "optimisation": "Optimisation", "sampling": "Rollout and sampling",
          "tools": "Tools", "hardware": "Hardware", "run": "Output and run"}
AUTO_LR, AUTO_WARMUP = 0.0, -1  # --lr / --warmup-steps left to the run: resolved() makes them concrete


@dataclass(frozen=True)
class ByModel:
    """A default that depends on --model: `scratch` for a shipped preset's model (a preset, or a saved model of a
    preset's architecture: trained from scratch here, the recipe each stage's default was measured with),
    `pretrained` for any other model (a save_pretrained directory, a hub id, an artifact trained from one)."""

    scratch: float
    pretrained: float

    def __str__(self) -> str:
        return f"{self.scratch:g} for a preset's model (trained from scratch), {self.pretrained:g} for a pretrained one"


def opt(default, help: str, *, choices=None, ge=None, gt=None, le=None, lt=None, **meta):
    """An option: its default, its --help text and what it allows: `choices` (a value outside them is refused),
    bounds `ge` (>=), `gt` (>), `le` (<=), `lt` (<). Flags, --config files and pipeline stage tables are all
    checked against them (`check_value`, `Options.validate`), and --help shows the range. `choices` is copied,
    unless it is a live view with a `describe()` (align.objectives.Choices: a registry's names, read each time
    --help shows them or a value is checked; --help lists them with what each is). `group` (one of GROUPS) is
    where --help lists it; an option without one is its command's own (listed first)."""
    if choices is not None and not hasattr(choices, "describe"):
        choices = tuple(choices) or None
    limits = {k: v for k, v in (("choices", choices), ("ge", ge), ("gt", gt), ("le", le),
                                ("lt", lt)) if v is not None}
    meta = {"help": help, **limits, **meta}
    if isinstance(default, list):  # repeatable flag (--reward a --reward b) / TOML array
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


BOUNDS = (("ge", ">=", operator.ge), ("gt", ">", operator.gt), ("le", "<=", operator.le), ("lt", "<", operator.lt))


def allowed(meta) -> str:
    """What an option allows, in words ("> 0 and <= 1", "one of a, b"); "" when anything of its type goes."""
    if "choices" in meta:
        return "one of " + ", ".join(map(str, meta["choices"]))
    return " and ".join(f"{sym} {meta[k]}" for k, sym, _ in BOUNDS if k in meta)


def disallowed(meta, value) -> bool:
    """Whether `value` is outside what the option's metadata allows (NaN and infinities are, for a bounded one)."""
    if "choices" in meta:
        return value not in meta["choices"]
    bounded = [(op, meta[k]) for k, _, op in BOUNDS if k in meta]
    if bounded and isinstance(value, float) and not math.isfinite(value):
        return True
    return not all(op(value, bound) for op, bound in bounded)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def group_of(cls, name: str) -> str:
    """Where --help lists option `name` of config class `cls`: its declared group (GROUPS), else the group a base
    class declares for it (an option a command declares again, e.g. eval's --out), else "" (the command's own)."""
    for c in cls.__mro__:
        f = c.__dict__.get("__dataclass_fields__", {}).get(name)
        if f is not None and f.metadata.get("group"):
            return f.metadata["group"]
    return ""


def help_order(cls) -> list[dataclasses.Field]:
    """`cls`'s options in --help's order: the command's own first, then each of GROUPS in turn (declaration order
    within each)."""
    rank = {g: i + 1 for i, g in enumerate(GROUPS)}
    return sorted(dataclasses.fields(cls), key=lambda f: rank.get(group_of(cls, f.name), 0))


def help_text(f: dataclasses.Field) -> str:
    """An option's --help text, with its numeric range (or its registry's choices, each with what it is)."""
    text = f.metadata.get("help", "")
    if "auto" in f.metadata:
        text = f"{text} {f.default:g} (default): {auto_text(f)}."
    if hasattr(f.metadata.get("choices"), "describe"):
        return f"{text} {f.metadata['choices'].describe()}"
    return f"{text} [{allowed(f.metadata)}]" if "choices" not in f.metadata and allowed(f.metadata) else text


def auto_text(f: dataclasses.Field) -> str:
    """What an option left at its automatic value (`opt(..., auto=..., auto_note=...)`) becomes, in words."""
    auto, note = f.metadata["auto"], f.metadata.get("auto_note")
    return (str(auto) if isinstance(auto, ByModel) else f"{auto:g}") + (f", {note}" if note else "")


def auto_warmup(default: int, max_steps: int) -> int:
    """--warmup-steps left to the run: the stage's default, at most half of --max-steps (a 3-step smoke test is not
    all warmup; the shipped pipelines' stages keep theirs: DPO's 20 of 40 steps, GRPO's 5 of 30)."""
    return min(default, max_steps // 2)


@dataclass(frozen=True)
class Options:
    """Base of every command's config: `validate()` refuses a value outside its option's declared choices or
    bounds, naming the flag; a subclass adds checks across options after `super().validate()`. A config is
    frozen: what a run derives from it (its micro-batch, precision, ZeRO stage) goes into the run's layout
    (align.engine.layout), never back into the config."""

    def automatic(self) -> dict[str, tuple[object, str]]:
        """The options left to the run and what they become, with why: {name: (value, reason)} ({} by default). A
        subclass adds its own to super()'s."""
        return {}

    def decode_precision(self) -> str:
        """The rollouts' Sampling.precision: "fp8", or "" (the compute dtype; a stage without rollouts)."""
        return ""

    def resolved(self):
        """This config with its automatic values made concrete (`automatic`; a new config, or itself when there are
        none): StageRun resolves the config it runs once, and says and records the choices."""
        values = {name: value for name, (value, _) in self.automatic().items()}
        return dataclasses.replace(self, **values) if values else self

    def user_code(self) -> list[str]:
        """The user's Python files the options name (`user_code`)."""
        return user_code(type(self), as_dict(self))

    def user_files(self) -> dict[str, str]:
        """The user's files besides data and code that the options name (declared `user_file=True`: --chat-template),
        by name, those given: a run hashes them into its artifact's inputs."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.metadata.get("user_file") and getattr(self, f.name)}

    def paths(self) -> dict[str, str]:
        """The options that name a file or directory (declared `path=True`), by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("path")}

    def validate(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if disallowed(f.metadata, value):
                raise UserError(f"{flag(f.name)} must be {allowed(f.metadata)}, got {value!r}.", option=f.name)


def user_code(cls, values: dict) -> list[str]:
    """The user's Python files that the options of `cls` declared `code=True` (--reward, --gold-reward,
    --verifier: path/to/file.py:FUNCTION[:WEIGHT] specs) name in `values`, each once: a run hashes them into its
    artifact's inputs, a pipeline into the stage's fingerprint."""
    from align.rewards import spec_file

    found = []
    for f in dataclasses.fields(cls):
        value = values.get(f.name) if f.metadata.get("code") else None
        for spec in (value if isinstance(value, list) else [value] if isinstance(value, str) else []):
            if (file := spec_file(spec)) is not None:
                found.append(file)
    return list(dict.fromkeys(found))


def positive_ints(text: str, name: str) -> list[int]:
    """A comma-separated list of integers >= 1 (pass@k values: --k 1,4,8), sorted and deduplicated."""
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"{name} must be comma-separated integers like 1,4,8, got {text!r}.") from None
    if not ks or ks[0] < 1:
        raise UserError(f"{name} must be comma-separated integers >= 1 like 1,4,8, got {text!r}.")
    return ks


def chat_template_opt():
    """--chat-template FILE (align.chat.read_template): a path, hashed into the run's inputs (`user_file`)."""
    return opt("", "A Jinja chat template for --model's tokenizer, in place of its own (a model without one, or to "
                   "override it): prompts, conversations and --tools schemas are rendered with it, and a trained "
                   "model is saved with it ('' : the tokenizer's own).", path=True, user_file=True, group="data")


def tools_opt(help: str = "Tools the policy calls in its rollouts, which become multi-turn episodes: calculator "
                             "(the built-in: it writes <calc>EXPR</calc>, the tool answers <out>VALUE</out>, it goes "
                             "on), or FILE.py:fn1,fn2 (your functions, in a sandbox: no network, memory and time "
                             "limits); the tools' tokens carry no loss (docs/tools.md) ('' : none).", **meta):
    """--tools (align.tools)."""
    return opt("", help, code=True, group="tools", **meta)


def max_turns_opt():
    return opt(4, "With --tools: the most policy turns of an episode (a tool call ends a turn).", ge=1, group="tools")


def max_tool_tokens_opt():
    return opt(64, "With --tools: the most tokens the tools' answers add to an episode (beyond, it ends).", ge=1,
               group="tools")


def env_opt():
    """--env (align.tools.environments)."""
    return opt("", "Your environment, FILE.py:NAME: a class, one object per episode, reset(row) -> first observation, "
                   "step(turn) -> (observation, reward, done); run in a sandbox like --tools FILE.py:fn (docs/tools.md) "
                   "('' : none).", code=True, group="tools")


def tool_timeout_opt(scored: str = "scored as --on-reward-error says, or 0"):
    return opt(10.0, "With --tools FILE.py:fn: seconds one call may take; past it the tool is killed and the episode "
                     f"ends ({scored}).", gt=0, group="tools")


def verifier_opt(**meta):
    """The held-out evaluation's --verifier (sft, dpo, ppo, grpo)."""
    return opt("auto", "How held-out answers are checked, as `align eval --verifier` (auto: the rows' reasoning-gym "
                       "task, math when every answer is a number or ends in one, else exact).", code=True,
               **meta)


def read_rubric(path: str, fields: tuple[str, ...], form: str) -> str:
    """--judge-rubric's text ("" when not given), refused (UserError) unless it places each of `fields`
    ("{completion}"; a pairwise judge's "{a}" and "{b}"), `form` saying what the judge reads."""
    if not path:
        return ""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--judge-rubric {path}: cannot read it ({type(e).__name__}); pass a text file.",
                        option="judge_rubric") from None
    if missing := [f for f in fields if f not in text]:
        raise UserError(f"--judge-rubric {path}: it has no {' or '.join(missing)}; {form}.", option="judge_rubric")
    return text


def check_judge(judge: str, rubric: str, coef_set: bool = False) -> None:
    """--judge-rubric (and a judge's weight, `coef_set`) goes with --judge: refused without it."""
    if not judge and (rubric or coef_set):
        flag = "--judge-rubric" if rubric else "--judge-coef"
        raise UserError(f"{flag} goes with --judge: give --judge MODEL, or drop {flag}.",
                        option=flag[2:].replace("-", "_"))


AUTO = "auto"  # a held-out data option's default: see held_out_opt


def held_out_opt(shipped: str, help: str, split: bool = True, label: str = "held-out", group: str = "data"):
    """A held-out data option whose default, auto, follows --data (TrainConfig.resolved): the shipped file
    `shipped` when --data is the stage's default (the shipped task's training data); else, for an option of
    --data's own kind (`split`), the part --eval-split holds out of --data; else none. `label` names it in the
    run's first line (TrainConfig.held_out_note)."""
    rest = "else the --eval-split part of --data (none without it)" if split else "else none"
    root = DATA_DIR.parent
    short = str(Path(shipped).relative_to(root)) if Path(shipped).is_relative_to(root) else shipped
    return opt(AUTO, f"{help} auto: {short} when --data is the default, {rest}.", path=True, shipped=shipped,
               split=split, label=label, group=group)


def is_list(t) -> bool:
    return typing.get_origin(t) is list


def defaults(**values):
    """Class decorator, under @dataclass: new defaults for options a stage inherits (their help stays), e.g.
    `@defaults(lr=ByModel(2e-3, 2e-5), max_steps=1500)`. The option keeps its place in --help. An option with an
    automatic value (--lr, --warmup-steps: `opt(..., auto=...)`) keeps it as its default; the new value is what it
    becomes (`resolved`)."""

    def decorate(cls):
        inherited = {f.name: f for base in cls.__mro__[1:] if dataclasses.is_dataclass(base)
                     for f in dataclasses.fields(base)}
        annotations = dict(cls.__dict__.get("__annotations__", {}))
        for name, value in values.items():
            f = inherited[name]
            if "auto" in f.metadata:
                setattr(cls, name, opt(f.default, **{**f.metadata, "auto": value}))
            else:
                setattr(cls, name, opt(value, **f.metadata))
            annotations[name] = f.type
        cls.__annotations__ = annotations
        return cls

    return decorate


@dataclass(frozen=True)
class StageConfig(Options):
    """Flags every stage shares."""

    model: str = opt("tiny", "Preset name (tiny, small), a stage's --out artifact, or a save_pretrained dir.", path=True,
                     group="data")
    out: str = opt("runs/out", "Output artifact directory.", path=True, group="run")
    overwrite: bool = opt(False, "Replace the complete artifact already in --out (without it, such a run is refused "
                                 "before anything is written).", group="run")
    seed: int = opt(0, "Random seed (data order, init, sampling).", ge=0, le=SEED_MAX, group="run")
    zero_stage: int = opt(3, "DeepSpeed ZeRO stage 0..3.", ge=0, le=3, group="hardware")
    nproc: int = opt(1, "Processes to launch on this machine (relaunches itself with torchrun).", ge=1,
                     group="hardware")
    nnodes: int = opt(1, "Machines in the run: start the same command on each, with its --node-rank (torchrun's "
                         "static rendezvous at --master-addr:--master-port); --nproc processes on each.", ge=1,
                      group="hardware")
    node_rank: int = opt(0, "This machine's rank among --nnodes (0: the one at --master-addr).", ge=0, group="hardware")
    master_addr: str = opt("127.0.0.1", "With --nnodes > 1: the address of node 0, reachable from every node.",
                           group="hardware")
    master_port: int = opt(29500, "With --nnodes > 1: a free TCP port on node 0.", ge=1, le=65535, group="hardware")
    deepspeed: str = opt("", "A DeepSpeed JSON config for what align has no flag for (ZeRO bucket sizes, "
                             "persistence threshold, a ZeRO stage, ...): every key is applied, or refused with the "
                             "flag to use instead (optimizer, scheduler, batch sizes, precision, clipping).", path=True,
                         group="hardware")
    trust_remote_code: bool = opt(False, "Allow model code from the model directory (off: never run untrusted code).",
                                  group="data")
    chat_template: str = chat_template_opt()
    precision: str = opt("auto", "Compute precision: auto (bf16-pure on CUDA, bf16-mixed there with an offload; fp32 on CPU), bf16 (a bf16 module, "
                                 "fp32 master weights), bf16-mixed (fp32 weights and gradients, matmuls in bf16 under "
                                 "torch.autocast, as TRL/Accelerate's mixed precision), bf16-pure (master weights, "
                                 "gradients and Adam moments in bf16 too: 10 instead of 16 bytes per trained "
                                 "parameter; with --zero-stage 0 no master copy at all: 8 bytes; AdamW writes the "
                                 "bf16 weights with stochastic rounding, so small updates survive) or fp32.",
                         choices=PRECISIONS, group="hardware")
    compile: bool = opt(True, "One GPU process (ZeRO-0, the one-GPU default): torch.compile each transformer "
                              "block (one compile serves them all): fewer kernel launches in every forward and "
                              "backward, for a first step ~10-20 s longer on a machine's first run (inductor "
                              "caches the code on disk). Several processes, offloads and CPU runs stay eager.",
                      group="hardware")
    report_to: str = opt("", "Experiment trackers that get the metrics, config, lineage and RLMonitor events too "
                             "(rank 0): comma-separated tensorboard, wandb, trackio, mlflow (each an extra: pip "
                             "install 'align[wandb]'); local, inside --out, unless the tracker's environment "
                             "variables say otherwise (see docs/trackers.md).", group="run")

    def __post_init__(self):
        # checked at construction, so every entry point (flags, --config, pipeline validate) refuses it before
        # anything is written
        if self.nnodes >= 1 and not 0 <= self.node_rank < self.nnodes:
            raise UserError(f"--node-rank must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes}), not {self.node_rank}.")

    def validate(self):
        super().validate()
        from align import trackers

        trackers.check(self.report_to)  # an unknown or missing tracker is refused before anything runs
        if self.chat_template:
            from align.chat import read_template

            read_template(self.chat_template)
        if getattr(self, "columns", ""):  # old=new pairs; that each old name is a column is checked on the data
            from align.data import parse_columns

            parse_columns(self.columns)
        if self.deepspeed:
            from align import ds_file

            try:
                ds_file.read(self.deepspeed, offload_optimizer=getattr(self, "offload_optimizer", False))
            except UserError as e:
                raise UserError(str(e), option="deepspeed") from None


@dataclass(frozen=True)
class TrainConfig(StageConfig):
    """Flags of every stage that trains a model (sft, rm, dpo, ppo, grpo). A stage changes their defaults with
    @defaults."""

    offload_optimizer: bool = opt(False, "ZeRO-Offload: fp32 master weights, gradients and Adam moments in CPU memory "
                                         "(−12 bytes per trained parameter on the GPU; the optimiser step runs on "
                                         "the CPU).", group="hardware")
    columns: str = opt("", "Rename columns: old=new,old2=new2 (each old name must be a column of --data).",
                       group="data")
    max_steps: int = opt(1000, "Optimiser steps.", ge=1, group="optimisation")
    micro_batch_size: int = opt(0, "Sequences (pairs) per forward per process (0: the whole batch of a process; grpo: "
                                         "as many as --micro-batch-tokens allows).", ge=0, group="hardware")
    lr: float = opt(AUTO_LR, "Peak learning rate (AdamW).", ge=0, auto=ByModel(1e-4, 1e-5), group="optimisation")
    schedule: str = opt("cosine", "LR schedule after warmup: cosine, linear (both to 10%) or constant.",
                        choices=("cosine", "linear", "constant"), group="optimisation")
    warmup_steps: int = opt(AUTO_WARMUP, "Linear warmup steps.", ge=-1, auto=20,
                            auto_note="at most half of --max-steps", group="optimisation")
    weight_decay: float = opt(0.0, "AdamW weight decay (matrices only).", ge=0, group="optimisation")
    router_aux_coef: float = opt(-1.0, "Mixture-of-experts models: weight of the router's load-balancing loss added to "
                                       "the training loss (-1: the model config's router_aux_loss_coef; 0: off). "
                                       "Dense models: ignored.", ge=-1, group="optimisation")
    grad_clip: float = opt(1.0, "Gradient clipping: the global gradient norm is scaled down to at most this (0: off).",
                           ge=0, group="optimisation")
    eval_every: int = opt(100, "Evaluate on the held-out data every N steps (and always at the end; 0: only then).",
                          ge=0, group="run")
    eval_split: float = opt(0.0, "Hold out this fraction of --data as the held-out set, in place of --eval-data: "
                                 "its rows leave training (the same rows for any --seed). 0: none.", ge=0, lt=1,
                            group="data")
    save_every: int = opt(0, "Checkpoint every N steps (and one at the end unless --no-final-checkpoint; 0: none "
                             "before the end). A checkpoint holds the optimiser state: several times the model's "
                             "size on disk.", ge=0, group="run")
    keep_checkpoints: int = opt(1, "Keep the newest N checkpoints (the older ones are deleted once a new one is "
                                   "complete, so a save needs room for one more).", ge=1, group="run")
    final_checkpoint: bool = opt(True, "Checkpoint the end of the run, for a later --resume with a larger "
                                       "--max-steps (the model in model/ needs none: --no-final-checkpoint saves "
                                       "its disk space).", group="run")
    max_shard_size: str = opt("5GB", "The largest safetensors file of the saved model (transformers' "
                                     "max_shard_size, e.g. 5GB, 500MB); a larger model is written in shards with "
                                     "an index.", group="run")
    resume: bool = opt(False, "Resume from the checkpoint in --out (exactly: model, optimiser, data order, RNG).",
                       group="run")
    monitor: str = opt("", "TOML file with RLMonitor rule overrides.", path=True, group="run")
    on_alarm: str = opt("warn", "What an RLMonitor event does: warn (a warn rule warns, a stop rule stops), stop (any "
                                "event ends the run; model/ holds the best held-out evaluation's weights) or rollback "
                                "(back to the newest --save-every checkpoint, or before the first one to the run's "
                                "start, once, with the rule's advised change).", choices=("warn", "stop", "rollback"),
                         group="run")
    lora_r: int = opt(0, "LoRA rank (0: train every weight). The base stays frozen (a score head trains in full); "
                         "model/adapter/ holds the adapter.", ge=0, group="optimisation")
    lora_alpha: float = opt(16.0, "LoRA α: the update is (α / r) · B A.", gt=0, group="optimisation")
    lora_dropout: float = opt(0.0, "Dropout on the LoRA branch's input.", ge=0, lt=1, group="optimisation")
    lora_targets: str = opt("all-linear", "Modules that get adapters: all-linear (every Linear but the LM head) or "
                                          "comma-separated module names (q_proj,v_proj).", group="optimisation")
    train_vision: bool = opt(False, "A vision-language model: train its vision tower too (by default it stays "
                                    "frozen; its merger into the language model and the language model train).",
                             group="optimisation")
    merge: bool = opt(True, "With --lora-r: model/ also holds the merged model (plain transformers loads it). "
                            "--no-merge: the adapter alone (a fraction of the size); later stages merge it into its "
                            "base, this run's --model, when they load it.", group="run")
    plan: bool = opt(False, "Print the memory plan (per device: weights, gradients, optimizer state, the rollout's "
                            "decoder copy and KV cache, activations, logits; the peak against the free memory) and "
                            "exit, building and writing nothing.", group="hardware")
    plan_check: bool = opt(True, "Stop (exit 2) before building anything when the memory plan's peak exceeds the "
                                 "device's free memory, naming the smallest change that fits (a micro-batch left "
                                 "at 0 is made smaller instead); --no-plan-check runs anyway (or "
                                 "ALIGN_PLAN_CHECK=0).", group="hardware")

    def __post_init__(self):
        super().__post_init__()
        if self.offload_optimizer and (self.zero_stage == 0 or self.precision == "bf16-pure"):
            raise UserError("--offload-optimizer needs --zero-stage 1, 2 or 3 and fp32 master weights (not "
                            "--precision bf16-pure).")
        if not self.merge and not self.lora_r:
            raise UserError("--no-merge keeps a LoRA adapter without its merged model: it needs --lora-r.")
        if -1 < self.router_aux_coef < 0:
            raise UserError(f"--router-aux-coef must be -1 (the model's own) or >= 0, got {self.router_aux_coef:g}.")
        if not self.merge and getattr(self, "model", None) in PRESETS and not Path(self.model).exists():
            raise UserError(f"--no-merge: the adapter's base would be the preset {self.model!r}, a random init that "
                            "exists only in this run; train the adapter on a saved model (a directory or an "
                            "artifact), or keep the merged model (--merge).")

    def resolved(self):
        """Each held-out option left at auto (held_out_opt) made concrete: its shipped file when --data is the
        stage's default, else '' (none: the --eval-split part of --data, where it is of --data's kind)."""
        cfg = super().resolved()
        auto = {f.name: (f.metadata["shipped"] if cfg.shipped_data() and not (f.metadata["split"] and cfg.eval_split)
                         else "") for f in held_out_fields(cfg) if getattr(cfg, f.name) == AUTO}
        return dataclasses.replace(cfg, **auto) if auto else cfg

    def shipped_data(self) -> bool:
        """Whether --data is the stage's default (the shipped task's training data)."""
        data = getattr(self, "data", None)
        default = next((f.default for f in dataclasses.fields(self) if f.name == "data"), None)
        return bool(data) and isinstance(default, str) and Path(data).resolve() == Path(default).resolve()

    def held_out_note(self) -> str:
        """One line: which held-out sets the run uses, and why (a resolved config)."""
        parts = []
        for f in held_out_fields(self):
            value, name, label = getattr(self, f.name), flag(f.name), f.metadata["label"]
            if f.metadata["split"] and self.eval_split:
                why = f"{self.eval_split:.0%} of --data (--eval-split {self.eval_split:g}), removed from training"
            elif value and value == f.metadata["shipped"] and self.shipped_data():
                why = f"{value} (the shipped task's: --data is its training data)"
            elif value:
                why = f"{value} ({name})"
            elif self.shipped_data():
                why = f"none ({name} '')"
            elif f.metadata["split"]:
                why = "none (--data is yours: --eval-split 0.05 holds out 5% of it)"
            else:
                why = f"none (--data is yours: {name} FILE to measure it)"
            parts.append(f"{label}: {why}")
        return "; ".join(parts)

    def automatic(self) -> dict[str, tuple[object, str]]:
        """--lr 0: the stage's default for its --model (`ByModel`: a preset's model or a pretrained one);
        --warmup-steps -1: the stage's default, at most half of --max-steps (`auto_warmup`)."""
        auto = super().automatic()
        meta = {f.name: f.metadata for f in dataclasses.fields(self)}
        if self.lr == AUTO_LR:
            lr = meta["lr"]["auto"]
            preset = preset_architecture(self.model) if isinstance(lr, ByModel) else None
            auto["lr"] = ((lr, "default") if not isinstance(lr, ByModel) else
                          (lr.scratch, f"default for the {preset} preset's model") if preset else
                          (lr.pretrained, "default for a pretrained model"))
        if self.warmup_steps == AUTO_WARMUP:
            default = meta["warmup_steps"]["auto"]
            n = auto_warmup(default, self.max_steps)
            auto["warmup_steps"] = (n, "default" if n == default else f"half of --max-steps {self.max_steps}")
        return auto

    def validate(self):
        super().validate()
        if self.eval_split:
            given = [f for f in held_out_fields(self) if f.metadata["split"] and getattr(self, f.name) not in ("", AUTO)]
            if given:
                raise UserError(f"--eval-split holds out part of --data as the held-out set, in place of "
                                f"{flag(given[0].name)} {getattr(self, given[0].name)}: give one of the two.",
                                option="eval_split")
        from transformers.utils.hub import convert_file_size_to_int

        try:
            shard = convert_file_size_to_int(self.max_shard_size)
        except ValueError:
            shard = 0
        if shard <= 0:
            raise UserError(f"--max-shard-size must be a size such as 5GB or 500MB, got {self.max_shard_size!r}.",
                            option="max_shard_size")
        if getattr(self, "verifier", "auto") != "auto":
            from align.rewards import verifier_fn

            verifier_fn(self.verifier)  # an unknown name fails here, before --out is touched


@dataclass(frozen=True)
class SupervisedConfig(TrainConfig):
    """A stage that trains on a fixed dataset (sft, rm, dpo)."""

    batch_size: int = opt(32, "Global batch size (examples or pairs per optimiser step, all processes).", ge=1,
                          group="optimisation")
    max_length: int = opt(256, "Max tokens of an example (prompt + the longer response of a pair); the prompt is "
                               "cut from the left, a response never.", ge=1, group="data")


@dataclass(frozen=True)
class SamplingConfig(Options):
    """How responses are sampled (eval, rollouts)."""

    max_new_tokens: int = opt(48, "Max new tokens per response.", ge=1, group="sampling")
    temperature: float = opt(1.0, "Sampling temperature (0: greedy).", ge=0, group="sampling")
    top_k: int = opt(0, "Top-k sampling (0: off).", ge=0, group="sampling")
    top_p: float = opt(1.0, "Top-p sampling (1: off).", gt=0, le=1, group="sampling")


@dataclass(frozen=True)
class RLConfig(SamplingConfig, TrainConfig):
    """An RL stage (ppo, grpo): rollouts of the policy on prompts, pass@k on held-out verifiable data."""

    temperature: float = opt(1.0, "Sampling temperature of the rollouts (they are sampled: > 0); the log-probs are "
                                  "scored at the same temperature.", gt=0, group="sampling")
    data: str = opt(str(DATA_DIR / "arithmetic/train.jsonl"), "Prompts {prompt[, answer, ...]}.", path=True,
                    group="data")
    eval_data: str = held_out_opt(str(DATA_DIR / "arithmetic/test.jsonl"), "Held-out verifiable data {prompt, "
                                                                              "answer} ('' : skip).")
    eval_samples: int = opt(200, "Held-out problems to evaluate (0: skip).", ge=0, group="data")
    verifier: str = verifier_opt(group="data")
    prompts_per_step: int = opt(16, "Prompts per step (all processes).", ge=1, group="sampling")
    gather: bool = opt(True, "ZeRO-3: gather weights once per generation phase (off: synced_gpus).", group="hardware")
    tis_cap: float = opt(0.0, "Truncated importance sampling: weight each token's policy-gradient loss by "
                              "min(π_train / π_sampler, C), correcting for a decoder whose log-probs differ from the "
                              "trainer's (0: off).", ge=0, group="sampling")
    routing_replay: bool = opt(False, "Mixture-of-experts policies: the update's forwards send each token to the "
                                      "experts the rollout's decoder chose for it (the fast decoder records them), "
                                      "the gate weights from the trainer's router: no log-prob gap from routes that "
                                      "flip between decoder and trainer.", group="sampling")
    packing: bool = opt(False, "Padding-free forwards: each micro-batch's ragged sequences packed (a GPU: one row, "
                               "varlen flash attention; else fewer rows, block-diagonal attention); the same "
                               "log-probs.",
                        group="hardware")
    rollout_precision: str = opt("auto", "The rollouts' linear layers: auto (the model's compute dtype) or fp8 (E4M3 "
                                         "weights and matmuls with a scale per row in the fast decoder, about half "
                                         "the decode time where weights dominate; training stays in its dtype; "
                                         "--tis-cap 2 unless given). Held-out evaluation decodes in the compute dtype.",
                                 choices=("auto", "fp8"), group="hardware")

    def decode_precision(self) -> str:
        """The rollouts' Sampling.precision: "fp8", or "" (the compute dtype)."""
        return "fp8" if self.rollout_precision == "fp8" else ""

    def automatic(self) -> dict[str, tuple[object, str]]:
        """TrainConfig's, and --tis-cap 2 with FP8 rollouts where it is left at 0: the sampler's rounding is an
        off-policy gap that truncated importance sampling corrects."""
        auto = super().automatic()
        if self.rollout_precision == "fp8" and not self.tis_cap:
            auto["tis_cap"] = (2.0, "auto: with --rollout-precision fp8")
        return auto


def held_out_fields(cfg) -> list[dataclasses.Field]:
    """The held-out data options of a config (declared with held_out_opt)."""
    return [f for f in dataclasses.fields(cfg) if f.metadata.get("shipped")]


def held_out_choices(cfg) -> dict:
    """The held-out data options of `cfg` left at auto and what they become (TrainConfig.resolved), as the run's
    choices ({name: {"value", "why"}}): a choice the run says, since it is not the --data given ("none" where
    --data is the user's and no --eval-split holds part out)."""
    values, done = as_dict(cfg), as_dict(cfg.resolved())

    def choice(f) -> dict:
        if done[f.name]:
            return {"value": done[f.name], "why": "auto: the shipped task's"}
        if f.metadata["split"] and values.get("eval_split"):
            return {"value": f"{values['eval_split']:g} of --data", "why": "auto: --eval-split"}
        return {"value": "none", "why": "auto: --data is yours"}

    return {f.name: choice(f) for f in held_out_fields(cfg) if values[f.name] == AUTO}


def fields(cls) -> list[dataclasses.Field]:
    return list(dataclasses.fields(cls))


def field_types(cls) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def load_toml(path: str | Path) -> dict:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise UserError(f"{path}: config file not found.") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: invalid TOML: {e}.") from None


def check_value(cls, key: str, value, where: str, name: str | None = None) -> object:
    """Check one config value against its option's type, choices and bounds; returns it (ints are accepted for
    floats). `where` starts the message (a file, a key path; "" for a flag), `name` names the option in it (by
    default 'key'; a flag: --key)."""
    types = field_types(cls)
    prefix, name = (f"{where}: " if where else ""), name or repr(key)
    if key not in types:
        known = ", ".join(sorted(types))
        raise UserError(f"{prefix}unknown key {key!r} for this stage (known: {known}).")
    want = types[key]
    ok = (
        (want is bool and isinstance(value, bool))
        or (want is int and isinstance(value, int) and not isinstance(value, bool))
        or (want is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (want is str and isinstance(value, str))
        or (is_list(want) and isinstance(value, list) and all(isinstance(v, str) for v in value))
    )
    if not ok:
        kind = "a list of strings" if is_list(want) else want.__name__
        raise UserError(f"{prefix}{name} must be {kind}, got {type(value).__name__} {value!r}.")
    value = float(value) if want is float else value
    meta = next(f.metadata for f in dataclasses.fields(cls) if f.name == key)
    if disallowed(meta, value):
        raise UserError(f"{prefix}{name} must be {allowed(meta)}, got {value!r}.")
    return value


def normalise_keys(d: dict) -> dict:
    return {k.replace("-", "_"): v for k, v in d.items()}


def build(cls, toml_path: str | None, explicit: dict):
    """defaults < TOML file < explicit command-line values; checked. Its automatic values stay as they are
    (`Options.resolved`: the run resolves them, and says so)."""
    values = {}
    if toml_path:
        data = normalise_keys(load_toml(toml_path))
        for k, v in data.items():
            values[k] = check_value(cls, k, v, str(toml_path))
    for k, v in explicit.items():
        values[k] = check_value(cls, k, list(v) if isinstance(v, tuple) else v, "", flag(k))
    cfg = cls(**values)
    cfg.validate()
    return cfg


def as_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
