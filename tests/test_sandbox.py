"""Users' tools (--tools FILE.py:fn): their sandbox (a process of its own, no network, memory and time limits)
and their environment: a tool that raises, hangs, allocates without bound, opens a socket or returns garbage ends
its episode, which the stage counts and scores by --on-reward-error; the run goes on."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from align.rollout.episode import Limits, run_episode
from align.tools.sandbox import Sandbox, isolation

TOOLS = Path(__file__).parent / "fixtures" / "user_tools.py"
pytestmark = pytest.mark.skipif(isolation() is None, reason="this machine cannot isolate a process's network")


@pytest.fixture(scope="module")
def box():
    b = Sandbox(str(TOOLS), ["mul", "boom", "hang", "hog", "net", "junk"], timeout=2.0, memory_mb=512)
    yield b
    b.close()


def test_schemas_are_read_from_type_hints_and_docstrings_as_transformers_reads_them(box):
    from transformers.utils import get_json_schema

    from tests.fixtures import user_tools

    assert box.schemas[0] == get_json_schema(user_tools.mul)
    assert box.schemas[0]["function"]["parameters"]["required"] == ["a", "b"]


def test_a_tool_answers_and_each_failure_is_an_answer_not_an_exception(box):
    assert box.call("mul", {"a": 3, "b": 4}) == ("ok", "12")
    assert box.call("boom", {"x": 1}) == ("failed", "error: ValueError: no")
    t = time.time()
    assert box.call("hang", {"x": 1}) == ("failed", "error: timed out after 2 s")
    assert time.time() - t < 5
    assert box.call("mul", {"a": 5, "b": 6}) == ("ok", "30")  # a fresh worker after the kill
    assert box.call("hog", {"n": 64}) == ("failed", "error: out of memory")
    status, text = box.call("net", {"host": "1.1.1.1"})
    assert status == "failed" and "unreachable" in text.lower()
    assert box.call("junk", {"x": 1}) == ("failed", "error: TypeError: returned list, not text or a number")
    assert box.call("mul", {"a": 1})[0] == "failed"  # a missing argument: the function raised
    assert box.call("nope", {})[0] == "error" and box.call("mul", [1, 2])[0] == "error"
    assert box.call("mul", {"a": 2, "b": 2}) == ("ok", "4")


def test_the_tool_files_top_level_runs_only_in_the_sandbox(tmp_path):
    marker = tmp_path / "ran"
    f = tmp_path / "t.py"
    f.write_text(f"import os\nopen({str(marker)!r}, 'w').write(str(os.getpid()))\n\ndef f(x: int) -> int:\n"
                 "    '''Id.\n\n    Args:\n        x: x\n    '''\n    return x\n")
    with Sandbox(str(f), ["f"]) as b:
        assert b.call("f", {"x": 7}) == ("ok", "7")
    import os

    assert marker.read_text() != str(os.getpid())


def test_a_failing_tool_ends_its_episode_and_the_stage_scores_it_by_the_policy(box, shipped_tokenizer):
    from align.rewards import parse_rewards
    from align.tools.functions import FunctionsEnv
    from stages.grpo import rewards_of
    from stages.grpo_config import GRPOConfig

    tok = shipped_tokenizer
    encode = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731

    def episode(*turns):
        it = iter(turns)

        def sampler(contexts, which, offsets, budgets, stops):
            text, why = next(it)
            return [(encode(text), [-0.1] * len(encode(text)), why)]

        return run_episode(sampler, encode, decode, FunctionsEnv(box=box), {}, encode("What is 3 * 4?"), Limits())

    ok = episode(('<tool>{"name": "mul", "arguments": {"a": 3, "b": 4}}</tool>', "stop"), ("12", "eos"))
    assert ok.stop == "done" and ok.tool_calls == 1 and ok.tool_errors == 0 and "<out>12</out>" in decode(ok.ids)
    bad = episode(('<tool>{"name": "hang", "arguments": {"x": 1}}</tool>', "stop"))
    assert bad.stop == "tool_error" and bad.tool_errors == 1 and len(bad.turns) == 1
    garbled = episode(("<tool>mul(3, 4)</tool>", "stop"), ("12", "eos"))  # the policy's mistake: answered
    assert garbled.stop == "done" and garbled.tool_errors == 1 and "<out>error:" in decode(garbled.ids)

    rows = [{"prompt": "What is 3 * 4?", "answer": "12"}] * 2
    completions = [ok.completion(decode), bad.completion(decode)]
    for policy, want in (("skip", None), ("zero", 0.0), ("fail", 0.0)):
        cfg = GRPOConfig(reward=["math"], on_reward_error=policy)
        (r_ok, p_ok), (r_bad, p_bad) = rewards_of(cfg, parse_rewards(["math"]), rows, completions)
        assert r_ok == 1.0 and p_ok["errors"] == 0.0 and r_bad == want and p_bad["errors"] == 1.0


def test_grpo_and_eval_with_a_users_tool_file_end_to_end(tmp_path, tiny_model_dir):
    """SFT on demonstrations calling mul(a, b), GRPO with --tools FILE.py:mul from it, and align eval --tools: each
    completes, the tool file is hashed into the artifact's inputs, and no sandbox process outlives its stage."""
    import json
    import subprocess
    import sys

    from align import tasks
    from tests.conftest import align_env, run_command

    rows = tasks.make_dataset("mul_tool", 64, seed=0, tool_rate=0.5, call="mul")
    tasks.write_jsonl(rows[:48], tmp_path / "train.jsonl")
    tasks.write_jsonl(rows[48:], tmp_path / "test.jsonl")
    spec = f"{TOOLS}:mul"

    def align(*args):
        proc = run_command([sys.executable, "-m", "align", *map(str, args)], align_env(), timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    sft, grpo = tmp_path / "sft", tmp_path / "grpo"
    align("sft", "--model", tiny_model_dir, "--data", tmp_path / "train.jsonl", "--eval-data", tmp_path / "test.jsonl",
          "--tools", spec, "--max-steps", "30", "--batch-size", "16", "--lr", "3e-3", "--eval-every", "30",
          "--max-new-tokens", "24", "--eval-samples", "4", "--out", sft)
    align("grpo", "--model", sft, "--data", tmp_path / "train.jsonl", "--eval-data", tmp_path / "test.jsonl",
          "--tools", spec, "--max-steps", "2", "--prompts-per-step", "4", "--num-generations", "4",
          "--max-new-tokens", "24", "--eval-samples", "4", "--eval-k", "1", "--out", grpo)
    art = json.loads((grpo / "artifact.json").read_text())
    assert any(str(TOOLS) in str(k) or "user_tools.py" in str(k) for k in art["inputs"]["code"]), art["inputs"]
    step = next(json.loads(x) for x in (grpo / "metrics.jsonl").read_text().splitlines() if '"reward"' in x)
    assert "tools/call_frequency" in step and "episodes/stop/tool_error" in step
    align("eval", grpo, "--data", tmp_path / "test.jsonl", "--tools", spec, "--k", "1", "--limit", "4",
          "--max-new-tokens", "24", "--out", tmp_path / "eval")
    left = subprocess.run(["pgrep", "-f", str(TOOLS)], capture_output=True, text=True).stdout.split()
    assert not left, "a sandbox outlived its stage"


ENVS = Path(__file__).parent / "fixtures" / "user_env.py"


def test_a_users_environment_answers_turns_until_done_and_its_failures_end_the_episode(shipped_tokenizer):
    """--env FILE.py:NAME: the environment's object per episode lives in the sandbox; its observations are appended
    as the environment's tokens, its rewards summed; EOS ends a turn, not the episode (the environment says done);
    a reset or step that raises, hangs, returns garbage or a NaN reward ends the episode with stop tool_error."""
    from align import tools

    tok = shipped_tokenizer
    encode = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    eos = tok.eos_token_id

    def answers(*texts):
        it = iter(texts)

        def sampler(contexts, which, offsets, budgets, stops):
            ids = encode(next(it)) + [eos]
            return [(ids, [-0.1] * len(ids), "eos")]

        return sampler

    retry = tools.agent("", 16, 4, 32, timeout=2.0, env=f"{ENVS}:Retry")
    try:
        row = {"prompt": "What is 2 + 3?", "answer": "5"}
        ep = run_episode(answers("4", "6", "5"), encode, decode, retry.make_env(row), row, encode(row["prompt"]),
                         retry.limits)
        assert ep.stop == "done" and len(ep.turns) == 3 and ep.rewards == [0.0, 0.0, 1.0]
        assert decode(ep.ids).count("Wrong, try again:") == 2 and ep.policy_mask.count(0) == 2 * len(encode(" Wrong, try again:"))
        ep = run_episode(answers("1", "2", "3"), encode, decode, retry.make_env(row), row, [1], retry.limits)
        assert ep.stop == "done" and len(ep.turns) == 3 and sum(ep.rewards) == 0.0
    finally:
        retry.close()
    broken = tools.agent("", 16, 4, 32, timeout=2.0, env=f"{ENVS}:Broken")
    try:
        for how, turns in (("reset", 0), ("raise", 1), ("hang", 1), ("garbage", 1), ("nan", 1)):
            row = {"how": how}
            ep = run_episode(answers("x"), encode, decode, broken.make_env(row), row, [1], broken.limits)
            assert ep.stop == "tool_error" and len(ep.turns) == turns, how
        ep = run_episode(answers("x"), encode, decode, broken.make_env({}), {}, [1], broken.limits)
        assert ep.stop == "done" and ep.rewards == [1.0] and decode(ep.ids).startswith("Go:")
    finally:
        broken.close()


def test_grpo_with_a_users_environment_end_to_end(tmp_path, tiny_model_dir):
    """align grpo --env FILE.py:Retry --reward env on the tiny model: episodes of up to 3 turns, the environment's
    reward logged as rewards/env, and the environment file hashed into the artifact's inputs."""
    import json
    import sys

    from align.data import encode_prompts
    from align.models import load_tokenizer, resolve
    from tests.conftest import align_env, eos_prone, run_command, small_data, small_sft

    tok = load_tokenizer(resolve(str(tiny_model_dir)))
    first = json.loads(small_data()["arith"].read_text().splitlines()[0])["prompt"]
    eos_prone(tiny_model_dir, encode_prompts(tok, [first])[0], 5.0, out=tmp_path / "eos")  # turns that end
    proc = run_command([sys.executable, "-m", "align", "grpo", "--model", str(tmp_path / "eos"), "--env", f"{ENVS}:Retry",
                        "--reward", "env", "--max-turns", "3", "--max-steps", "2", "--prompts-per-step", "4",
                        "--num-generations", "4", "--max-new-tokens", "24", "--eval-samples", "4", "--eval-k", "1",
                        *small_sft(), "--out", str(tmp_path / "g")], align_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [json.loads(x) for x in (tmp_path / "g" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in steps if "reward" in r)
    assert "rewards/env" in step and step["num_turns/mean"] > 1  # an untrained model is wrong: it retries
    art = json.loads((tmp_path / "g" / "artifact.json").read_text())
    assert any("user_env.py" in str(k) for k in art["inputs"]["code"]), art["inputs"]
