"""Stage configs: one dataclass per stage, filled from defaults < `--config FILE.toml` < command-line flags.

A field's `help` metadata is its --help text; the CLI options are generated from the dataclass, so a stage's
flags, TOML keys and artifact config are always the same names.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from align.errors import UserError
from align.models import PRESETS
from align.paths import DATA_DIR

PRECISIONS = ("auto", "bf16", "bf16-mixed", "bf16-pure", "fp32")


def opt(default, help: str, **meta):
    if isinstance(default, list):  # repeatable flag (--reward a --reward b) / TOML array
        return field(default_factory=lambda: list(default), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


def verifier_opt():
    """The held-out evaluation's --verifier (sft, dpo, ppo, grpo)."""
    return opt("auto", "How held-out answers are checked, as `align eval --verifier` (auto: the rows' reasoning-gym "
                       "task, math for numbers, else exact).")


def is_list(t) -> bool:
    return typing.get_origin(t) is list


def defaults(**values):
    """Class decorator, under @dataclass: new defaults for options a stage inherits (their help stays), e.g.
    `@defaults(lr=2e-3, max_steps=1500)`. The option keeps its place in --help."""

    def decorate(cls):
        inherited = {f.name: f for base in cls.__mro__[1:] if dataclasses.is_dataclass(base)
                     for f in dataclasses.fields(base)}
        annotations = dict(cls.__dict__.get("__annotations__", {}))
        for name, value in values.items():
            f = inherited[name]
            setattr(cls, name, opt(value, **f.metadata))
            annotations[name] = f.type
        cls.__annotations__ = annotations
        return cls

    return decorate


@dataclass
class StageConfig:
    """Flags every stage shares."""

    model: str = opt("tiny", "Preset name (tiny, small), a stage's --out artifact, or a save_pretrained dir.", path=True)
    out: str = opt("runs/out", "Output artifact directory.", path=True)
    seed: int = opt(0, "Random seed (data order, init, sampling).")
    zero_stage: int = opt(3, "DeepSpeed ZeRO stage 0..3.")
    nproc: int = opt(1, "Processes to launch on this machine (relaunches itself with torchrun).")
    nnodes: int = opt(1, "Machines in the run: start the same command on each, with its --node-rank (torchrun's "
                         "static rendezvous at --master-addr:--master-port); --nproc processes on each.")
    node_rank: int = opt(0, "This machine's rank among --nnodes (0: the one at --master-addr).")
    master_addr: str = opt("127.0.0.1", "With --nnodes > 1: the address of node 0, reachable from every node.")
    master_port: int = opt(29500, "With --nnodes > 1: a free TCP port on node 0.")
    deepspeed: str = opt("", "A DeepSpeed JSON config; its keys win over align's.", path=True)
    trust_remote_code: bool = opt(False, "Allow model code from the model directory (off: never run untrusted code).")
    precision: str = opt("auto", "Compute precision: auto (bf16-pure on CUDA, bf16-mixed there with an offload; fp32 on CPU), bf16 (a bf16 module, "
                                 "fp32 master weights), bf16-mixed (fp32 weights and gradients, matmuls in bf16 under "
                                 "torch.autocast, as TRL/Accelerate's mixed precision), bf16-pure (master weights, "
                                 "gradients and Adam moments in bf16 too: 10 instead of 16 bytes per trained "
                                 "parameter; with --zero-stage 0 no master copy at all: 8 bytes; AdamW writes the "
                                 "bf16 weights with stochastic rounding, so small updates survive) or fp32.")
    compile: bool = opt(True, "One GPU process (ZeRO-0, the one-GPU default): torch.compile each transformer "
                              "block (one compile serves them all): fewer kernel launches in every forward and "
                              "backward, for a first step up to ~1 min longer on a machine's first run (inductor "
                              "caches the code on disk). Several processes, offloads and CPU runs stay eager.")

    def __post_init__(self):
        # checked at construction, so every entry point (flags, --config, pipeline validate) refuses it before
        # anything is written
        if self.precision not in PRECISIONS:
            raise UserError(f"--precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}.")
        if not 0 <= self.zero_stage <= 3:
            raise UserError(f"--zero-stage must be 0..3, not {self.zero_stage}.")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise UserError(f"--node-rank must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes}), not {self.node_rank}.")


@dataclass
class TrainConfig(StageConfig):
    """Flags of every stage that trains a model (sft, rm, dpo, ppo, grpo). A stage changes their defaults with
    @defaults."""

    offload_optimizer: bool = opt(False, "ZeRO-Offload: fp32 master weights, gradients and Adam moments in CPU memory "
                                         "(−12 bytes per trained parameter on the GPU; the optimiser step runs on "
                                         "the CPU).")
    columns: str = opt("", "Rename columns: old=new,old2=new2.")
    max_steps: int = opt(1000, "Optimiser steps.")
    micro_batch_size: int = opt(0, "Sequences (pairs) per forward per process (0: the whole batch of a process; grpo: "
                                         "as many as --micro-batch-tokens allows).")
    lr: float = opt(1e-4, "Peak learning rate (AdamW).")
    schedule: str = opt("cosine", "LR schedule after warmup: cosine, linear (both to 10%) or constant.")
    warmup_steps: int = opt(20, "Linear warmup steps.")
    weight_decay: float = opt(0.0, "AdamW weight decay (matrices only).")
    grad_clip: float = opt(1.0, "Gradient clipping (global norm).")
    eval_every: int = opt(100, "Evaluate on the held-out data every N steps (and always at the end; 0: only then).")
    save_every: int = opt(0, "Checkpoint every N steps (always one at the end; 0: end only).")
    resume: bool = opt(False, "Resume from the checkpoint in --out (exactly: model, optimiser, data order, RNG).")
    monitor: str = opt("", "TOML file with RLMonitor rule overrides.", path=True)
    lora_r: int = opt(0, "LoRA rank (0: train every weight). The base stays frozen (a score head trains in full); "
                         "model/adapter/ holds the adapter.")
    lora_alpha: float = opt(16.0, "LoRA α: the update is (α / r) · B A.")
    lora_dropout: float = opt(0.0, "Dropout on the LoRA branch's input.")
    lora_targets: str = opt("all-linear", "Modules that get adapters: all-linear (every Linear but the LM head) or "
                                          "comma-separated module names (q_proj,v_proj).")
    merge: bool = opt(True, "With --lora-r: model/ also holds the merged model (plain transformers loads it). "
                            "--no-merge: the adapter alone (a fraction of the size); later stages merge it into its "
                            "base, this run's --model, when they load it.")

    def __post_init__(self):
        super().__post_init__()
        if self.offload_optimizer and (self.zero_stage == 0 or self.precision == "bf16-pure"):
            raise UserError("--offload-optimizer needs --zero-stage 1, 2 or 3 and fp32 master weights (not "
                            "--precision bf16-pure).")
        if self.lora_r < 0 or not self.lora_alpha > 0 or not 0 <= self.lora_dropout < 1:
            raise UserError(f"--lora-r must be >= 0, --lora-alpha > 0 and --lora-dropout in [0, 1), not "
                            f"{self.lora_r}, {self.lora_alpha} and {self.lora_dropout}.")
        if not self.merge and not self.lora_r:
            raise UserError("--no-merge keeps a LoRA adapter without its merged model: it needs --lora-r.")
        if not self.merge and getattr(self, "model", None) in PRESETS and not Path(self.model).exists():
            raise UserError(f"--no-merge: the adapter's base would be the preset {self.model!r}, a random init that "
                            "exists only in this run; train the adapter on a saved model (a directory or an "
                            "artifact), or keep the merged model (--merge).")

    def validate(self):
        if self.schedule not in ("cosine", "linear", "constant"):
            raise UserError(f"--schedule must be cosine, linear or constant, not {self.schedule!r}.")
        if self.max_steps <= 0 or not self.lr > 0:
            raise UserError(f"--max-steps and --lr must be positive (got {self.max_steps} and {self.lr}).")
        if min(self.warmup_steps, self.eval_every, self.save_every, self.micro_batch_size, self.weight_decay) < 0:
            raise UserError("--warmup-steps, --eval-every, --save-every, --micro-batch-size and --weight-decay "
                            "must be >= 0.")
        if not self.grad_clip > 0:
            raise UserError(f"--grad-clip must be positive, not {self.grad_clip}.")
        if getattr(self, "verifier", "auto") != "auto":
            from align.rewards import verifier_fn

            verifier_fn(self.verifier)  # an unknown name fails here, before --out is touched


@dataclass
class SupervisedConfig(TrainConfig):
    """A stage that trains on a fixed dataset (sft, rm, dpo)."""

    batch_size: int = opt(32, "Global batch size (examples or pairs per optimiser step, all processes).")
    max_length: int = opt(256, "Max tokens of an example (prompt + the longer response of a pair); the prompt is "
                               "cut from the left, a response never.")

    def validate(self):
        super().validate()
        if self.batch_size <= 0:
            raise UserError("--batch-size must be positive.")


@dataclass
class SamplingConfig:
    """How responses are sampled (eval, rollouts)."""

    max_new_tokens: int = opt(48, "Max new tokens per response.")
    temperature: float = opt(1.0, "Sampling temperature (the RL stages score log-probs at the same temperature).")
    top_k: int = opt(0, "Top-k sampling (0: off).")
    top_p: float = opt(1.0, "Top-p sampling (1: off).")


@dataclass
class RLConfig(SamplingConfig, TrainConfig):
    """An RL stage (ppo, grpo): rollouts of the policy on prompts, pass@k on held-out verifiable data."""

    data: str = opt(str(DATA_DIR / "arithmetic/train.jsonl"), "Prompts {prompt[, answer, ...]}.", path=True)
    eval_data: str = opt(str(DATA_DIR / "arithmetic/test.jsonl"), "Held-out verifiable data {prompt, answer} "
                                                                    "('' : skip).", path=True)
    eval_samples: int = opt(200, "Held-out problems to evaluate (0: skip).")
    verifier: str = verifier_opt()
    prompts_per_step: int = opt(16, "Prompts per step (all processes).")
    gather: bool = opt(True, "ZeRO-3: gather weights once per generation phase (off: synced_gpus).")

    def validate(self):
        super().validate()
        if self.prompts_per_step <= 0:
            raise UserError("--prompts-per-step must be positive.")
        if not self.temperature > 0:
            raise UserError("--temperature must be > 0: rollouts are sampled.")


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


def check_value(cls, key: str, value, where: str) -> object:
    """Type-check one config value; returns it (ints are accepted for floats)."""
    types = field_types(cls)
    if key not in types:
        known = ", ".join(sorted(types))
        raise UserError(f"{where}: unknown key {key!r} for this stage (known: {known}).")
    want = types[key]
    ok = (
        (want is bool and isinstance(value, bool))
        or (want is int and isinstance(value, int) and not isinstance(value, bool))
        or (want is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (want is str and isinstance(value, str))
        or (is_list(want) and isinstance(value, list) and all(isinstance(v, str) for v in value))
    )
    if not ok:
        name = "a list of strings" if is_list(want) else want.__name__
        raise UserError(f"{where}: {key!r} must be {name}, got {type(value).__name__} {value!r}.")
    return float(value) if want is float else value


def normalise_keys(d: dict) -> dict:
    return {k.replace("-", "_"): v for k, v in d.items()}


def build(cls, toml_path: str | None, explicit: dict):
    """defaults < TOML file < explicit command-line values."""
    values = {}
    if toml_path:
        data = normalise_keys(load_toml(toml_path))
        for k, v in data.items():
            values[k] = check_value(cls, k, v, f"{toml_path}: key {k!r}")
    values.update(explicit)
    cfg = cls(**values)
    validate = getattr(cfg, "validate", None)
    if validate:
        validate()
    return cfg


def as_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
