"""Defaults that suit the model, and every choice a run makes itself said and recorded: --lr left unset is the
stage's recipe for the shipped presets' models and a pretrained model's default for any other, --warmup-steps left
unset is the stage's default at most half of --max-steps, and the run's first lines say what it chose (precision,
micro-batch, ZeRO stage, lr, warmup, verifier), as artifact.json's "choices" does."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from align import config as C
from align.models import preset_architecture
from stages.dpo import DPOConfig
from stages.grpo import GRPOConfig
from stages.ppo import PPOConfig
from stages.rm import RMConfig
from stages.sft import SFTConfig
from tests.conftest import ROOT, output, run_align, small_data

CONFIGS = {"sft": SFTConfig, "rm": RMConfig, "dpo": DPOConfig, "ppo": PPOConfig, "grpo": GRPOConfig}


@pytest.fixture(scope="module")
def pretrained_dir(tmp_path_factory) -> Path:
    """A Llama of an architecture no preset has (hidden 64, 1 layer), saved with the shipped tokenizer: a model
    align did not build, so a "pretrained" one as far as the defaults go."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from align.models import load_tokenizer, resolve

    out = tmp_path_factory.mktemp("pretrained")
    tok = load_tokenizer(resolve("tiny"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def test_a_preset_and_a_model_of_its_architecture_are_told_from_a_pretrained_one(tmp_path, tiny_model_dir,
                                                                                   pretrained_dir):
    assert preset_architecture("tiny") == "tiny" and preset_architecture("small") == "small"
    assert preset_architecture(str(tiny_model_dir)) == "tiny"  # the tiny preset saved with save_pretrained
    assert preset_architecture(str(pretrained_dir)) is None
    assert preset_architecture("HuggingFaceTB/SmolLM2-135M-Instruct") is None  # a hub id: never looked up here
    artifact = tmp_path / "art"
    (artifact / "model").mkdir(parents=True)
    (artifact / "artifact.json").write_text("{}")
    (artifact / "model" / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    assert preset_architecture(str(artifact)) == "tiny"  # an artifact: its model/config.json
    (artifact / "model" / "config.json").write_text("{not json")
    assert preset_architecture(str(artifact)) is None


@pytest.mark.parametrize("stage, scratch, pretrained, warmup", [
    ("sft", 2e-3, 2e-5, 50), ("rm", 5e-4, 2e-5, 50), ("dpo", 1e-4, 1e-6, 20), ("ppo", 1e-4, 1e-6, 0),
    ("grpo", 5e-5, 1e-6, 5)])
def test_lr_and_warmup_left_unset_resolve_by_model_and_budget(stage, scratch, pretrained, warmup, tiny_model_dir,
                                                              pretrained_dir):
    cls = CONFIGS[stage]
    base = dict(model=str(tiny_model_dir), max_steps=1000)
    if stage == "ppo":
        base["reward_model"] = str(tiny_model_dir)
    cfg = cls(**base)
    assert (cfg.lr, cfg.warmup_steps) == (C.AUTO_LR, C.AUTO_WARMUP)  # left to the run until it resolves them
    tiny = cfg.resolved()
    assert (tiny.lr, tiny.warmup_steps) == (scratch, warmup)
    assert cfg.automatic()["lr"] == (scratch, "default for the tiny preset's model")
    pre = cls(**{**base, "model": str(pretrained_dir)}).resolved()
    assert (pre.lr, pre.warmup_steps) == (pretrained, warmup)
    short = cls(**{**base, "max_steps": 3}).resolved()
    assert short.warmup_steps == min(warmup, 1)  # at most half of the run: a 3-step run is not all warmup
    explicit = cls(**{**base, "lr": 3e-4, "warmup_steps": 7, "max_steps": 3})
    assert (explicit.resolved().lr, explicit.resolved().warmup_steps) == (3e-4, 7)
    assert not {"lr", "warmup_steps"} & set(explicit.automatic())


def test_warmup_left_unset_is_the_default_at_most_half_the_run():
    assert [C.auto_warmup(50, n) for n in (1, 2, 3, 10, 99, 100, 500, 1500)] == [0, 1, 1, 5, 49, 50, 50, 50]
    assert C.auto_warmup(0, 12) == 0
    cfg = SFTConfig(max_steps=3)
    assert cfg.automatic()["warmup_steps"] == (1, "half of --max-steps 3")
    assert SFTConfig(max_steps=600).automatic()["warmup_steps"] == (50, "default")


# the learning rate and warmup each training stage of the shipped pipelines ran with before they were left to the
# run; its models are the tiny preset's (model init, then the stages after it)
SHIPPED = {("pipelines.toml", "sft"): (2e-3, 50), ("pipelines.toml", "rm"): (2e-4, 5),
           ("pipelines.toml", "ppo"): (1e-4, 0), ("pipelines.toml", "dpo"): (1e-4, 20),
           ("pipelines.toml", "grpo"): (5e-5, 5), ("pipelines/arithmetic.toml", "sft"): (2e-3, 50),
           ("pipelines/arithmetic.toml", "rm"): (2e-4, 10), ("pipelines/arithmetic.toml", "ppo"): (3e-5, 0),
           ("pipelines/arithmetic.toml", "dpo"): (1e-4, 20), ("pipelines/arithmetic.toml", "grpo"): (5e-5, 5)}


@pytest.mark.parametrize("file, stage", list(SHIPPED))
def test_the_shipped_pipelines_run_with_the_lr_and_warmup_they_always_had(file, stage, tiny_model_dir):
    table = tomllib.loads((ROOT / file).read_text())["stages"][stage]
    values = {k: v for k, v in table.items() if k in ("lr", "warmup_steps", "max_steps")}
    cfg = CONFIGS[stage](model=str(tiny_model_dir), **values).resolved()  # @base, @sft...: the tiny preset's
    assert (cfg.lr, cfg.warmup_steps) == SHIPPED[file, stage]


def test_held_out_data_left_at_the_shipped_default_is_a_choice_said(tmp_path):
    from align.config import held_out_choices
    from align.engine.run import fmt_choice
    from align.paths import DATA_DIR

    test = str(DATA_DIR / "arithmetic/test.jsonl")
    assert held_out_choices(SFTConfig()) == {"eval_data": {"value": test, "why": "auto: the shipped task's"}}
    mine = str(tmp_path / "train.jsonl")  # the user's --data: no held-out set unless --eval-split holds part out
    assert held_out_choices(SFTConfig(data=mine)) == {"eval_data": {"value": "none", "why": "auto: --data is yours"}}
    assert held_out_choices(SFTConfig(data=mine, eval_split=0.1)) == {
        "eval_data": {"value": "0.1 of --data", "why": "auto: --eval-split"}}
    assert held_out_choices(SFTConfig(eval_data=str(tmp_path / "mine.jsonl"))) == {}  # given: no choice
    assert held_out_choices(SFTConfig(eval_data="")) == {}
    assert set(held_out_choices(DPOConfig())) == {"eval_data", "pass_data"}
    assert fmt_choice(2e-5) == "2e-05" and fmt_choice(0.002) == "0.002" and fmt_choice(4) == "4"


def test_a_run_says_and_records_what_it_chose(tmp_path, pretrained_dir):
    """A 2-step SFT of a pretrained model with nothing set: one "choices:" line before training (precision,
    micro-batch, lr, warmup, verifier), the same in artifact.json, and the run used them."""
    data = small_data()
    out = tmp_path / "sft"
    proc = run_align("sft", "--model", pretrained_dir, "--data", data["arith"], "--eval-data", data["arith_test"],
                     "--max-steps", 2, "--batch-size", 4, "--eval-samples", 2, "--max-new-tokens", 2, "--out", out)
    said = " ".join(output(proc).split())
    assert proc.returncode == 0, said[-3000:]
    line = ("choices: --precision fp32 (auto: CPU), --micro-batch-size 4 (auto), --lr 2e-05 (default for a "
            "pretrained model), --warmup-steps 1 (half of --max-steps 2), --verifier math (auto: the answers are "
            "numbers)")
    assert line in said and said.index("choices:") < said.index("sft: ")
    art = json.loads((out / "artifact.json").read_text())
    assert art["choices"] == {"precision": {"value": "fp32", "why": "auto: CPU"},
                              "micro_batch_size": {"value": 4, "why": "auto"},
                              "lr": {"value": 2e-5, "why": "default for a pretrained model"},
                              "warmup_steps": {"value": 1, "why": "half of --max-steps 2"},
                              "verifier": {"value": "math", "why": "auto: the answers are numbers"}}
    assert art["config"]["lr"] == 2e-5 and art["config"]["warmup_steps"] == 1  # the config as the run used it
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows if "lr" in r][0] == pytest.approx(2e-5)
    explicit = run_align("sft", "--model", pretrained_dir, "--data", data["arith"], "--eval-data", "", "--max-steps", 1,
                         "--batch-size", 4, "--micro-batch-size", 4, "--lr", "1e-4", "--warmup-steps", 0,
                         "--precision", "fp32", "--out", tmp_path / "explicit")
    assert explicit.returncode == 0 and "choices:" not in output(explicit)
    assert "choices" not in json.loads((tmp_path / "explicit" / "artifact.json").read_text())
