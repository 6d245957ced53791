"""Nothing a user already has is lost: a complete artifact in --out is replaced only with --overwrite (and another
stage's never silently, the pipeline included), `data make` never writes over an existing file without it, and bad
input is reported (exit 2, one line, no traceback) before anything is touched, even with --overwrite: every file
already there stays byte-identical."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from align.errors import UserError
from tests.conftest import assert_user_error, output, run_align, small_data


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file below `root` (hidden ones too), by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def write_artifact(out: Path, stage: str, model_dir: Path | None, files: dict[str, str] | None = None) -> Path:
    """A complete artifact of `stage`, written in-process by the real ArtifactWriter (cheaper than a run)."""
    from align.artifacts import ArtifactWriter

    w = ArtifactWriter(out, stage, {"seed": 0}, {})
    if model_dir is not None:
        model_tmp = w.begin_model()
        for f in model_dir.iterdir():
            shutil.copy(f, model_tmp)
    for name, text in (files or {}).items():
        (out / name).write_text(text)
    w.log(1, {"loss": 1.0})
    w.complete({"loss": 1.0}, extra={"model_kind": "policy"})
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("no_loss")
    (d / "completion_int.jsonl").write_text('{"prompt": "1 + 1 =", "completion": 12}\n')
    (d / "latin1.jsonl").write_bytes('{"prompt": "caf\u00e9", "completion": "b"}\n'.encode("latin-1"))
    (d / "long_prompts.jsonl").write_text(json.dumps({"prompt": " + ".join(["1"] * 400), "answer": "400"}) + "\n")
    for name, damage in (("truncated", lambda b: b[: len(b) // 2]), ("garbage", lambda b: b"\x07" * 5000)):
        shutil.copytree(tiny_model_dir, d / name)
        weights = d / name / "model.safetensors"
        weights.write_bytes(damage(weights.read_bytes()))
    write_artifact(d / "sft", "sft", tiny_model_dir)
    return d


@pytest.fixture()
def victim(inputs, tmp_path) -> Path:
    """A fresh copy of a complete sft artifact (it verifies: status complete, model hashes match)."""
    return shutil.copytree(inputs / "sft", tmp_path / "victim")


SFT = ["sft", "--data", str(small_data()["arith"]), "--eval-data", str(small_data()["arith_test"]), "--max-steps",
       "1", "--batch-size", "8", "--eval-samples", "2", "--max-new-tokens", "4"]
GRPO = ["grpo", "--data", str(small_data()["arith"]), "--eval-data", str(small_data()["arith_test"]),
        "--max-steps", "1", "--prompts-per-step", "2", "--num-generations", "2"]

# bad input that used to surface only after --out was opened (the artifact became "failed") or as a traceback
LATE = {
    "micro batch": ([*SFT, "--micro-batch-size", "3"], ["--batch-size 8 is not a multiple of micro batch 3"]),
    "lora targets": ([*SFT, "--lora-r", "4", "--lora-targets", "foo_proj"], ["'foo_proj'", "no module", "q_proj"]),
    "truncated weights": ([*SFT, "--model", "@truncated"], ["model.safetensors", "not a readable safetensors"]),
    "garbage weights": ([*SFT, "--model", "@garbage"], ["model.safetensors", "not a readable safetensors"]),
    "completion of another type": ([*SFT, "--data", "@completion_int.jsonl"],
                                   ["completion_int.jsonl: row 1", "'completion' must be a string or a list of {role, content} "
                                    "messages (the assistant's), not int 12"]),
    "not UTF-8": ([*SFT, "--data", "@latin1.jsonl"], ["latin1.jsonl:1: not UTF-8", "0xe9"]),
    "pass-data prompts too long": (["dpo", "--data", str(small_data()["prefs"]), "--eval-data", "", "--max-steps",
                                    "1", "--batch-size", "4", "--pass-data", "@long_prompts.jsonl"],
                                   ["long_prompts.jsonl: no prompt fits the model's context"]),
    "eval batch size 0": (["eval", "@model", "--data", str(small_data()["arith_test"]), "--batch-size", "0"],
                          ["--batch-size must be >= 1, got 0"]),
    "grpo max-new-tokens 0": ([*GRPO, "--max-new-tokens", "0"], ["--max-new-tokens must be >= 1, got 0"]),
    "grpo max-new-tokens -5": ([*GRPO, "--max-new-tokens", "-5"], ["--max-new-tokens must be >= 1, got -5"]),
    "seed out of range": ([*SFT, "--seed", "99999999999999999999"], ["--seed must be >= 0 and <= 4294967295"]),
}


@pytest.mark.parametrize("case", LATE)
def test_bad_input_is_one_line_and_leaves_a_complete_artifact_byte_identical(case, inputs, victim, tiny_model_dir):
    """Even with --overwrite (the run may replace the artifact), bad input is found before --out is touched."""
    args, needles = LATE[case]
    paths = {"model": tiny_model_dir, **{p.name: p for p in inputs.iterdir()}}
    args = [str(paths[a[1:]]) if a.startswith("@") else a for a in args]  # "@NAME": a file of the fixtures
    if "--model" not in args and args[0] != "eval":
        args += ["--model", str(tiny_model_dir)]
    before = snapshot(victim)
    said = assert_user_error(run_align(*args, "--out", victim, "--overwrite"), *needles)
    assert len([line for line in said.splitlines() if "error:" in line]) == 1, said
    assert snapshot(victim) == before


def test_a_complete_artifact_is_replaced_only_with_overwrite(victim, tiny_model_dir):
    before = snapshot(victim)
    said = assert_user_error(run_align(*SFT, "--model", tiny_model_dir, "--out", victim),
                             "holds a complete sft artifact", "--overwrite", "--resume")
    assert snapshot(victim) == before, said
    # another stage's artifact: never replaced without --overwrite, and --resume does not continue it
    assert_user_error(run_align("model", "init", "--out", victim), "holds a complete sft artifact",
                      "model-init run would replace", "--overwrite")
    assert_user_error(run_align(*GRPO, "--model", tiny_model_dir, "--resume", "--out", victim),
                      "holds a complete sft artifact", "--resume continues a grpo run")
    assert snapshot(victim) == before


def test_overwrite_replaces_an_artifact_with_a_complete_one_of_its_stage(victim):
    from align.artifacts import verify_artifact
    from stages.model_init import ModelInitConfig, run

    run(ModelInitConfig(out=str(victim), overwrite=True))
    art = verify_artifact(victim)
    assert art["stage"] == "model-init" and art["metrics"]["parameters"] > 0


def test_out_rules(tmp_path):
    """The table outdir.check applies: what a run may do with the artifact already in --out."""
    from align.engine import outdir
    from stages.grpo import GRPOConfig

    def check(out, **flags):
        outdir.check(GRPOConfig(out=str(out), **flags), "grpo")

    def refused(out, needle, **flags):
        with pytest.raises(UserError, match=needle):
            check(out, **flags)

    grpo = write_artifact(tmp_path / "grpo", "grpo", None)
    refused(grpo, "complete grpo artifact")
    check(grpo, overwrite=True)
    check(grpo, resume=True)  # continues it (its checkpoint is checked when the run opens --out)
    dpo = write_artifact(tmp_path / "dpo", "dpo", None)
    refused(dpo, "complete dpo artifact, which this grpo run would replace")
    refused(dpo, "--resume continues a grpo run", resume=True)
    check(dpo, overwrite=True)
    for stage, ok in (("grpo", True), ("dpo", False)):  # a failed run: its own stage reruns it, another's not
        failed = tmp_path / f"failed-{stage}"
        failed.mkdir()
        (failed / "artifact.json").write_text(json.dumps({"stage": stage, "status": "failed"}))
        check(failed) if ok else refused(failed, "a failed dpo artifact")
    # an unfinished run of the stage with a checkpoint: starting over would delete it, so it takes a flag
    interrupted = tmp_path / "interrupted"
    (interrupted / "checkpoints" / "step3").mkdir(parents=True)
    (interrupted / "checkpoints" / "step3" / "state.json").write_text("{}")
    (interrupted / "checkpoints" / "latest").write_text("step3\n")
    (interrupted / "artifact.json").write_text(json.dumps({"stage": "grpo", "status": "failed",
                                                           "reason": "interrupted (SIGINT) at step 3"}))
    refused(interrupted, r"holds a failed grpo run \(interrupted \(SIGINT\) at step 3\) with its checkpoint at step 3\. "
                         r"--resume continues it from there; --overwrite starts over and deletes the checkpoint")
    check(interrupted, resume=True)
    check(interrupted, overwrite=True)
    (interrupted / "checkpoints" / "step3" / "state.json").unlink()  # a partial save only: nothing to lose
    check(interrupted)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "artifact.json").write_text("{not json")
    refused(damaged, "--overwrite")
    check(damaged, overwrite=True)
    check(tmp_path / "new")


def test_rm_score_refuses_its_complete_artifact_and_replaces_it_with_overwrite(tmp_path, tiny_reward_model_dir):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "response": str(i + 1)}) + "\n" for i in range(3)))
    out = write_artifact(tmp_path / "scores", "rm-score", None, {"scores.jsonl": '{"mine": 1}\n'})
    before = snapshot(out)
    args = ["rm", "score", "--model", tiny_reward_model_dir, "--data", rows, "--out", out]
    assert_user_error(run_align(*args), "holds a complete rm-score artifact", "--overwrite")
    assert snapshot(out) == before
    proc = run_align(*args, "--overwrite")
    assert proc.returncode == 0, output(proc)
    assert len((out / "scores.jsonl").read_text().splitlines()) == 3


def test_data_make_never_writes_over_an_existing_file_without_overwrite(tmp_path):
    from stages.data_make import DataMakeConfig, run

    mine = tmp_path / "mine.jsonl"
    mine.write_text("my own rows\n")
    assert_user_error(run_align("data", "make", "sort", "--n", 5, "--out", mine, timeout=120),
                      "mine.jsonl: the file exists", "--overwrite")
    assert mine.read_text() == "my own rows\n"
    with pytest.raises(UserError, match="--test-out .*mine.jsonl: the file exists"):
        run(DataMakeConfig(task="sort", n=5, out=str(tmp_path / "new.jsonl"), test_n=2, test_out=str(mine)))
    assert mine.read_text() == "my own rows\n" and not (tmp_path / "new.jsonl").exists()
    run(DataMakeConfig(task="sort", n=5, out=str(mine), overwrite=True))
    assert len(mine.read_text().splitlines()) == 5


def test_a_path_that_is_neither_a_directory_nor_a_reachable_hub_model(tmp_path):
    said = assert_user_error(run_align("eval", "models/doesnotexist", "--out", tmp_path / "e",
                                       env={"HF_HUB_OFFLINE": "1"}, cwd=tmp_path),
                             "models/doesnotexist: no such local directory", "Hugging Face cache", "--model DIR")
    assert not (tmp_path / "e").exists(), said


def test_a_pipeline_reruns_its_own_stale_stage_but_never_replaces_another_stages_artifact(tmp_path):
    from align import pipeline as P

    f = tmp_path / "p.toml"
    f.write_text(f'[pipeline]\nout = "{tmp_path / "runs"}"\n\n[stages.base]\nstage = "model-init"\n')
    other = write_artifact(tmp_path / "runs" / "base", "sft", None)
    before = snapshot(other)
    with pytest.raises(UserError, match="stage 'base' \\(model-init\\): its out .* holds a complete sft artifact"):
        P.run(f)
    assert snapshot(other) == before
    # the stage's own config does not change with how the pipeline runs it: no rerun after an upgrade
    p = P.load(f)
    cfg = P.resolve(p, p.stages[0])
    assert P.fingerprint(p, p.stages[0], {**cfg, "overwrite": True}) == P.fingerprint(p, p.stages[0], cfg)



def test_a_models_files_are_checked_when_it_is_resolved(tmp_path, tiny_model_dir):
    """config.json and the tokenizer's fit to the embedding, before any stage opens its --out."""
    from align.models import load_tokenizer, resolve

    small = shutil.copytree(tiny_model_dir, tmp_path / "small_vocab")
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    with pytest.raises(UserError, match="the tokenizer has 512 tokens but the model's vocabulary is 100"):
        load_tokenizer(resolve(str(small)))
    (small / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="config.json: not a JSON model config"):
        resolve(str(small))
