"""Multi-turn episodes (align.rollout.episode): one token list that only grows, the policy's tokens as sampled
and the environment's as tokenised once; re-scored by the trainer's forward, the policy's tokens get the
sampler's log-probs and the environment's get no loss and no gradient."""

from __future__ import annotations

import pytest
import torch

from align.rollout.episode import CalculatorEnv, Episode, Limits, Step, model_turn_sampler, run_episode


class Echo:
    """Answers every turn with a fixed observation; done after `turns` turns."""

    stops = ()

    def __init__(self, turns: int, text: str = " ok, go on:"):
        self.turns, self.text, self.seen = turns, text, 0

    def reset(self, row):
        return " (start)"

    def step(self, turn):
        self.seen += 1
        return Step(observation=self.text, reward=float(self.seen), done=self.seen == self.turns, tool_call=True)


def load(tiny_model_dir):
    from align.models import load_causal_lm, load_tokenizer, resolve

    source = resolve(str(tiny_model_dir))
    tok = load_tokenizer(source)
    return load_causal_lm(source, tok, torch.float32, seed=0).eval(), tok


def test_an_episode_rescored_by_the_trainer_gives_the_samplers_logprobs_and_env_tokens_no_gradient(tiny_model_dir):
    model, tok = load(tiny_model_dir)
    prompt = tok("Sort 3 1 2:", add_special_tokens=False)["input_ids"]
    sampler = model_turn_sampler(model, tok, temperature=1.0, key=7)
    env = Echo(turns=3)
    ep = run_episode(sampler, lambda s: tok(s, add_special_tokens=False)["input_ids"], tok.decode, env, {}, prompt,
                     Limits(max_turns=5, turn_tokens=6, max_tokens=64, max_env_tokens=64))
    assert ep.stop == "done" and len(ep.turns) == 3 and ep.rewards == [1.0, 2.0, 3.0] and ep.tool_calls == 3
    obs = tok(" ok, go on:", add_special_tokens=False)["input_ids"]
    opening = tok(" (start)", add_special_tokens=False)["input_ids"]
    # the environment's tokens, as tokenised once, between the turns; the policy's exactly where the turns say
    assert ep.ids[: len(opening)] == opening and ep.policy_mask[: len(opening)] == [0] * len(opening)
    for (start, end), (next_start, _) in zip(ep.turns, ep.turns[1:]):
        assert ep.ids[end:next_start] == obs and ep.policy_mask[start:end] == [1] * (end - start)
        assert ep.policy_mask[end:next_start] == [0] * len(obs)
    assert ep.policy_tokens == sum(e - s for s, e in ep.turns) and len(ep.logprobs) == len(ep.ids)

    ids = torch.tensor([prompt + ep.ids])
    logits = model(input_ids=ids).logits.float()
    logits.retain_grad()
    logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[0, :, 0][len(prompt) - 1:]
    mask = torch.tensor(ep.policy_mask, dtype=torch.float32)
    torch.testing.assert_close(logp * mask, torch.tensor(ep.logprobs), atol=1e-5, rtol=1e-5)
    (-(logp * mask).sum()).backward()
    grad = logits.grad[0, len(prompt) - 1: -1]  # the position predicting each token of the episode
    assert (grad[mask == 0] == 0).all() and (grad[mask == 1].abs().sum(-1) > 0).all()


def test_the_same_key_gives_the_same_episode_and_limits_end_it():
    """A scripted sampler: the limits end the episode with their reason, the environment's tokens are cut to what
    is left of their budget."""
    def sampler(context, budget, stops):
        return [5] * budget, [-1.0] * budget, "length"

    encode = lambda s: [9] * len(s)  # noqa: E731
    run = lambda limits: run_episode(sampler, encode, str, Echo(turns=99, text="abc"), {}, [1, 2], limits)  # noqa: E731
    assert run(Limits(max_turns=2, turn_tokens=3)).stop == "max_turns"
    ep = run(Limits(max_turns=9, turn_tokens=3, max_tokens=7))
    assert ep.stop == "max_tokens" and ep.policy_tokens == 7 and [e - s for s, e in ep.turns] == [3, 3, 1]
    ep = run(Limits(max_turns=9, turn_tokens=2, max_env_tokens=12))
    assert ep.stop == "max_env_tokens" and ep.env_tokens == 12  # " (start)" 8 + "abc" 3 + 1 of the next
    assert isinstance(ep, Episode)


def test_eos_without_a_tool_call_is_the_final_answer():
    """A turn the policy ends with EOS and that calls no tool ends the episode ("eos"), even where the environment
    would go on; a tool call ended by EOS is answered and the episode continues."""
    class Chat:
        stops = ()

        def __init__(self, tool_calls):
            self.calls = iter(tool_calls)

        def reset(self, row):
            return None

        def step(self, turn):
            return Step(observation="!", tool_call=next(self.calls))

    def sampler(context, budget, stops):
        return [3, 2], [-0.1, -0.2], "eos"

    ep = run_episode(sampler, lambda s: [7], str, Chat([False]), {}, [1], Limits(max_turns=5))
    assert (ep.stop, len(ep.turns), ep.ids) == ("eos", 1, [3, 2])
    ep = run_episode(sampler, lambda s: [7], str, Chat([True, False]), {}, [1], Limits(max_turns=5))
    assert (ep.stop, len(ep.turns), ep.ids, ep.policy_mask) == ("eos", 2, [3, 2, 7, 3, 2], [1, 1, 0, 1, 1])


def test_the_calculator_environment_answers_a_tool_call_and_ends_on_an_answer():
    env = CalculatorEnv()
    step = env.step("I need 12*34: <calc>12*34</calc>")
    assert step == Step(observation="<out>408</out>", tool_call=True)
    assert env.step("<calc>1/0</calc>").tool_error and env.step("<calc>1/0</calc>").observation == \
        "<out>error: division by zero</out>"
    assert env.step("#### 408") == Step(done=True)

    turns = iter([("12*34=<calc>12*34</calc>", "stop"), ("#### 408", "eos")])

    def sampler(context, budget, stops):
        text, why = next(turns)
        assert stops == ("</calc>",)
        return [ord(c) for c in text], [-0.5] * len(text), why

    ep = run_episode(sampler, lambda s: [ord(c) for c in s], lambda ids: "".join(map(chr, ids)), env, {}, [0])
    assert "".join(map(chr, ep.ids)) == "12*34=<calc>12*34</calc><out>408</out>#### 408"
    assert ep.stop == "done" and ep.tool_calls == 1 and ep.tool_errors == 0 and ep.env_tokens == len("<out>408</out>")


def test_an_episodes_batch_masks_the_environment_and_the_trainer_scores_its_sampled_tokens(tiny_model_dir):
    """Episode.completion → rollout_batch: the response mask is the policy mask at the trainer's positions, the
    sampler's log-probs sit there (0 at the environment's tokens), and align.logprobs over the batch gives them
    back on the policy's tokens; a plain completion's batch is unchanged (every response token)."""
    from align.logprobs import logprobs
    from align.rollout.batch import rollout_batch
    from align.rollout.generation import Completion

    model, tok = load(tiny_model_dir)
    prompt = tok("Sort 3 1 2:", add_special_tokens=False)["input_ids"]
    encode = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    eps = [run_episode(model_turn_sampler(model, tok, 1.0, key), encode, tok.decode, Echo(turns=2), {}, prompt,
                       Limits(turn_tokens=5)) for key in (1, 2)]
    plain = Completion(prompt, [5, 6, 7], "x", True, [-1.0, -2.0, -3.0])
    batch = rollout_batch([e.completion(tok.decode) for e in eps] + [plain], tok.pad_token_id, "cpu")
    start = len(prompt) - 1
    for i, e in enumerate(eps):
        assert batch["response_mask"][i, start:start + len(e.ids)].tolist() == e.policy_mask
        assert batch["response_mask"][i, :start].sum() == 0 and batch["response_mask"][i, start + len(e.ids):].sum() == 0
        assert batch["sampler_logp"][i, start:start + len(e.ids)].tolist() == pytest.approx(e.logprobs)
    assert batch["response_mask"][2, start:start + 3].tolist() == [1, 1, 1] and batch["response_mask"][2].sum() == 3
    with torch.no_grad():
        trainer, _ = logprobs(model, batch)
    m = batch["response_mask"][:2]
    torch.testing.assert_close(trainer[:2] * m, batch["sampler_logp"][:2] * m, atol=1e-5, rtol=1e-5)
