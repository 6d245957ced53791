"""THE registry of `align` commands: the CLI builds its commands from it and pipelines look up stage kinds in it.

Light on purpose: a command's module is imported only when that command runs, and its config dataclass (in a
light module of its own, `config_module`: no torch) when the command is used or its --help shown, so `align --help`
and `align grpo --help` start instantly and importing this module has no side effects.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    words: tuple[str, ...]  # `align <words...>`
    module: str  # where its entry function lives
    config: str  # the config dataclass: flags, TOML keys and artifact config
    help: str
    kind: str = ""  # its stage kind in pipelines ("": not a pipeline stage)
    entry: str = "run"  # the function taking the config
    positional: tuple[str, ...] = ()  # config fields given as arguments, not flags
    config_module: str = ""  # where the config dataclass lives, imported without torch ("": `module`)

    def config_class(self) -> type:
        return getattr(importlib.import_module(self.config_module or self.module), self.config)

    def run(self, cfg):
        return getattr(importlib.import_module(self.module), self.entry)(cfg)


COMMANDS = (
    Command(("sft",), "stages.sft", "SFTConfig", "Supervised fine-tuning (loss on completion tokens only).", "sft",
            config_module="stages.sft_config"),
    Command(("rm", "train"), "stages.rm", "RMConfig", "Train a Bradley-Terry reward model (scalar head on the SFT "
            "model).", "rm", config_module="stages.rm_config"),
    Command(("rm", "eval"), "stages.rm", "RMEvalConfig", "Held-out pairwise accuracy, mean margin and calibration of a "
            "reward model.", "rm-eval", entry="run_eval", config_module="stages.rm_config"),
    Command(("rm", "score"), "stages.rm", "RMScoreConfig", "Score {prompt, response} rows with a reward model "
            "(normalised) to JSONL.", "rm-score", entry="run_score", config_module="stages.rm_config"),
    Command(("ppo",), "stages.ppo", "PPOConfig", "PPO-ptx: policy, frozen reference and reward model, a separate value "
            "network, adaptive KL, pretraining mix, gold-vs-proxy reward.", "ppo", config_module="stages.ppo_config"),
    Command(("dpo",), "stages.dpo", "DPOConfig", "Direct Preference Optimization against a frozen reference (sigmoid, "
            "IPO, hinge).", "dpo", config_module="stages.dpo_config"),
    Command(("grpo",), "stages.grpo", "GRPOConfig", "GRPO / RLVR: G samples per prompt, verifiable rewards, "
            "group-relative advantages, pass@k.", "grpo", config_module="stages.grpo_config"),
    Command(("eval",), "stages.eval", "EvalConfig", "pass@k of a policy on verifiable data (greedy pass@1 + sampled).",
            "eval", positional=("model",), config_module="stages.eval_config"),
    Command(("model", "init"), "stages.model_init", "ModelInitConfig", "Build the embedded model (preset) with the "
            "shipped tokenizer.", "model-init", config_module="stages.model_init_config"),
    Command(("data", "make"), "stages.data_make", "DataMakeConfig", "Generate a dataset (and optionally a disjoint "
            "held-out split), or preference pairs sampled from a model.", "data", positional=("task",)),
    Command(("data", "show"), "stages.data_show", "DataShowConfig", "Show the first rows of a dataset as a stage "
            "trains on them: the tokens of each, which carry loss, and their counts.", positional=("data",)),
    Command(("report",), "align.report", "ReportConfig", "Dashboard PNG of a run's metrics (several runs: overlaid).",
            entry="run_report", positional=("runs",)),
    Command(("reward", "serve"), "align.reward_serve", "ServeConfig", "Serve a reward function or reward model over "
            "HTTP, for --reward http://HOST:PORT/NAME.", positional=("reward",)),
    Command(("export",), "align.export", "ExportConfig", "Export a run's model as a plain transformers model (LoRA "
            "merged) with its tokenizer, chat template and a model card of its lineage.", entry="run",
            positional=("run",)),
)

GROUPS = {"rm": "Bradley-Terry reward model: train, eval, score.", "model": "Create models.",
          "data": "Generate and inspect datasets.", "reward": "Serve rewards over HTTP.", "pipeline": "Run a chain of stages from a TOML file."}

KINDS: dict[str, Command] = {c.kind: c for c in COMMANDS if c.kind}
