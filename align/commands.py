"""Registers every `align` command. Stage modules keep heavy imports inside `run`, so this stays light."""

from __future__ import annotations

from dataclasses import dataclass

from align.cli import app, data_app, model_app, pipeline_app, rm_app, stage_command
from align.config import opt
from stages.dpo import DPOConfig
from stages.eval import EvalConfig
from stages.model_init import ModelInitConfig
from stages.ppo import PPOConfig
from stages.rm import RMConfig, RMEvalConfig, RMScoreConfig
from stages.grpo import GRPOConfig
from stages.sft import SFTConfig


@stage_command(model_app, "init", ModelInitConfig, "Build the embedded model (preset) with the shipped tokenizer.")
def model_init(cfg):
    from stages import model_init

    model_init.run(cfg)


@stage_command(app, "sft", SFTConfig, "Supervised fine-tuning (loss on completion tokens only).")
def sft(cfg):
    from stages import sft

    sft.run(cfg)


@stage_command(app, "eval", EvalConfig, "pass@k of a policy on verifiable data (greedy pass@1 + sampled).",
               positional=("model",))
def eval_(cfg):
    from stages import eval as ev

    ev.run(cfg)


@dataclass
class DataMakeConfig:
    task: str = opt("arithmetic", "Task: arithmetic, sort, prefs or text.")
    n: int = opt(1000, "Rows to generate.")
    seed: int = opt(0, "Random seed.")
    out: str = opt("data.jsonl", "Output JSONL file.")
    test_n: int = opt(0, "Also write a held-out split of N rows, disjoint from the main one.")
    test_out: str = opt("", "Held-out output file (default: OUT with .test.jsonl).")
    levels: str = opt("1,2,3,4", "arithmetic/prefs difficulty levels: 1-digit/2 operands .. 2-digit/3 operands.")


@stage_command(data_app, "make", DataMakeConfig, "Generate a dataset (and optionally a disjoint held-out split).",
               positional=("task",))
def data_make(cfg):
    from pathlib import Path

    from align import tasks
    from align.console import summary_table
    from align.errors import UserError

    try:
        levels = tuple(int(x) for x in cfg.levels.split(","))
    except ValueError:
        raise UserError(f"--levels must be comma-separated integers 1..4, not {cfg.levels!r}.") from None
    opts = {"levels": levels} if cfg.task in ("arithmetic", "prefs") else {}
    rows = tasks.make_dataset(cfg.task, cfg.n, cfg.seed, **opts)
    tasks.write_jsonl(rows, Path(cfg.out))
    summary = {"task": cfg.task, "rows": len(rows), "out": cfg.out}
    if cfg.test_n:
        key = "text" if cfg.task == "text" else "prompt"
        test = tasks.make_dataset(cfg.task, cfg.test_n, cfg.seed + 1_000_003, exclude={r[key] for r in rows}, **opts)
        test_out = cfg.test_out or str(Path(cfg.out).with_suffix("")) + ".test.jsonl"
        tasks.write_jsonl(test, Path(test_out))
        summary.update(test_rows=len(test), test_out=test_out)
    summary_table("data make", summary)




@stage_command(rm_app, "train", RMConfig, "Train a Bradley-Terry reward model (scalar head on the SFT model).")
def rm_train(cfg):
    from stages import rm

    rm.run(cfg)


@stage_command(rm_app, "eval", RMEvalConfig, "Held-out pairwise accuracy, mean margin and calibration of a reward model.")
def rm_eval(cfg):
    from stages import rm

    rm.run_eval(cfg)


@stage_command(rm_app, "score", RMScoreConfig, "Score {prompt, response} rows with a reward model (normalised) to JSONL.")
def rm_score(cfg):
    from stages import rm

    rm.run_score(cfg)


@stage_command(app, "dpo", DPOConfig, "Direct Preference Optimization against a frozen reference (sigmoid, IPO, hinge).")
def dpo(cfg):
    from stages import dpo

    dpo.run(cfg)


@stage_command(app, "ppo", PPOConfig, "PPO-ptx: policy, frozen reference and reward model, a separate value "
                                        "network, adaptive KL, pretraining mix, gold-vs-proxy reward.")
def ppo(cfg):
    from stages import ppo

    ppo.run(cfg)


@stage_command(app, "grpo", GRPOConfig, "GRPO / RLVR: G samples per prompt, verifiable rewards, group-relative "
                                          "advantages, pass@k.")
def grpo(cfg):
    from stages import grpo

    grpo.run(cfg)

from align import pipeline_cli  # noqa: E402,F401  (pipeline run|validate|show)

__all__ = ["pipeline_app"]
