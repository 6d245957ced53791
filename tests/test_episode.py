"""Multi-turn episodes (align.rollout.episode): one token list that only grows, the policy's tokens as sampled
and the environment's as tokenised once; re-scored by the trainer's forward, the policy's tokens get the
sampler's log-probs and the environment's get no loss and no gradient."""

from __future__ import annotations

import pytest
import torch

from align.rollout.episode import Episode, Limits, Step, model_turn_sampler, run_episode
from align.tools.calculator import CalculatorEnv


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


def one(sample_turn):
    """A batched TurnSampler from a scripted one-context sampler(context, budget, stops)."""
    return lambda contexts, which, offsets, budgets, stops: [sample_turn(c, b, stops) for c, b in zip(contexts, budgets)]


def load(tiny_model_dir):
    from align.models import load_causal_lm, load_tokenizer, resolve

    source = resolve(str(tiny_model_dir))
    tok = load_tokenizer(source)
    return load_causal_lm(source, tok, torch.float32, seed=0).eval(), tok


def test_an_episode_rescored_by_the_trainer_gives_the_samplers_logprobs_and_env_tokens_no_gradient(tiny_model_dir):
    model, tok = load(tiny_model_dir)
    prompt = tok("Sort 3 1 2:", add_special_tokens=False)["input_ids"]
    sampler = model_turn_sampler(model, tok, temperature=1.0, keys=[7])
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
    run = lambda limits: run_episode(one(sampler), encode, str, Echo(turns=99, text="abc"), {}, [1, 2], limits)  # noqa: E731
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

    ep = run_episode(one(sampler), lambda s: [7], str, Chat([False]), {}, [1], Limits(max_turns=5))
    assert (ep.stop, len(ep.turns), ep.ids) == ("eos", 1, [3, 2])
    ep = run_episode(one(sampler), lambda s: [7], str, Chat([True, False]), {}, [1], Limits(max_turns=5))
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

    ep = run_episode(one(sampler), lambda s: [ord(c) for c in s], lambda ids: "".join(map(chr, ids)), env, {}, [0])
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
    eps = [run_episode(model_turn_sampler(model, tok, 1.0, [key]), encode, tok.decode, Echo(turns=2), {}, prompt,
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


class StopAt:
    """Ends a turn at a stop text and answers it; done after `turns` turns."""

    def __init__(self, stops, turns=3):
        self.stops, self.turns, self.seen = stops, turns, 0

    def reset(self, row):
        return None

    def step(self, turn):
        self.seen += 1
        return Step(observation=" ->", tool_call=True, done=self.seen == self.turns)


@pytest.mark.parametrize("fast", [False, True], ids=["hf", "fast-decoder"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_episodes_equal_the_one_context_reference(tiny_model_dir, temperature, fast):
    """Episodes of 4 prompts in one batch, on HF generate and on the fast decoder (left padding, stops at a text,
    EOS, budgets; the fast decoder keeps each episode's turns in one cache, prefills only the environment's answers
    and is asked to end rows at a stop between steps), give the tokens of the one-context reference sampler under the same keys, and its log-probs
    (sampled); the policy mask and turns agree."""
    from align.rollout.episode import Agent
    from align.rollout.generation import generate_episodes
    from align.rollout.generation import Sampling

    model, tok = load(tiny_model_dir)
    encode = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = [encode(p) for p in ("Sort 3 1 2:", "What is 7 + 5?", "hi", "Sort in ascending order: 9 4 0 2")]
    stops = ("e", " 1")  # common texts: a random model's turns end at them
    limits = Limits(max_turns=3, turn_tokens=6, max_tokens=14, max_env_tokens=20)
    keys = [11, 12, 13, 14] if temperature else None
    s = Sampling(max_new_tokens=14, temperature=temperature)
    agent = Agent("test", lambda row: StopAt(stops), limits)
    # batches of 3: the second (one episode) is filled to the first's width on the fast decoder
    got = generate_episodes(model, tok, prompts, [{}] * 4, s, agent, batch_size=3, device="cpu", keys=keys, fast=fast)
    assert hasattr(model, "_align_fast_decoder") == fast  # the path asked for was the one taken
    if fast:  # later turns prefilled only what the episode added (the cache keeps the turns before)
        assert model._align_fast_decoder.prefilled["appended"] > 0
    ref_sampler = model_turn_sampler(model, tok, temperature or 1.0, keys or [0] * 4)
    if not temperature:  # greedy reference: the argmax

        ref_sampler = _greedy_reference(model, tok)
    for i, c in enumerate(got):
        ref = run_episode(lambda cs, w, o, b, st: ref_sampler(cs, [i], o, b, st), encode,
                          lambda ids: tok.decode(ids, skip_special_tokens=True), StopAt(stops), {}, prompts[i], limits)
        assert c.ids == ref.ids and c.policy_mask == ref.policy_mask, i
        assert c.episode.turns == len(ref.turns) and c.episode.stop == ref.stop
        if temperature:
            assert c.logps == pytest.approx(ref.logprobs, abs=1e-4)
    assert any(c.episode.turns > 1 for c in got)  # the stops were met: multi-turn episodes


def _greedy_reference(model, tok):
    from align.rollout.episode import stopped

    @torch.no_grad()
    def sample_turns(contexts, which, offsets, budgets, stops):
        out = []
        for c, b in zip(contexts, budgets):
            ids = []
            for _ in range(b):
                ids.append(int(model(input_ids=torch.tensor([c + ids])).logits[0, -1].argmax()))
                if ids[-1] == tok.eos_token_id:
                    out.append((ids, [0.0] * len(ids), "eos"))
                    break
                if stopped(tok, ids, stops):
                    out.append((ids, [0.0] * len(ids), "stop"))
                    break
            else:
                out.append((ids, [0.0] * len(ids), "length"))
        return out

    return sample_turns


def test_a_fast_decoder_failing_mid_episode_falls_back_and_releases_its_environments(tiny_model_dir, monkeypatch):
    """The fast decoder raising in an episode's second turn (not forced: a real run's path) costs nothing but time:
    that batch runs again on HF generate with new environments, every environment of the failed attempt is released,
    and the episodes are HF's."""
    import align.rollout.generation as G
    from align.rollout.episode import Agent
    from align.rollout.fast.decoder import FastDecoder

    model, tok = load(tiny_model_dir)
    encode = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = [encode(p) for p in ("Sort 3 1 2:", "What is 7 + 5?", "hi")]
    made, released = [], []

    class Tracked(StopAt):
        def __init__(self):
            super().__init__(("e", " 1"))
            made.append(self)

        def release(self):
            released.append(self)

    agent = Agent("test", lambda row: Tracked(), Limits(max_turns=3, turn_tokens=6, max_tokens=14, max_env_tokens=20))
    s = G.Sampling(max_new_tokens=14, temperature=0.0)
    want = G.generate_episodes(model, tok, prompts, [{}] * 3, s, agent, 3, "cpu", None, fast=False)
    made.clear(), released.clear()
    real, calls = FastDecoder.generate, []

    def second_turn_fails(self, *a, **k):
        calls.append(k.get("reuse"))
        if k.get("reuse"):
            raise RuntimeError("a failing capture")
        return real(self, *a, **k)

    monkeypatch.setattr(FastDecoder, "generate", second_turn_fails)
    monkeypatch.setattr(G, "use_fast_path", lambda *a, **k: True)
    monkeypatch.setenv("ALIGN_FAST_GENERATION", "1")  # _fast_failed turns it off (monkeypatch restores it)
    got = G.generate_episodes(model, tok, prompts, [{}] * 3, s, agent, 3, "cpu", None, fast=None)
    assert calls == [False, True]  # the fast path ran a turn, failed in the next
    assert [c.ids for c in got] == [c.ids for c in want] and any(c.episode.turns > 1 for c in got)
    assert len(made) == 6 and released == made  # both attempts' environments, each released once
