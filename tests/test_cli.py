"""The `align` CLI: help, light imports, and bad input -> exit 2 with a named cause."""

import json
import re
import subprocess
import sys

import pytest

from stages.sft import SFTConfig
from tests.conftest import ROOT, assert_user_error, output, run_align


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_data")
    lines = (ROOT / "data/arithmetic/train.jsonl").read_text().splitlines()[:8]
    (d / "good.jsonl").write_text("\n".join(lines) + "\n")
    (d / "bad_line.jsonl").write_text("\n".join(lines[:2]) + "\n{'prompt': single quotes}\n")
    (d / "no_completion.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "1"}) + "\n" for i in range(3)))
    (d / "empty.jsonl").write_text("")
    return d


def sft_args(data_dir, out, data="good.jsonl", *extra):
    return ["sft", "--data", data_dir / data, "--eval-data", data_dir / "good.jsonl", "--out", out,
            "--max-steps", 1, "--batch-size", 2, *extra]


# --------------------------------------------------------------------------------------------------- help


def test_help_lists_every_command():
    proc = run_align("--help", timeout=120)
    assert proc.returncode == 0, output(proc)
    for cmd in ("sft", "eval", "model", "data", "rm", "pipeline", "ppo", "dpo", "grpo"):
        assert f" {cmd} " in proc.stdout, cmd
    assert "Traceback" not in output(proc)


def test_the_cli_and_pipelines_import_no_stage_and_no_torch():
    """`align --help` and the pipeline logic read the one command registry; a stage module (and torch with it) is
    imported only when its command runs."""
    code = ("import sys, align.cli, align.registry, align.pipeline, align.pipeline_cli; align.cli.app(); "
            "print(sorted(m for m in ('torch', 'transformers', 'deepspeed', 'datasets', 'stages.sft', 'stages.ppo') "
            "if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_every_commands_help_imports_no_torch():
    """`align grpo --help` (and every other command's) reads the command's light config module: no torch,
    transformers or stage module is imported, so the help prints at once (timing: benchmarks/cold_start.py)."""
    code = ("import contextlib, io, sys\nfrom align import registry\nfrom align.cli import main\n"
            "for cmd in registry.COMMANDS:\n"
            "    sys.argv = ['align', *cmd.words, '--help']\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "        try:\n            main()\n        except SystemExit as e:\n            assert e.code == 0, cmd.words\n"
            "    assert 'Usage: align' in out.getvalue(), cmd.words\n"
            "configs = {c.config_module or c.module for c in registry.COMMANDS}\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'deepspeed', "
            "'datasets') or m.startswith('stages.') and m not in configs))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_grpo_help_lists_its_own_options_first_then_the_groups(capsys, monkeypatch):
    """The options a stage declares itself come first, in a panel of their own, then the shared groups in a fixed
    order: model and data, optimisation, rollout and sampling, tools, hardware, output and run."""
    from align.cli import app

    monkeypatch.setenv("COLUMNS", "200")
    app().main(["grpo", "--help"], prog_name="align", standalone_mode=False)
    shown = capsys.readouterr().out
    titles = re.findall(r"╭─ (.+?) ─", shown)
    assert titles == ["grpo options", "Model and data", "Optimisation", "Rollout and sampling", "Tools", "Hardware",
                      "Output and run"]
    panel = dict(zip(titles, re.split(r"╭─ .+? ─+╮", shown)[1:]))
    flags = {title: re.findall(r"│ (?:-h, )?(--[a-z-]+)", text) for title, text in panel.items()}
    assert flags["grpo options"][:3] == ["--reward", "--reward-model", "--reward-model-weight"]
    assert {"--num-generations", "--advantage", "--loss", "--beta", "--rollout-gpus", "--help"} <= set(flags["grpo options"])
    assert {"--model", "--data", "--eval-data", "--verifier", "--columns"} <= set(flags["Model and data"])
    assert {"--lr", "--warmup-steps", "--schedule", "--max-steps", "--lora-r"} <= set(flags["Optimisation"])
    assert {"--temperature", "--max-new-tokens", "--prompts-per-step"} <= set(flags["Rollout and sampling"])
    assert {"--precision", "--zero-stage", "--nproc", "--nnodes", "--offload-optimizer", "--compile",
            "--deepspeed", "--micro-batch-size"} <= set(flags["Hardware"])
    assert {"--out", "--overwrite", "--resume", "--save-every", "--report-to", "--monitor",
            "--config"} <= set(flags["Output and run"])
    assert "--lr" not in flags["grpo options"] and "--no-compile" in panel["Hardware"]
    eval_titles = re.findall(r"╭─ (.+?) ─", (app().main(["eval", "--help"], prog_name="align", standalone_mode=False),
                                             capsys.readouterr().out)[1])
    assert eval_titles[:2] == ["Arguments", "eval options"] and "--out" in panel["Output and run"]


def test_sft_help_shows_defaults():
    proc = run_align("sft", "--help", timeout=120)
    assert proc.returncode == 0, output(proc)
    default = next(f.default for f in SFTConfig.__dataclass_fields__.values() if f.name == "max_steps")
    assert "--max-steps" in proc.stdout and f"[default: {default}]" in proc.stdout
    assert "--schedule" in proc.stdout and "[default: cosine]" in proc.stdout
    assert "--config" in proc.stdout


# ------------------------------------------------------------------------------------------- bad input


def test_missing_data_file(data_dir, tmp_path):
    proc = run_align(*sft_args(data_dir, tmp_path / "o", "nope.jsonl"))
    assert_user_error(proc, "nope.jsonl", "data file not found")
    assert not (tmp_path / "o").exists()  # failed before anything was written


def test_row_without_completion_column(data_dir, tmp_path):
    proc = run_align(*sft_args(data_dir, tmp_path / "o", "no_completion.jsonl"))
    assert_user_error(proc, "no_completion.jsonl", "no 'completion' column", "--columns")


def test_empty_dataset(data_dir, tmp_path):
    proc = run_align(*sft_args(data_dir, tmp_path / "o", "empty.jsonl"))
    assert_user_error(proc, "empty.jsonl", "the dataset is empty")


def test_unknown_preset_for_sft(data_dir, tmp_path):
    proc = run_align(*sft_args(data_dir, tmp_path / "o"), "--model", "huge")
    assert_user_error(proc, "huge: no such model directory or artifact", "tiny, small")


def test_config_toml_wrong_type(data_dir, tmp_path):
    toml = tmp_path / "sft.toml"
    toml.write_text('batch-size = "32"\n')
    proc = run_align(*sft_args(data_dir, tmp_path / "o"), "--config", toml)
    assert_user_error(proc, "sft.toml", "'batch_size' must be int, got str '32'")


def test_config_toml_invalid_syntax(data_dir, tmp_path):
    toml = tmp_path / "sft.toml"
    toml.write_text('max_steps = 1\nlr = \n')
    proc = run_align(*sft_args(data_dir, tmp_path / "o"), "--config", toml)
    assert_user_error(proc, "sft.toml", "invalid TOML", "line 2")


def test_config_toml_missing(data_dir, tmp_path):
    proc = run_align(*sft_args(data_dir, tmp_path / "o"), "--config", tmp_path / "nope.toml")
    assert_user_error(proc, "nope.toml", "config file not found")


def test_out_not_writable(data_dir, tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("a regular file, so nothing can be created below it (works as root too)")
    proc = run_align(*sft_args(data_dir, blocker / "out"))
    assert_user_error(proc, "file.txt/out", "not writable", "--out")


def test_bad_schedule(data_dir, tmp_path):
    proc = run_align(*sft_args(data_dir, tmp_path / "o"), "--schedule", "cosnie")
    assert_user_error(proc, "--schedule must be one of cosine, linear, constant, got 'cosnie'.")


def test_bad_precision_is_refused_before_out_is_written(data_dir, tmp_path):
    proc = run_align(*sft_args(data_dir, tmp_path / "o"), "--precision", "fp8")
    assert_user_error(proc, "--precision must be one of auto, bf16, bf16-mixed, bf16-pure, fp32, got 'fp8'.")
    assert not (tmp_path / "o").exists()


def test_flag_of_wrong_type_is_a_usage_error(data_dir, tmp_path):
    proc = run_align(*sft_args(data_dir, tmp_path / "o"), "--max-steps", "many")
    out = output(proc)
    assert proc.returncode == 2 and "Traceback" not in out and "--max-steps" in out


# ------------------------------------------------------------------------- nothing written is lost


@pytest.fixture(scope="module")
def artifact_template(tiny_model_dir, tmp_path_factory):
    """A complete artifact written in-process by the real ArtifactWriter (cheaper than a subprocess)."""
    import shutil

    from align.artifacts import ArtifactWriter

    out = tmp_path_factory.mktemp("complete") / "run"
    w = ArtifactWriter(out, "model-init", {"preset": "tiny"}, {})
    model_tmp = w.begin_model()
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, model_tmp / f.name)
    w.log(1, {"loss": 1.0})
    w.complete({"parameters": 1}, extra={"model_kind": "policy"})
    return out


@pytest.fixture()
def complete_artifact(artifact_template, tmp_path):
    """A fresh copy of the complete artifact and a snapshot of every file in it."""
    import shutil

    out = shutil.copytree(artifact_template, tmp_path / "run")
    assert_intact(out, snapshot(out))
    return out, snapshot(out)


def snapshot(out):
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def assert_intact(out, before):
    from align.artifacts import verify_artifact

    assert snapshot(out) == before
    assert verify_artifact(out)["status"] == "complete"


def test_rerun_with_bad_jsonl_line_keeps_existing_artifact(complete_artifact, data_dir):
    out, before = complete_artifact
    proc = run_align(*sft_args(data_dir, out, "bad_line.jsonl"), "--overwrite")  # bad input: nothing is replaced
    assert_user_error(proc, "bad_line.jsonl:3:", "not valid JSON")
    assert_intact(out, before)


def test_rerun_with_unknown_toml_key_keeps_existing_artifact(complete_artifact, data_dir, tmp_path):
    out, before = complete_artifact
    toml = tmp_path / "sft.toml"
    toml.write_text("max_steps = 1\nlearning_rate = 0.1\n")
    proc = run_align(*sft_args(data_dir, out), "--config", toml)
    assert_user_error(proc, "sft.toml", "unknown key 'learning_rate'", "lr")
    assert_intact(out, before)


def test_rerun_with_no_example_fitting_keeps_existing_artifact(complete_artifact, data_dir):
    out, before = complete_artifact
    proc = run_align(*sft_args(data_dir, out), "--max-length", 2, "--overwrite")
    assert_user_error(proc, "no example fits --max-length 2")
    assert_intact(out, before)


# ----------------------------------------------------------------------------------------- data make


def test_data_make_arithmetic_with_held_out(tmp_path):
    out = tmp_path / "arith.jsonl"
    proc = run_align("data", "make", "arithmetic", "--n", 20, "--seed", 1, "--out", out, "--test-n", 10, timeout=120)
    assert proc.returncode == 0, output(proc)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    test = [json.loads(line) for line in (tmp_path / "arith.test.jsonl").read_text().splitlines()]
    assert len(rows) == 20 and len(test) == 10
    for r in rows + test:
        assert {"prompt", "completion", "answer"} <= set(r)
        assert r["completion"].endswith(f"#### {r['answer']}")
    assert len({r["prompt"] for r in rows}) == 20
    assert not {r["prompt"] for r in rows} & {r["prompt"] for r in test}
    # same seed, same rows
    again = tmp_path / "again.jsonl"
    run_align("data", "make", "arithmetic", "--n", 20, "--seed", 1, "--out", again, timeout=120)
    assert again.read_text() == out.read_text()


def test_data_make_bad_levels(tmp_path):
    proc = run_align("data", "make", "arithmetic", "--levels", "1,x", "--out", tmp_path / "a.jsonl", timeout=120)
    assert_user_error(proc, "--levels", "'1,x'")


def test_help_shows_every_option_text_as_written(capsys, monkeypatch):
    """Every option's help of every command appears in its --help as written: a [...] is not eaten as rich markup
    and a :name: is not turned into an emoji (the texts are passed through cli.literal)."""
    from rich.text import Text

    from align import config as C
    from align import registry
    from align.cli import app, literal

    tricky = "a [bold]tag[/bold], a [link] and an emoji code :smile: in a help text"
    assert Text.from_markup(tricky).plain != tricky  # what typer's rich help would show without cli.literal
    assert Text.from_markup(literal(tricky)).plain.replace("\u2060", "") == tricky
    assert literal("plain text") == "plain text"
    monkeypatch.setenv("COLUMNS", "4000")
    for cmd in registry.COMMANDS:
        app().main([*cmd.words, "--help"], prog_name="align", standalone_mode=False)
        shown = re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", capsys.readouterr().out))
        for f in C.fields(cmd.config_class()):
            text = re.sub(r"\s+", " ", f.metadata["help"])
            assert text in shown, (cmd.words, f.name, text)


def test_eval_without_a_terminal_prints_progress_lines(tmp_path):
    proc = run_align("eval", "tiny", "--out", tmp_path / "ev", "--limit", "6", "--k", "1,2", "--max-new-tokens", "4",
                     "--batch-size", "4", timeout=240)
    assert proc.returncode == 0, output(proc)
    assert re.search(r"^eval \d+/18 ", proc.stdout, re.M), proc.stdout  # 6 greedy + 12 sampled generations
    assert json.loads((tmp_path / "ev" / "artifact.json").read_text())["metrics"]["problems"] == 6
