"""Each TRL dataset format trains, end to end, in the stage family that reads it (2-3 steps of the tiny model),
and a run on the user's own --data reads no held-out file it was not given: no shipped test set in its
artifact's config or inputs, no evaluation of the shipped task in its metrics."""

import json

import pytest

from align.paths import DATA_DIR
from tests.conftest import parity_reward, run_align

FAST = ["--max-steps", "2", "--batch-size", "4", "--eval-every", "0", "--lr", "1e-3", "--warmup-steps", "1",
        "--zero-stage", "0", "--no-final-checkpoint"]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def head(rel: str, n: int = 8) -> list[dict]:
    return [json.loads(line) for line in (DATA_DIR / rel).read_text().splitlines()[:n]]


def formats() -> dict[str, tuple[list[str], list[dict]]]:
    """name: (the stage's command and flags, its rows in that TRL format)."""
    sft, pairs = head("arithmetic/train.jsonl"), head("prefs/train.jsonl")
    return {
        "sft conversational prompt-completion": (["sft"], [{"prompt": user(r["prompt"]),
                                                            "completion": assistant(r["completion"])} for r in sft]),
        "sft conversational language modelling, every assistant turn": (
            ["sft", "--assistant-only-loss", "--eval-split", "0.25"],
            [{"messages": [{"role": "system", "content": "Answer."}, *user(a["prompt"]), *assistant(a["completion"]),
                           *user(b["prompt"]), *assistant(b["completion"])]} for a, b in zip(sft, sft[1:] + sft[:1])]),
        "sft standard language modelling": (["sft"], [{"text": f"{r['prompt']} {r['completion']}"} for r in sft]),
        "dpo conversational preference": (["dpo"], [{"prompt": user(r["prompt"]), "chosen": assistant(r["chosen"]),
                                                     "rejected": assistant(r["rejected"])} for r in pairs]),
        "dpo conversational implicit prompt": (["dpo"], [{"chosen": user(r["prompt"]) + assistant(r["chosen"]),
                                                          "rejected": user(r["prompt"]) + assistant(r["rejected"])}
                                                         for r in pairs]),
        "dpo --loss kto conversational unpaired preference": (
            ["dpo", "--loss", "kto"], [{"prompt": user(r["prompt"]), "completion": assistant(r[k]), "label": k == "chosen"}
                                       for r in pairs for k in ("chosen", "rejected")]),
        "rm standard implicit prompt": (["rm", "train", "--normalize-samples", "4"],
                                        [{"chosen": f"{r['prompt']} {r['chosen']}", "rejected": f"{r['prompt']} "
                                          f"{r['rejected']}"} for r in pairs]),
        "grpo conversational prompt-only": (
            ["grpo", "--prompts-per-step", "2", "--num-generations", "2", "--max-new-tokens", "4",
             "--reward", parity_reward(), "--micro-batch-size", "4"],
            [{"prompt": user(r["prompt"]), "answer": r["answer"]} for r in sft]),
    }


FORMATS = formats()


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_trl_format_trains_and_the_held_out_set_follows_the_data(name, tmp_path, tiny_model_dir):
    cmd, rows = FORMATS[name]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    flags = [f for f in FAST if cmd[0] != "grpo" or f not in ("--batch-size", "4")]
    proc = run_align(*cmd, "--model", tiny_model_dir, "--data", data, "--out", out, *flags)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-3000:]
    art = json.loads((out / "artifact.json").read_text())
    assert art["status"] == "complete" and art["metrics"]["steps"] == 2
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["loss"] == r["loss"] for r in steps if "loss" in r)  # trained: finite losses logged
    # the held-out data follows --data: no shipped file read, no figure of the shipped task
    assert list(art["inputs"]["data"]) == [str(data)]
    assert art["config"]["eval_data"] == "" and art["config"].get("pass_data", "") == ""
    assert not [k for k in art["metrics"] if "pass@" in k], art["metrics"]
    if "--eval-split" in cmd:
        assert "held-out: 25% of --data (--eval-split 0.25), removed from training" in said
        assert art["config"]["eval_split"] == 0.25 and art["metrics"]["eval/loss"] > 0
    else:
        assert "held-out: none (--data is yours: --eval-split 0.05 holds out 5% of it)" in said
        assert not [k for k in art["metrics"] if k.startswith("eval/")], art["metrics"]
