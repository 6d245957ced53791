"""Bad values are refused up front, the same way from every entry point (flags, --config files, pipeline keys):
exit 2, one line naming the flag (or file and key), the value and what is allowed; nothing written. Every key of
a --deepspeed file is applied or refused. Messages and --help show the user's text as written (no emoji, no
markup eaten)."""

import json
import re
import sys

import pytest

from align import config as C
from align import ds_file
from align import pipeline as P
from align import registry
from align.cli import main
from align.console import console
from align.errors import UserError
from tests.conftest import small_data

TRAINERS = [("sft",), ("rm", "train"), ("dpo",), ("ppo",), ("grpo",)]
POSITIONAL = {("eval",): ["tiny"], ("data", "make"): ["arithmetic"]}


def align(monkeypatch, capsys, *args) -> tuple[int, list[str]]:
    """`align ARGS` in this process (the CLI's own error handling): (exit code, the lines printed, without
    DeepSpeed's logging)."""
    monkeypatch.setattr(sys, "argv", ["align", *map(str, args)])
    monkeypatch.setattr(console, "_width", 1000)  # one message, one line
    with pytest.raises(SystemExit) as e:
        main()
    out = capsys.readouterr()
    lines = [x for x in (out.out + out.err).splitlines() if x.strip() and "[WARNING]" not in x]
    return e.value.code, lines


def refused(monkeypatch, capsys, tmp_path, *args) -> str:
    """The one error line of a command refused with exit 2 before it wrote anything."""
    code, lines = align(monkeypatch, capsys, *args, "--out", tmp_path / "out")
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, lines)
    assert "Traceback" not in lines[0] and not (tmp_path / "out").exists()
    return lines[0].removeprefix("error: ")


# ---------------------------------------------------------------------------------------- declared ranges


def test_every_default_is_allowed_and_help_shows_the_range():
    for cmd in registry.COMMANDS:
        cls = cmd.config_class()
        for f in C.fields(cls):
            default = f.default_factory() if C.is_list(C.field_types(cls)[f.name]) else f.default
            assert not C.disallowed(f.metadata, default), (cmd.words, f.name, default)
            if any(k in f.metadata for k in ("ge", "gt", "le", "lt")):
                assert C.help_text(f).endswith(f"[{C.allowed(f.metadata)}]")


CASES = [  # (command, flag, value, the allowed range as the message says it)
    *[(c.words, "--seed", "-1", ">= 0 and <= 4294967295") for c in registry.COMMANDS  # every command with a seed
      if "seed" in C.field_types(c.config_class())],
    *[(words, flag, value, rule) for words in TRAINERS for flag, value, rule in
      [("--lr", "-1", ">= 0"), ("--max-steps", "0", ">= 1"), ("--grad-clip", "-1", ">= 0"),
       ("--warmup-steps", "-2", ">= -1"), ("--lora-dropout", "1", ">= 0 and < 1"), ("--zero-stage", "4", ">= 0 and <= 3")]],
    *[(words, "--batch-size", "0", ">= 1") for words in [("sft",), ("rm", "train"), ("dpo",), ("eval",), ("rm", "score")]],
    *[(words, "--max-new-tokens", "0", ">= 1") for words in [("sft",), ("dpo",), ("ppo",), ("grpo",), ("eval",)]],
    *[(words, "--top-p", "2", "> 0 and <= 1") for words in [("ppo",), ("grpo",), ("eval",)]],
    *[(words, "--temperature", "0", "> 0") for words in [("ppo",), ("grpo",), ("dpo",)]],  # sampled rollouts
    (("eval",), "--temperature", "-1", ">= 0"),  # 0: greedy
    (("eval",), "--limit", "-3", ">= 0"),
    (("grpo",), "--epsilon", "-0.2", "> 0"),
    (("grpo",), "--num-generations", "1", ">= 2"),
    (("ppo",), "--gamma", "1.5", ">= 0 and <= 1"),
    (("dpo",), "--label-smoothing", "0.5", ">= 0 and < 0.5"),
    (("sft",), "--lr", "nan", ">= 0"),
]


@pytest.mark.parametrize("words, flag, value, rule", CASES, ids=[" ".join([*c[0], c[1], c[2]]) for c in CASES])
def test_a_value_out_of_range_is_refused_naming_flag_value_and_range(monkeypatch, capsys, tmp_path, words, flag,
                                                                      value, rule):
    msg = refused(monkeypatch, capsys, tmp_path, *words, *POSITIONAL.get(words, []), flag, value)
    shown = repr(float(value)) if value == "nan" else value
    assert re.fullmatch(rf"{flag} must be {re.escape(rule)}, got {re.escape(shown)}(\.0)?\.", msg), msg


@pytest.mark.parametrize("words, flag, value, choices", [
    (("sft",), "--schedule", "cosnie", "cosine, linear, constant"),
    (("grpo",), "--on-reward-error", "ignore", "fail, skip, zero"),
    (("model", "init"), "--preset", "huge", "tiny, small, tiny-vl"),
    (("eval",), "--precision", "fp8", "auto, bf16, bf16-mixed, bf16-pure, fp32"),
])
def test_a_value_outside_the_choices_is_refused(monkeypatch, capsys, tmp_path, words, flag, value, choices):
    msg = refused(monkeypatch, capsys, tmp_path, *words, *POSITIONAL.get(words, []), flag, value)
    assert msg == f"{flag} must be one of {choices}, got {value!r}."


def test_config_files_and_pipeline_keys_are_held_to_the_same_ranges(tmp_path):
    from stages.eval import EvalConfig

    toml = tmp_path / "ev.toml"
    toml.write_text("limit = -3\n")
    with pytest.raises(UserError) as e:
        C.build(EvalConfig, str(toml), {})
    assert str(e.value) == f"{toml}: 'limit' must be >= 0, got -3."
    pipe = tmp_path / "p.toml"
    pipe.write_text('[pipeline]\nseed = -1\n\n[stages.ev]\nstage = "eval"\nmodel = "tiny"\ntop_p = 2\n'
                    '[stages.g]\nstage = "grpo"\nepsilon = -0.2\n')
    _, problems = P.parse(pipe)
    assert [pr.format("p.toml") for pr in problems] == [
        "p.toml:2: pipeline.seed: 'seed' must be >= 0 and <= 4294967295, got -1",
        "p.toml:7: stages.ev.top_p: 'top_p' must be > 0 and <= 1, got 2.0",
        "p.toml:10: stages.g.epsilon: 'epsilon' must be > 0, got -0.2"]


def test_grad_clip_0_is_off():
    from align.engine.build import ds_config, own_clipping
    from stages.sft import SFTConfig

    assert C.build(SFTConfig, None, {"grad_clip": 0.0}).grad_clip == 0.0
    import torch

    cfg = ds_config(zero_stage=3, micro_batch=1, grad_accum=1, world_size=1, dtype=torch.float32, grad_clip=0.0)
    assert cfg["gradient_clipping"] == 0.0  # DeepSpeed: 0 clips nothing
    cfg0 = ds_config(zero_stage=0, micro_batch=1, grad_accum=1, world_size=1, dtype=torch.float32, grad_clip=0.0)
    assert own_clipping(cfg0) == 0.0  # Trained measures the norm and clips nothing


def test_columns_naming_no_column_of_the_data_is_refused(monkeypatch, capsys, tmp_path):
    msg = refused(monkeypatch, capsys, tmp_path, "eval", "tiny", "--data", small_data()["arith_test"],
                  "--columns", "nosuch=prompt")
    assert msg.endswith("--columns maps 'nosuch', but the data has no such column (prompt, completion, answer, level).")
    msg = refused(monkeypatch, capsys, tmp_path, "sft", "--columns", "question")
    assert msg == "--columns: 'question' is not of the form old=new (e.g. --columns question=prompt)."


# --------------------------------------------------------------------------------------------- --deepspeed


def test_a_deepspeed_optimizer_is_refused_naming_the_key_and_the_flags(monkeypatch, capsys, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}))
    msg = refused(monkeypatch, capsys, tmp_path, "sft", *["--data", small_data()["arith"]], "--deepspeed", ds)
    assert msg.startswith(f"{ds}: optimizer: align builds its own AdamW") and "use --lr and --weight-decay" in msg


@pytest.mark.parametrize("config, needle", [
    *[({key.split(".")[-1]: {}} if "." not in key else {"zero_optimization": {key.split(".")[1]: {}}},
       f": {key}: {hint}") for key, hint in ds_file.REFUSED.items()],
    ({"zero_optimisation": {"stage": 2}}, ": zero_optimisation: not a DeepSpeed setting align applies"),
    ({"zero_optimization": {"stagee": 2}}, ": zero_optimization.stagee: Extra inputs are not permitted"),
    ({"zero_optimization": {"stage": 5}}, ": zero_optimization.stage must be 0, 1, 2 or 3, got 5."),
    ([1, 2], ": a DeepSpeed config is a JSON object"),
])
def test_deepspeed_keys_align_sets_itself_or_cannot_apply_are_refused(tmp_path, config, needle):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(config))
    with pytest.raises(UserError) as e:
        ds_file.read(ds)
    assert str(e.value).startswith(f"{ds}{needle}"), str(e.value)


def test_every_other_deepspeed_key_reaches_the_engine_config(tmp_path):
    import torch

    from align.engine.build import ds_config, engine_stage

    user = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 1234, "stage3_param_persistence_threshold": 0},
            "steps_per_print": 7, "communication_data_type": "fp32", "wall_clock_breakdown": True}
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(user))
    stage, _ = engine_stage(3, 1, torch.device("cuda"), user_config=str(ds))
    cfg = ds_config(zero_stage=stage, micro_batch=2, grad_accum=4, world_size=1, dtype=torch.float32, user_config=str(ds))
    assert cfg["zero_optimization"]["stage"] == 2 and cfg["zero_optimization"]["reduce_bucket_size"] == 1234
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    assert (cfg["steps_per_print"], cfg["communication_data_type"], cfg["wall_clock_breakdown"]) == (7, "fp32", True)
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (2, 4)  # align's layout
    off = tmp_path / "ds0.json"
    off.write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    with pytest.raises(UserError, match="zero_optimization.stage 0: --offload-optimizer needs ZeRO stage 1, 2 or 3"):
        ds_file.read(off, offload_optimizer=True)


def test_a_pipeline_names_the_deepspeed_key_of_the_stage(tmp_path):
    (tmp_path / "ds.json").write_text('{"train_batch_size": 64}')
    pipe = tmp_path / "p.toml"
    pipe.write_text('[stages.sft]\nmodel = "tiny"\nbatch_size = 8\ndeepspeed = "ds.json"\n')
    (msg,) = [pr.format("p.toml") for pr in P.parse(pipe)[1]]
    assert msg.startswith(f"p.toml:4: stages.sft.deepspeed: {tmp_path / 'ds.json'}: train_batch_size: align sets "
                          "the batch layout"), msg


# ------------------------------------------------------------------------------------------------ messages


def test_messages_print_the_users_text_as_written(monkeypatch, capsys, tmp_path):
    msg = refused(monkeypatch, capsys, tmp_path, "grpo", "--reward", "math:abc")
    assert msg == "--reward math:abc: the weight 'abc' is not a number (NAME:WEIGHT, e.g. math:0.5)."
    msg = refused(monkeypatch, capsys, tmp_path, "grpo", "--reward", "[b]nosuch[/b]:smile:")
    assert msg.startswith("--reward [b]nosuch[/b]:smile:: unknown reward")  # no emoji, no markup eaten
    from align.console import warn

    warn("a [bold]path[/bold] :smile:")
    assert capsys.readouterr().out.strip() == "warning: a [bold]path[/bold] :smile:"


@pytest.mark.parametrize("command", ["run", "validate", "show"])
def test_pipeline_help_keeps_square_brackets(monkeypatch, capsys, command):
    from align.cli import app

    monkeypatch.setenv("COLUMNS", "4000")
    app().main(["pipeline", command, "--help"], prog_name="align", standalone_mode=False)
    shown = re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", capsys.readouterr().out))
    assert "Pipeline TOML file ([pipeline] + [stages.NAME] tables)." in shown
    assert "Override a key of the file: stages.NAME.KEY=VALUE (repeatable)" in shown


def test_set_problems_name_the_set_flag_and_its_paths_are_from_the_current_directory(tmp_path, monkeypatch):
    conf, here = tmp_path / "conf", tmp_path / "cwd"
    conf.mkdir()
    here.mkdir()
    (here / "train.jsonl").write_text((small_data()["arith"]).read_text())
    pipe = conf / "p.toml"
    pipe.write_text('[stages.sft]\nmodel = "tiny"\n')
    monkeypatch.chdir(here)
    msgs = [pr.format("p.toml") for pr in P.parse(pipe, ["stages.nosuch.x=1", "stages.sft.eval_data=nosuch.jsonl"])[1]]
    assert sorted(msgs) == ["--set stages.nosuch.x=1: stages.nosuch: no stage kind: add stage = \"KIND\" (kinds: "
                    f"{', '.join(registry.KINDS)}), or name the table after its kind",
                    "--set stages.sft.eval_data=nosuch.jsonl: stages.sft.eval_data: no such file or directory: "
                    f"nosuch.jsonl (looked for {here / 'nosuch.jsonl'})"]
    p = P.load(pipe, ["stages.sft.data=train.jsonl", "stages.sft.out=o", "pipeline.out=runs2"])
    cfg = P.resolve(p, p.stage("sft"))
    assert (cfg["data"], cfg["out"], p.out) == (str(here / "train.jsonl"), str(here / "o"), here / "runs2")


def test_a_warning_about_prompts_that_do_not_fit_is_printed_once(capsys):
    from align.rollout.evaluation import fitting

    rows, ids = [{"prompt": "a"}, {"prompt": "b"}], [[1] * 3, [1] * 30]
    for _ in range(3):  # e.g. grpo's evaluations at the start, every --eval-every and the end
        assert fitting(rows, ids, 32, 8) == ([rows[0]], [ids[0]])
    assert capsys.readouterr().out.count("1 of 2 prompts leave no room for 8 new tokens") == 1


def test_tokenising_what_align_cuts_raises_no_length_warning(shipped_tokenizer):
    from align import data as D

    tok, key = shipped_tokenizer, "sequence-length-is-longer-than-the-specified-maximum"
    length, tok.model_max_length = tok.model_max_length, 8
    tok.deprecation_warnings.pop(key, None)
    try:
        prompt_ids = D.encode_prompts(tok, ["one two three four five six seven eight nine ten eleven"])
        completion_ids = D.encode_completions(tok, ["one two three four five six seven eight nine ten"])
        assert len(prompt_ids[0]) > 8 and len(completion_ids[0]) > 8
        assert key not in tok.deprecation_warnings  # transformers' "indexing errors" warning was never raised
        tok(["one two three four five six seven eight nine ten eleven"])
        assert key in tok.deprecation_warnings  # (what the check above would have caught)
    finally:
        tok.model_max_length = length
        tok.deprecation_warnings.pop(key, None)
