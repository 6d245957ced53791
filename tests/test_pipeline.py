"""`align pipeline`: validation reports every problem with key path and line; skip/rerun with real stages."""

import json
import os
import signal
import sys
import tomllib
from pathlib import Path

import pytest

from align import pipeline as P
from align.errors import UserError
from tests.conftest import run_command

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "COLUMNS": "200"}  # rich wraps long error lines at the terminal width


def write(tmp_path: Path, text: str, name: str = "p.toml") -> Path:
    f = tmp_path / name
    f.write_text(text)
    return f


def problems(path: Path) -> list[str]:
    p, probs = P.parse(path)
    assert p is None and probs
    return [pr.format(path.name) for pr in probs]


def align_cli(*args, cwd):
    return run_command([sys.executable, "-m", "align", *map(str, args)], ENV, 300, cwd)  # forked: conftest.AlignProcess


# ------------------------------------------------------------------------------------------ validation

BAD = """\
[pipeline]
out = "runs/x"

[stages.base]
stage = "model-init"
preset = "tiny"

[stages.sft]
model = "@base"
data = "missing/train.jsonl"
max_step = 10
batch_size = "32"
eval_data = "@eval"

[stages.eval]
model = "@bsae"
k = "1"

[stages.rl]
stage = "grpoo"
"""


def test_validate_cli_reports_every_problem_with_key_and_line(tmp_path):
    f = write(tmp_path, BAD, "pipelines.toml")
    r = align_cli("pipeline", "validate", f.name, cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "Traceback" not in out
    assert "6 problems" in out
    for line in (
        "pipelines.toml:10: stages.sft.data: no such file or directory: missing/train.jsonl",
        "pipelines.toml:11: stages.sft.max_step: unknown key (did you mean max_steps?)",
        "pipelines.toml:12: stages.sft.batch_size: 'batch_size' must be int, got str '32'",
        "pipelines.toml:13: stages.sft.eval_data: @eval: stage 'eval' comes later in the file",
        "pipelines.toml:16: stages.eval.model: @bsae: no stage named 'bsae' (did you mean @base?)",
        "pipelines.toml:20: stages.rl.stage: unknown stage kind 'grpoo'",
    ):
        assert line in out, f"{line!r} not in:\n{out}"


def test_load_raises_one_user_error_listing_all_problems(tmp_path):
    f = write(tmp_path, BAD)
    with pytest.raises(UserError) as e:
        P.load(f)
    msg = str(e.value)
    assert msg.count("\n") == 6 and "6 problems" in msg.splitlines()[0]
    assert "stages.sft.max_step" in msg and "stages.rl.stage" in msg


def test_toml_syntax_error_has_line(tmp_path):
    f = write(tmp_path, '[stages.base]\nstage = "model-init"\npreset = \n')
    (msg,) = problems(f)
    assert msg.startswith("p.toml:3: invalid TOML:"), msg


def test_unknown_tables_keys_and_empty_pipeline(tmp_path):
    f = write(tmp_path, '[pipeline]\nout = "r"\nnprocs = 2\n\n[stagse.base]\npreset = "tiny"\n')
    msgs = problems(f)
    assert any(m.startswith("p.toml:3: pipeline.nprocs: unknown key (did you mean nproc?)") for m in msgs), msgs
    assert any(m.startswith("p.toml:5: stagse: unknown top-level table") for m in msgs), msgs
    assert any("empty pipeline" in m for m in msgs), msgs
    f = write(tmp_path, "[pipeline]\nnproc = 0\n\n[stages.model]\npreset = 1\n", "q.toml")
    msgs = problems(f)
    assert any(m.startswith("q.toml:2: pipeline.nproc: 'nproc' must be >= 1, got 0") for m in msgs), msgs
    assert any(m.startswith("q.toml:4: stages.model: no stage kind") for m in msgs), msgs


def test_more_checks(tmp_path):
    f = write(tmp_path, """\
[stages]
base = { stage = "model-init", seed = "x" }

[stages.sft]
model = "@sft"
schedule = "cosin"
columns = "@base"

[stages.eval]
model = "@base"
k = "a,b"
out = "runs/p/base"
""")
    msgs = problems(f)
    expect = [
        "p.toml:2: stages.base.seed: 'seed' must be int, got str 'x'",  # inline table: its line
        "p.toml:5: stages.sft.model: @sft: a stage cannot use its own output",
        "p.toml:7: stages.sft.columns: @base: a @stage reference only fits a path-valued key",
        "p.toml:11: stages.eval.k: --k must be comma-separated integers",  # the stage's own validate()
    ]
    for e in expect:
        assert any(m.startswith(e) for m in msgs), (e, msgs)
    # once base is valid, eval's out collides with base's default out
    f.write_text(f.read_text().replace('seed = "x"', "seed = 1").replace('k = "a,b"', 'k = "1"'))
    assert any("p.toml:12: stages.eval.out: writes to" in m and "like stage 'base'" in m for m in problems(f))


def test_valid_pipeline_resolves_refs_paths_presets_and_defaults(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.jsonl").write_text('{"prompt": "1 + 1 =", "completion": " 2"}\n')
    f = write(tmp_path, """\
[pipeline]
out = "runs/x"
nproc = 2
seed = 7

[stages.base]
stage = "model-init"

[stages.sft]
model = "tiny"            # a preset, not a file
data = "d/train.jsonl"
eval-data = ""
max-steps = 3
lr = 1                    # an int is fine for a float

[stages.eval]
model = "@sft"
data = "d/train.jsonl"
out = "elsewhere/eval"    # outputs need not exist
nproc = 1
seed = 3
""")
    p = P.load(f)
    assert p.names() == ["base", "sft", "eval"]
    assert [s.kind for s in p.stages] == ["model-init", "sft", "eval"]
    base, sft, ev = (P.resolve(p, s) for s in p.stages)
    assert "nproc" not in base and base["out"] == str(tmp_path / "runs/x/base")
    assert sft["model"] == "tiny" and sft["data"] == str(tmp_path / "d/train.jsonl") and sft["eval_data"] == ""
    assert sft["max_steps"] == 3 and sft["lr"] == 1.0 and isinstance(sft["lr"], float) and sft["nproc"] == 2
    assert ev["model"] == str(tmp_path / "runs/x/sft") and ev["out"] == str(tmp_path / "elsewhere/eval")
    assert ev["nproc"] == 1
    assert sft["seed"] == 7 and ev["seed"] == 3  # [pipeline] seed: every stage's default; a stage may override
    reseeded = P.load(f, ["pipeline.seed=9"])  # `pipeline run --seed 9`
    assert P.resolve(reseeded, reseeded.stage("sft"))["seed"] == 9 and P.resolve(reseeded, reseeded.stage("eval"))["seed"] == 3
    assert p.stage("eval").refs == {"model": "sft"}
    assert P.command(p.stage("base"), Path("x.toml"))[-4:] == ["model", "init", "--config", "x.toml"]
    with pytest.raises(UserError, match="stages: base, sft, eval"):
        P.plan(p, from_stage="sfft")


def test_stage_toml_round_trips(tmp_path):
    cfg = {"a": 'quote " back \\ slash\nnewline ünï', "b": 3, "c": 1e-05, "d": 2.0, "e": True, "f": float("inf"),
           "g": "", "h": -0.5}
    f = tmp_path / "s.toml"
    P.write_stage_toml(f, cfg, "comment")
    assert tomllib.loads(f.read_text()) == cfg
    assert not list(tmp_path.glob("*.tmp*"))


def test_fingerprint_follows_config_and_input_content(tmp_path):
    data = tmp_path / "t.jsonl"
    data.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    f = write(tmp_path, '[stages.eval]\nmodel = "tiny"\ndata = "t.jsonl"\n')
    p = P.load(f)
    fp = P.fingerprint(p, p.stages[0])
    assert fp == P.fingerprint(P.load(f), P.load(f).stages[0])  # deterministic
    data.write_text('{"prompt": "1 + 2 =", "answer": "3"}\n')
    fp2 = P.fingerprint(p, p.stages[0])
    assert fp2 != fp
    f.write_text('[stages.eval]\nmodel = "tiny"\ndata = "t.jsonl"\nlimit = 5\n')
    assert P.fingerprint(P.load(f), P.load(f).stages[0]) != fp2
    assert P.plan(P.load(f))[0].state.status == "missing"


def test_your_python_files_are_read_from_the_pipelines_folder_and_hashed(tmp_path):
    """A relative reward or environment file (path/to/file.py:NAME) is read from the pipeline file's folder, as data
    paths are (not from where `align pipeline run` was started); a change to it makes the stage stale."""
    (tmp_path / "t.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    (tmp_path / "envs").mkdir()
    env = tmp_path / "envs" / "e.py"
    env.write_text("class E:\n    def reset(self, row):\n        return None\n")
    (tmp_path / "r.py").write_text("def r(prompt, completion, **row):\n    return 1.0\n")
    f = write(tmp_path, '[stages.grpo]\nmodel = "tiny"\ndata = "t.jsonl"\neval-data = ""\nenv = "envs/e.py:E"\n'
                        'reward = ["env", "r.py:r:0.5", "math"]\n')
    p = P.load(f)
    cfg = P.resolve(p, p.stages[0])
    assert cfg["env"] == f"{tmp_path / 'envs/e.py'}:E"
    assert cfg["reward"] == ["env", f"{tmp_path / 'r.py'}:r:0.5", "math"]
    fp = P.fingerprint(p, p.stages[0])
    env.write_text("class E:\n    def reset(self, row):\n        return 'go'\n")
    assert P.fingerprint(P.load(f), P.load(f).stages[0]) != fp


# ----------------------------------------------------------------------------- real stages (subprocesses)


def statuses(results):
    return {r.name: r.status for r in results}


def tamper(out: Path):
    weights = next((out / "model").glob("*.safetensors"))
    with open(weights, "ab") as fh:
        fh.write(b"\0")


def test_model_init_stages_skip_rerun_and_tamper(tmp_path):
    """Two independent model-init stages (each subprocess pays the torch import: ~5-15 s)."""
    f = write(tmp_path, """\
[pipeline]
out = "runs"

[stages.base]
stage = "model-init"

[stages.twin]
stage = "model-init"
seed = 1
""")
    # a CPU torch: the stages are forked from one server that imported torch & co. once (the CLI run below too)
    assert P.stage_processes(P.load(f).stages) is not None
    ran = P.run(f)
    assert statuses(ran) == {"base": "ran", "twin": "ran"}
    assert ran[0].metrics.get("parameters", 0) > 0 and ran[0].seconds > 0
    for name in ("base", "twin"):
        out = tmp_path / "runs" / name
        assert (out / P.FINGERPRINT_FILE).is_file()
        assert tomllib.loads((out / P.STAGE_TOML).read_text())["out"] == str(out)
    assert statuses(P.run(f)) == {"base": "skipped (up to date)", "twin": "skipped (up to date)"}

    # tampered weights: the artifact no longer verifies, so that stage (only) reruns
    tamper(tmp_path / "runs/base")
    state = P.plan(P.load(f))[0].state
    assert state.status == "incomplete" and "changed" in state.detail
    assert statuses(P.run(f)) == {"base": "ran", "twin": "skipped (up to date)"}

    # a changed key makes only its stage stale
    f.write_text(f.read_text().replace("seed = 1", "seed = 2"))
    plans = P.plan(P.load(f))
    assert [(pl.run, pl.state.status) for pl in plans] == [(False, "complete"), (True, "stale")]

    # --from forces that stage and every later one (dry run: nothing executes)
    assert statuses(P.run(f, from_stage="base", dry_run=True)) == {"base": "would run", "twin": "would run"}
    assert statuses(P.run(f, from_stage="twin", dry_run=True)) == {"base": "skipped (up to date)", "twin": "would run"}
    r = align_cli("pipeline", "show", f, cwd=tmp_path)
    assert r.returncode == 0 and "complete (up to date)" in r.stdout and "stale (config or inputs changed)" in r.stdout

    # a failing stage stops the pipeline with its exit code and names the stage (CLI: exit code, message); here
    # another live process (this one) holds its out directory's lock
    lock = tmp_path / "runs/twin/.lock"
    lock.write_text(f"{os.getpid()}\n")
    r = align_cli("pipeline", "run", f, cwd=tmp_path)
    lock.unlink()
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "stage 'twin' (model-init) failed with exit code 2" in out, out
    assert f"in use by another align run (PID {os.getpid()})" in out and "Traceback" not in out
    assert not (tmp_path / "runs/twin" / P.FINGERPRINT_FILE).exists()


def test_eval_of_base_skip_and_rerun(tmp_path):
    """model-init -> eval (DeepSpeed, one process). The eval stage reruns when base's artifact changes."""
    rows = (ROOT / "data/arithmetic/test.jsonl").read_text().splitlines()[:2]
    (tmp_path / "test.jsonl").write_text("\n".join(rows) + "\n")
    f = write(tmp_path, """\
[pipeline]
out = "runs"

[stages.base]
stage = "model-init"
preset = "tiny"

[stages.eval]
model = "@base"
data = "test.jsonl"
limit = 2
k = "1"
max_new_tokens = 4
""")
    results = P.run(f)
    P.raise_for_failure(results)  # says which stage failed and why, if one did
    assert statuses(results) == {"base": "ran", "eval": "ran"}
    assert any(k.startswith("pass@") for k in results[1].metrics), results[1].metrics
    assert statuses(P.run(f)) == {"base": "skipped (up to date)", "eval": "skipped (up to date)"}

    # a changed eval key reruns eval only
    f.write_text(f.read_text().replace("max_new_tokens = 4", "max_new_tokens = 3"))
    assert statuses(P.run(f)) == {"base": "skipped (up to date)", "eval": "ran"}

    # an upstream rerun rewrites its artifact.json (timestamps): eval becomes stale, base stays up to date
    art = tmp_path / "runs/base/artifact.json"
    art.write_text(art.read_text().replace('"finished": "', '"finished": "1'))
    plans = P.plan(P.load(f))
    assert [(pl.run, pl.state.status) for pl in plans] == [(False, "complete"), (True, "stale")]

    # tampered base: base reruns, and eval after it; --from base forces both (dry runs: nothing executes)
    tamper(tmp_path / "runs/base")
    plans = P.plan(P.load(f))
    assert [(pl.run, pl.state.status) for pl in plans] == [(True, "incomplete"), (True, "stale")]
    assert statuses(P.run(f, from_stage="base", dry_run=True)) == {"base": "would run", "eval": "would run"}


@pytest.mark.parametrize("name", ["pipelines.toml", "pipelines/arithmetic.toml"])
def test_the_shipped_pipelines_are_valid_and_end_with_grpo_from_dpo(name):
    from align.paths import ROOT
    from tests.conftest import output, run_align

    proc = run_align("pipeline", "validate", str(ROOT / name), env={"COLUMNS": "200"})
    assert proc.returncode == 0, output(proc)
    stages = tomllib.loads((ROOT / name).read_text())["stages"]
    assert list(stages) == ["base", "eval_base", "sft", "eval", "rm", "ppo", "dpo", "grpo"]
    assert stages["ppo"]["model"] == "@sft" and stages["ppo"]["reward_model"] == "@rm"
    assert stages["dpo"]["model"] == "@ppo" and stages["grpo"]["model"] == "@dpo"


def test_the_default_pipeline_runs_on_digit_sort_with_its_verifier():
    """Every stage of the default chain reads data/digit_sort, and the RL stages score with exact match (the
    stages' own defaults, arithmetic data and the math verifier, would grade nothing right here)."""
    from align.paths import ROOT

    stages = tomllib.loads((ROOT / "pipelines.toml").read_text())["stages"]
    paths = [v for s in stages.values() for k, v in s.items() if k in ("data", "eval_data", "pass_data", "ptx_data")]
    assert paths and all(p.startswith("data/digit_sort/") for p in paths)
    assert stages["grpo"]["reward"] == ["exact"] and stages["ppo"]["gold_reward"] == "exact"
    assert stages["ppo"]["ptx_coef"] == 0.0  # ptx on the flawed demonstrations would pull back to the error
    # one right answer: the trained policy's entropy starts under entropy_collapse's floor, which is turned off
    from align.monitor import RLMonitor

    for name in ("ppo", "grpo"):
        rules = tomllib.loads((ROOT / stages[name]["monitor"]).read_text())
        assert rules == {"entropy_collapse": {"enabled": False}}
        RLMonitor(overrides=rules)  # a valid override


def test_set_overrides_keys_from_the_command_line(tmp_path, monkeypatch):
    """`--set stages.NAME.KEY=VALUE`: TOML values, strings otherwise; an existing path is relative to the current
    directory (not the file's); bad items are problems like any other."""
    (tmp_path / "conf").mkdir()
    f = write(tmp_path / "conf", '[pipeline]\nout = "runs"\n\n[stages.sft]\nmodel = "tiny"\nmax_steps = 10\n')
    here = tmp_path / "cwd"
    (here / "my-model").mkdir(parents=True)
    monkeypatch.chdir(here)
    p = P.load(f, ["stages.sft.max_steps=3", "stages.sft.lr=2e-4", "stages.sft.model=my-model",
                   "stages.sft.columns=q=prompt"])
    values = p.stage("sft").values
    assert values["max_steps"] == 3 and values["lr"] == 2e-4 and values["columns"] == "q=prompt"
    assert Path(values["model"]) == here / "my-model"
    assert P.fingerprint(p, p.stage("sft")) != P.fingerprint(P.load(f), P.load(f).stage("sft"))
    with pytest.raises(UserError) as e:
        P.load(f, ["stages.sft.max_steps=many", "nokey"])
    assert "--set stages.sft.max_steps=many: stages.sft.max_steps: 'max_steps' must be int" in str(e.value)
    assert "--set nokey: write KEY.PATH=VALUE" in str(e.value)
    assert f"{f}:6:" not in str(e.value)  # not blamed on the file's line


# ------------------------------------------------------------------ Ctrl-C, and changed budgets on resume


def sft_pipeline(tmp_path: Path, max_steps: int, schedule: str) -> tuple[Path, Path]:
    from tests.conftest import small_data

    f = write(tmp_path, f'[pipeline]\nout = "{tmp_path / "runs"}"\n\n[stages.sft]\nmodel = "tiny"\n'
                        f'max_steps = {max_steps}\nschedule = "{schedule}"\nwarmup_steps = 1\nbatch_size = 8\n'
                        'eval_every = 0\neval_samples = 0\n'
                        f'data = "{small_data()["arith"]}"\n')
    return f, tmp_path / "runs" / "sft"


def one_line(proc) -> str:
    return " ".join((proc.stdout + proc.stderr).split())


def test_ctrl_c_prints_the_summary_and_the_rerun_command_and_a_changed_budget_is_one_rule(tmp_path):
    """Ctrl-C (SIGINT to the foreground process group, as a terminal sends it) during a stage: the stage finishes
    its step, checkpoints and marks its artifact failed; the pipeline prints its table (the interrupted stage and
    the stages not run) and the exact command that continues it, and exits 130. Rerun with another max_steps of
    its cosine schedule, the stage is refused (exit 2) with the two ways on, as `--resume` refuses it by hand; the
    printed command continues it from its checkpoint."""
    from tests.test_reliability import popen, wait_for_steps

    f, out = sft_pipeline(tmp_path, 100, "cosine")
    f.write_text(f.read_text() + '\n[stages.again]\nstage = "eval"\nmodel = "@sft"\nlimit = 2\nk = "1"\n')
    proc = popen("pipeline", "run", f, "--set", "stages.sft.lr=1e-3", start_new_session=True, cwd=tmp_path)
    wait_for_steps(proc, out, 2)
    os.killpg(proc.pid, signal.SIGINT)
    said = " ".join(proc.communicate(timeout=120)[0].split())
    assert proc.returncode == 130 and "Traceback" not in said, said[-3000:]
    art = json.loads((out / "artifact.json").read_text())
    step = int(art["reason"].split(" at step ")[1].split(";")[0])
    assert art["status"] == "failed" and art["reason"].startswith("interrupted (SIGINT) at step ")
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step{step}"
    assert f"interrupted (failed artifact, checkpoint step{step}: the rerun continues from it)" in said
    assert "again │ not run" in said
    rerun = f"align pipeline run {f} --set stages.sft.lr=1e-3"
    assert rerun in said

    refused = align_cli("pipeline", "run", f, "--set", "stages.sft.lr=1e-3", "--set", "stages.sft.max_steps=300",
                        cwd=tmp_path)
    msg = one_line(refused)
    assert refused.returncode == 2 and "Traceback" not in msg, msg[-3000:]
    assert "stage 'sft': max_steps 100 -> 300: the checkpoint is at step" in msg and "cosine" in msg
    assert "Set stages.sft.max_steps back to 100 to continue" in msg and "--from sft to start it over" in msg
    assert json.loads((out / "artifact.json").read_text()) == art  # nothing touched

    again = align_cli(*rerun.split()[1:], cwd=tmp_path)
    said = one_line(again)
    assert again.returncode == 0 and f"resuming from its step{step} checkpoint" in said, said[-3000:]
    art = json.loads((out / "artifact.json").read_text())
    assert art["status"] == "complete" and art["resumed"] == [{"step": step, "max_steps": 100}]


def test_a_larger_budget_continues_a_complete_constant_schedule_stage(tmp_path):
    """A complete stage whose max_steps alone grew continues from its final checkpoint when its learning rate does
    not depend on the budget (a constant schedule): the run a 4-step budget gives, recorded in artifact.json. A
    smaller budget than the checkpoint's step is refused, as by hand."""
    f, out = sft_pipeline(tmp_path, 2, "constant")
    assert statuses(P.run(f)) == {"sft": "ran"}
    results = P.run(f, overrides=["stages.sft.max_steps=4"])
    assert statuses(results) == {"sft": "ran"} and "resuming from its step2 checkpoint" in results[0].reason
    art = json.loads((out / "artifact.json").read_text())
    assert art["status"] == "complete" and art["metrics"]["steps"] == 4
    assert art["resumed"] == [{"step": 2, "max_steps": 2}]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert statuses(P.run(f, overrides=["stages.sft.max_steps=4"])) == {"sft": "skipped (up to date)"}
    (refused,) = P.run(f, overrides=["stages.sft.max_steps=3"])
    assert refused.status == "refused" and "the checkpoint is at step 4, past the new end" in refused.reason
    with pytest.raises(UserError) as e:
        P.raise_for_failure([refused])
    assert e.value.exit_code == 2


def test_the_summary_shows_results_not_their_errors_or_inputs(tmp_path):
    """The pipeline table's metrics column: the stage's results, most telling first; a standard error or the input
    model's figure (start/...) would crowd out the result (GRPO's row showed only start/ values)."""
    (tmp_path / "artifact.json").write_text(json.dumps({"metrics": {
        "start/pass@1/greedy": 0.5, "start/pass@1/greedy_stderr": 0.03, "eval/pass@1/greedy_stderr": 0.005,
        "wall_seconds": 9.0, "eval/pass@1/greedy": 0.995, "gain/pass@1/greedy": 0.495, "reward/last5": 0.99}}))
    assert P.headline_metrics(tmp_path) == {"eval/pass@1/greedy": 0.995, "gain/pass@1/greedy": 0.495,
                                            "reward/last5": 0.99}


def test_reference_reads_a_stage_and_a_file_inside_it():
    assert P.reference("@grpo") == ("grpo", "")
    assert P.reference("@tasks/test.jsonl") == ("tasks", "test.jsonl")
    assert P.reference("data/digit_sort/train.jsonl") is None
    assert P.reference(3) is None
