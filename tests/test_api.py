"""The Python API (align.api): each command a function of its options, the same code path as the command line,
returning the artifact."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT, run_align, small_data

TIMED = ("seconds", "_per_s", "time/", "peak_memory")  # wall-clock figures: differ between any two runs


def same_figures(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not any(t in k for t in TIMED)}


def python(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter (a run's process group and seeds are its own), from the repository root."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_import_align_is_light_and_the_functions_are_the_commands():
    r = python("""
        import sys, align
        assert "torch" not in sys.modules, "import align imported torch"
        from align import api
        assert "torch" not in sys.modules, "align.api imported torch"
        names = [n for n in align.API if n not in ("Artifact", "load")]
        assert all(callable(getattr(align, n)) for n in names)
        print(sorted(api.NAMES))
    """)
    assert r.returncode == 0, r.stderr
    assert "'grpo'" in r.stdout and "'rm_train'" in r.stdout and "'data_make'" in r.stdout


def test_bad_options_raise_user_errors_naming_them(tmp_path):
    r = python(f"""
        import align
        from align.errors import UserError
        for kwargs, want in (({{"max_stepz": 3}}, "unknown option 'max_stepz'"), ({{"lr": -1.0}}, "--lr must be >= 0"),
                             ({{"nproc": 2}}, "need the command line")):
            try:
                align.sft(out={str(tmp_path / 'x')!r}, **kwargs)
            except UserError as e:
                assert want in str(e), (want, str(e))
            else:
                raise AssertionError(kwargs)
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
    assert not (tmp_path / "x").exists()  # refused before anything was written


def test_the_api_and_the_command_line_write_the_same_artifact(tmp_path):
    d = small_data()
    options = dict(model="tiny", data=str(d["arith"]), eval_data=str(d["arith_test"]), max_steps=3, batch_size=8,
                   eval_samples=4, max_new_tokens=8, seed=3)
    flags = [x for k, v in options.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    cli = run_align("sft", *flags, "--out", tmp_path / "cli", cwd=ROOT)
    assert cli.returncode == 0, cli.stderr[-2000:]
    api = python(f"""
        import json, align
        a = align.sft(out={str(tmp_path / 'api')!r}, **{options!r})
        print(json.dumps({{"stage": a.stage, "status": a.status, "path": str(a), "model": str(a.model_dir),
                          "metrics": a.metrics}}))
    """)
    assert api.returncode == 0, api.stderr[-2000:]
    got = json.loads(api.stdout.strip().splitlines()[-1])
    assert (got["stage"], got["status"], got["path"]) == ("sft", "complete", str(tmp_path / "api"))
    assert got["model"] == str(tmp_path / "api" / "model")
    want = json.loads((tmp_path / "cli" / "artifact.json").read_text())
    assert "train/loss" in got["metrics"] and "eval/loss" in got["metrics"]
    assert same_figures(got["metrics"]) == same_figures(want["metrics"])
    api_cfg = json.loads((tmp_path / "api" / "artifact.json").read_text())["config"]
    assert {**api_cfg, "out": ""} == {**want["config"], "out": ""}


def test_an_artifact_or_a_path_stands_for_its_folder():
    """`model=` takes the Artifact an earlier call returned (or a Path), as `--model` takes its folder."""
    from pathlib import Path

    from align.api import Artifact, _option_value

    assert _option_value("model", Artifact(ROOT / "runs" / "x", {})) == str(ROOT / "runs" / "x")
    assert _option_value("data", Path("a/b.jsonl")) == "a/b.jsonl"
    assert _option_value("lr", 1e-5) == 1e-5


def test_grpo_takes_python_reward_functions_in_both_forms(tmp_path):
    """reward= a per-sample function, a batched (TRL) one and `(fn, weight)`: the same rewards as the same
    function named from a file on the command line; the spec and the function's source file are recorded."""
    d = small_data()
    reward_py = tmp_path / "rewards.py"
    reward_py.write_text(textwrap.dedent("""
        def parity(prompt, completion, **row):
            return float(len(completion) % 2)

        def parity_batched(prompts, completions, **kwargs):
            return [float(len(c) % 2) for c in completions]
    """))
    options = dict(model="tiny", data=str(d["arith"]), eval_data="", max_steps=2, prompts_per_step=2, num_generations=4,
                   max_new_tokens=6, seed=5, on_alarm="warn")
    flags = [x for k, v in options.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    cli = run_align("grpo", *flags, "--reward", f"{reward_py}:parity:0.5", "--out", tmp_path / "cli", cwd=ROOT)
    assert cli.returncode == 0, cli.stderr[-2000:]
    api = python(f"""
        import json, sys
        sys.path.insert(0, {str(tmp_path)!r})
        import align, rewards
        out = {{}}
        for name, reward in (("per", (rewards.parity, 0.5)), ("batched", [(rewards.parity_batched, 0.5)])):
            a = align.grpo(out={str(tmp_path)!r} + "/" + name, reward=reward, **{options!r})
            out[name] = {{"metrics": a.metrics, "reward": a.config["reward"], "code": a.record["inputs"].get("code")}}
        print(json.dumps(out))
    """, timeout=600)
    assert api.returncode == 0, api.stderr[-3000:]
    got = json.loads(api.stdout.strip().splitlines()[-1])
    want = json.loads((tmp_path / "cli" / "artifact.json").read_text())["metrics"]
    assert "reward" in want or "train/reward" in want or any("reward" in k for k in want)
    assert same_figures(got["per"]["metrics"]) == same_figures(want)
    assert same_figures(got["batched"]["metrics"]) == same_figures(want)
    assert got["per"]["reward"] == ["python:rewards.parity:0.5"]
    assert got["batched"]["reward"] == ["python:rewards.parity_batched:0.5"]
    assert got["per"]["code"] == {str(reward_py): __import__("hashlib").sha256(reward_py.read_bytes()).hexdigest()}


def test_a_python_reward_spec_outside_its_process_says_what_to_do():
    from align.errors import UserError
    from align.rewards import parse_rewards

    try:
        parse_rewards(["python:nowhere.fn"])
    except UserError as e:
        assert "Python API" in str(e) and "file.py:FUNCTION" in str(e)
    else:
        raise AssertionError("python:nowhere.fn was accepted")


def readme_example() -> str:
    """The Python block of the README (the API's example there)."""
    text = (ROOT / "README.md").read_text()
    start = text.index("```python\n") + len("```python\n")
    return text[start:text.index("```", start)]


def test_the_readmes_example_runs_as_written(tmp_path):
    """The README's example as written (its runs/ folders under a temporary directory): both stages complete,
    GRPO starts from the SFT artifact and its line prints the figures it names. (That a call and its command
    write the same artifact: test_the_api_and_the_command_line_write_the_same_artifact.)"""
    code = readme_example()
    assert "align.sft(" in code and "align.grpo(" in code
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    api = json.loads((tmp_path / "runs" / "api-sft" / "artifact.json").read_text())
    grpo = json.loads((tmp_path / "runs" / "api-grpo" / "artifact.json").read_text())
    assert api["status"] == grpo["status"] == "complete" and grpo["inputs"]["model"]["stage"] == "sft"
    assert api["config"]["max_steps"] == 100 and grpo["config"]["max_steps"] == 5
    printed = r.stdout.strip().splitlines()[-1].split()
    assert float(printed[0]) == pytest.approx(api["metrics"]["eval/loss"])
    assert float(printed[1]) == pytest.approx(grpo["metrics"]["reward"]) and printed[2].endswith("api-grpo")
