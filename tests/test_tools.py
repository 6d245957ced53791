"""Tool use around the RL stages: the calculator's demonstrations cut into the policy's part and the tool's, SFT
on them with the tool's tokens out of the loss (tokenised as an episode holds them), `align data make mul_tool`,
and GRPO / eval with --tools calculator end to end on the tiny model."""

from __future__ import annotations

import json
import sys

import pytest

from align import tasks, tools
from align.data import IGNORE, sft_examples
from align.rollout.episode import Limits, run_episode
from align.tools.calculator import CalculatorEnv
from tests.conftest import assert_user_error, run_command, align_env


def test_a_demonstration_is_cut_into_the_policys_parts_and_the_tools_answers():
    env = CalculatorEnv()
    text = "<calc>12*34</calc><out>408</out>so <calc>408+1</calc><out>409</out>409"
    parts = env.segments(text)
    assert parts == [("<calc>12*34</calc>", True), ("<out>408</out>", False), ("so <calc>408+1</calc>", True),
                     ("<out>409</out>", False), ("409", True)]
    assert "".join(t for t, _ in parts) == text
    assert env.segments("408") == [("408", True)]
    # an <out> the policy wrote without a call before it is the policy's text
    assert env.segments("<out>408</out>408") == [("<out>408</out>408", True)]
    assert env.segments("<calc>1+1</calc> 2") == [("<calc>1+1</calc> 2", True)]  # no answer: all the policy's


def test_sft_labels_leave_the_tools_tokens_out_and_tokenise_as_an_episode_does(shipped_tokenizer):
    """The SFT example of a tool demonstration: the tool's answer carries no label, every policy token does (EOS
    included), and its tokens are those of an episode in which the policy wrote the demonstration's parts."""
    tok = shipped_tokenizer
    row = {"prompt": "What is 616 * 388?", "completion": "<calc>616*388</calc><out>239008</out>239008"}
    (ex,) = sft_examples(tok, [row], 256, tools="calculator")
    encode = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    out = encode("<out>239008</out>")
    prompt = len(ex["input_ids"]) - len(encode("<calc>616*388</calc>")) - len(out) - len(encode("239008")) - 1
    labels = ex["labels"][prompt:]
    call = len(encode("<calc>616*388</calc>"))
    assert labels[call:call + len(out)] == [IGNORE] * len(out)
    assert IGNORE not in labels[:call] and IGNORE not in labels[call + len(out):]
    assert labels[-1] == tok.eos_token_id and ex["n_labels"] == len(labels) - len(out)
    assert all(t == IGNORE for t in ex["labels"][:prompt])

    turns = iter([encode("<calc>616*388</calc>"), encode("239008") + [tok.eos_token_id]])

    def scripted(contexts, which, offsets, budgets, stops):
        ids = next(turns)
        return [(ids, [0.0] * len(ids), "eos" if ids[-1] == tok.eos_token_id else "stop")]

    ep = run_episode(scripted, encode, lambda ids: tok.decode(ids, skip_special_tokens=True), CalculatorEnv(), {},
                     ex["input_ids"][:prompt], Limits())
    assert ep.prompt_ids + ep.ids == ex["input_ids"]
    assert [lab != IGNORE for lab in labels] == [bool(m) for m in ep.policy_mask]
    # without --tools the answer's tokens would be learned too
    (plain,) = sft_examples(tok, [row], 256)
    assert IGNORE not in plain["labels"][prompt:]


def test_mul_tool_rows_hold_right_products_and_call_the_tool_at_the_rate_asked():
    rows = tasks.make_dataset("mul_tool", 2000, seed=3, tool_rate=0.25)
    assert abs(sum(r["tool"] for r in rows) / len(rows) - 0.25) < 0.03
    for r in rows[:200]:
        a, b = (int(x) for x in r["prompt"].removeprefix("What is ").removesuffix("?").split(" * "))
        assert r["answer"] == str(a * b) and 100 <= a <= 9999 and 100 <= b <= 9999
        if r["tool"]:
            assert r["completion"] == f"<calc>{a} * {b}</calc><out>{a * b}</out>{a * b}"
            assert CalculatorEnv().step(tools.segments("calculator", r["completion"])[0][0]).observation == \
                f"<out>{a * b}</out>"
        else:
            assert r["completion"] == r["answer"]
    assert not {r["prompt"] for r in tasks.make_dataset("mul_tool", 300, seed=4, exclude={r["prompt"] for r in rows})} & \
        {r["prompt"] for r in rows}
    with pytest.raises(Exception, match="tool_rate"):
        tasks.make_dataset("mul_tool", 5, seed=0, tool_rate=2)


def test_an_unknown_tool_is_refused_before_anything_runs(tmp_path):
    for stage in ("grpo", "eval", "sft"):
        proc = run_command([sys.executable, "-m", "align", stage, *(["tiny"] if stage == "eval" else ["--model", "tiny"]), "--tools", "abacus", "--out",
                            str(tmp_path / stage)], align_env(), timeout=120)
        assert_user_error(proc, "--tools 'abacus'", "calculator")
        assert not (tmp_path / stage).exists()


@pytest.fixture(scope="module")
def mul_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("mul")
    rows = tasks.make_dataset("mul_tool", 64, seed=0, tool_rate=0.5)
    tasks.write_jsonl(rows[:48], root / "train.jsonl")
    tasks.write_jsonl(rows[48:], root / "test.jsonl")
    return root


def test_grpo_and_eval_with_the_calculator_run_episodes_end_to_end(tmp_path, tiny_model_dir, mul_data):
    """An SFT on tool demonstrations, GRPO with --tools calculator from it, and align eval --tools: each completes,
    GRPO logs the episodes' metrics (calls, failures, turns, stops, the tools' tokens, the share of response tokens
    in the loss), and the held-out samples keep whole transcripts with their tool calls counted."""
    def align(*args):
        proc = run_command([sys.executable, "-m", "align", *map(str, args)], align_env(), timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    sft, grpo, ev = tmp_path / "sft", tmp_path / "grpo", tmp_path / "eval"
    align("sft", "--model", tiny_model_dir, "--data", mul_data / "train.jsonl", "--eval-data", mul_data / "test.jsonl",
          "--tools", "calculator", "--max-steps", "40", "--batch-size", "16", "--lr", "3e-3", "--eval-every", "40",
          "--max-new-tokens", "16", "--out", sft)
    align("grpo", "--model", sft, "--data", mul_data / "train.jsonl", "--eval-data", mul_data / "test.jsonl",
          "--tools", "calculator", "--max-steps", "2", "--prompts-per-step", "4", "--num-generations", "4",
          "--max-new-tokens", "16", "--temperature", "1.5", "--eval-samples", "8", "--eval-k", "1,2", "--out", grpo)
    steps = [json.loads(x) for x in (grpo / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in steps if "reward" in r)
    for key in ("tools/call_frequency", "tools/failure_frequency", "num_turns/mean", "episodes/stop/eos",
                "episodes/stop/max_turns", "episodes/env_tokens", "episodes/policy_token_frac", "time/tools"):
        assert key in step, key
    assert 0 < step["episodes/policy_token_frac"] <= 1
    if step["tools/call_frequency"] > 0:
        assert step["episodes/env_tokens"] > 0 and step["episodes/policy_token_frac"] < 1
    samples = [json.loads(x) for x in (grpo / "eval_samples.jsonl").read_text().splitlines()]
    assert all("greedy_tool_calls" in s and "greedy_stop" in s for s in samples)
    align("eval", grpo, "--data", mul_data / "test.jsonl", "--tools", "calculator", "--k", "1,2",
          "--max-new-tokens", "16", "--out", ev)
    art = json.loads((ev / "artifact.json").read_text())
    assert "tools/call_frequency" in art["metrics"]
    recs = [json.loads(x) for x in (ev / "samples.jsonl").read_text().splitlines()]
    called = [r for r in recs if r["greedy_tool_calls"]]
    for r in called:  # a transcript holds the tool's answer to each call
        assert "<out>" in r["greedy"] and "</calc>" in r["greedy"]


def test_a_turn_stops_at_the_token_that_completes_a_stop_text(shipped_tokenizer):
    from align.rollout.episode import stopped

    tok = shipped_tokenizer
    ids = tok("<calc>12*34</calc>", add_special_tokens=False)["input_ids"]
    assert stopped(tok, ids, ("</calc>",))
    assert not any(stopped(tok, ids[:i], ("</calc>",)) for i in range(1, len(ids)))  # not before the last token
    assert not stopped(tok, ids + tok(" 5", add_special_tokens=False)["input_ids"], ("</calc>",))  # already past it
    assert not stopped(tok, ids, ())


def episode_completion(tok, text_parts, tool_calls=1):
    """A Completion of an episode whose parts are (text, policy?) in order, the last policy part its answer."""
    from align.rollout.completion import Completion, EpisodeInfo

    ids, mask = [], []
    for text, policy in text_parts:
        part = tok(text, add_special_tokens=False)["input_ids"]
        ids += part
        mask += [int(policy)] * len(part)
    final = text_parts[-1][0]
    info = EpisodeInfo(final, sum(p for _, p in text_parts), tool_calls, 0, "eos", mask.count(0), 0.0)
    return Completion([1, 2], ids, "".join(t for t, _ in text_parts), True, [-0.5] * len(ids), mask, info)


def test_a_built_in_verifier_grades_the_last_turn_and_a_users_function_the_transcript(shipped_tokenizer, tmp_path):
    """The tool's answer in the transcript is not the policy's: `math` reads the last turn (wrong here) while a
    user's function sees the whole transcript; lengths and distinct-n count the policy's tokens only."""
    from align.rewards import parse_rewards
    from align.rollout.batch import Rollout
    from stages.grpo import rewards_of
    from stages.grpo_config import GRPOConfig

    tok = shipped_tokenizer
    c = episode_completion(tok, [("<calc>12*34</calc>", True), ("<out>408</out>", False), ("no idea", True)])
    f = tmp_path / "r.py"
    f.write_text("def seen(prompt, completion, **row):\n    return float('<out>408</out>' in completion)\n")
    cfg = GRPOConfig(reward=["math", f"{f}:seen"])
    (total, parts), = rewards_of(cfg, parse_rewards(cfg.reward), [{"prompt": "12*34?", "answer": "408"}], [c])
    assert parts["math"] == 0.0 and parts["r.seen"] == 1.0 and total == 1.0
    right = episode_completion(tok, [("<calc>12*34</calc>", True), ("<out>408</out>", False), ("408", True)])
    assert rewards_of(cfg, parse_rewards(["math"]), [{"prompt": "12*34?", "answer": "408"}], [right])[0][0] == 1.0
    r = Rollout([{"prompt": "x"}], [c, right], 2)
    encode = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    policy = len(encode("<calc>12*34</calc>")) + len(encode("no idea"))
    assert r.lengths.tolist() == [[policy, len(encode("<calc>12*34</calc>")) + len(encode("408"))]]
    assert len(c.policy_ids) == policy and c.policy_ids == [t for t, m in zip(c.ids, c.policy_mask) if m]


def test_a_queued_episode_survives_the_checkpoints_json(shipped_tokenizer):
    """--max-staleness keeps rollouts sampled ahead in the checkpoint as JSON: an episode comes back whole (its
    policy mask and what it did), so a resumed run grades and masks it as the interrupted one would have."""
    import json as J

    from align.rollout.queue import Pending

    c = episode_completion(shipped_tokenizer, [("<calc>1+1</calc>", True), ("<out>2</out>", False), ("2", True)])
    back = Pending.from_json(J.loads(J.dumps(Pending(3, 2, [c], 1.5).to_json())))
    assert back.completions[0] == c and back.completions[0].answer == "2"
