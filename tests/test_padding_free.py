"""--packing in the RL and preference stages (padding-free forwards: align.logprobs.packing) end to end: DPO and
GRPO on ragged data — short and long prompts and answers, so that several sequences share a packed row — log the
same metrics and save the same weights as the padded runs (the log-probs' equality itself: tests/test_logprobs.py)."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import _DIST_ENV, AlignProcess, assert_same_training, parity_reward

SHORT, LONG = "2 + 3 =", "Ivan starts the day with 79 coins. He picks up 23 more at the market, then 20 more. " * 3


def ragged(path, n: int, kind: str):
    """Rows whose token counts differ several-fold: every other prompt short, every third answer long."""
    rows = []
    for i in range(n):
        prompt = (SHORT if i % 2 else LONG) + f" ({i})"
        if kind == "prefs":
            rows.append({"prompt": prompt, "chosen": "5" if i % 3 else "The answer is 5. " * 6, "rejected": "4",
                         "answer": "5"})
        else:
            rows.append({"prompt": prompt, "answer": "5"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(args, out):
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    proc = AlignProcess([*args, "--out", out], env, stderr_to_stdout=True)
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, text[-3000:]


@pytest.mark.parametrize("stage", ["dpo", "grpo"])
def test_packed_runs_equal_the_padded_ones(stage, tiny_model_dir, tmp_path):
    if stage == "dpo":
        data = ragged(tmp_path / "prefs.jsonl", 32, "prefs")
        args = ["dpo", "--model", tiny_model_dir, "--data", data, "--eval-data", "", "--pass-data", "",
                "--batch-size", "8", "--max-steps", "2", "--lr", "1e-3"]
    else:
        data = ragged(tmp_path / "prompts.jsonl", 16, "prompts")
        args = ["grpo", "--model", tiny_model_dir, "--data", data, "--eval-data", "", "--prompts-per-step", "4",
                "--num-generations", "4", "--max-new-tokens", "8", "--max-steps", "2", "--lr", "1e-3", "--beta", "0.1",
                "--num-iterations", "2", "--micro-batch-size", "8", "--reward", parity_reward()]
    run(args, tmp_path / "padded")
    run([*args, "--packing"], tmp_path / "packed")
    assert_same_training(tmp_path / "padded", tmp_path / "packed", tiny_model_dir, rel=1e-5, weights_rel=1e-4,
                         ignore=("pairs_per_s",))
