"""Multi-turn episodes: the policy writes a turn, the environment answers, until done, token in and token out.

    episode = run_episode(turns, tok.encode, CalculatorEnv(), row, prompt_ids, limits)
    episode.ids            every token after the prompt, as it came: the policy's as sampled, the environment's
                           tokenised once, when it answered (nothing before is ever re-tokenised)
    episode.policy_mask    1 on the tokens the policy sampled (the loss's), 0 on the environment's
    episode.logprobs       the sampler's log-probability of each policy token (0.0 at the environment's)

Re-rendering a conversation through the chat template after each turn changes its tokens (a merge across the
turn boundary, a stripped space): the trainer would score tokens the sampler never drew (verl #6921, slime #2263).
Here the episode is one token list that only grows, so the trainer's forward over prompt + ids scores exactly the
sampled tokens, and a loss weighted by `policy_mask` gives the environment's tokens no loss and no gradient.

An environment (`Env`) is made per episode from its data row: `reset(row)` may give an opening observation,
`step(turn_text)` answers one policy turn with the next observation (text, or None), an optional reward and
whether the episode is done. A turn ends at EOS, at one of the environment's `stops` (a tool call's closing tag),
or at `Limits.turn_tokens`; the episode ends when the environment says done, at EOS without a tool call
(the policy's final answer), or at a limit (turns, policy tokens, environment tokens). `stop` says which.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Callable

from align.rollout.env import STOPS, Agent, Env, Limits, Step  # noqa: F401 (the contract, re-exported)

@dataclass
class Episode:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    policy_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each policy turn in `ids`
    rewards: list[float] = field(default_factory=list)  # the environment's, per turn that gave one
    stop: str = ""
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0  # in the environment's reset and steps

    def add_policy(self, ids: list[int], logprobs: list[float]) -> None:
        self.turns.append((len(self.ids), len(self.ids) + len(ids)))
        self.ids += ids
        self.policy_mask += [1] * len(ids)
        self.logprobs += logprobs

    def add_env(self, ids: list[int]) -> None:
        self.ids += ids
        self.policy_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def completion(self, decode: Callable[[list[int]], str]):
        """The episode as a rollout Completion (align.rollout.generation): its tokens after the prompt, the
        sampler's log-probs and the policy mask, so `rollout_batch` gives it a response mask over the policy's
        tokens only; finished unless a limit cut it. Its text is the whole transcript; `episode.final` the
        policy's last turn (what a verifier grades)."""
        from align.rollout.completion import Completion, EpisodeInfo

        last = self.ids[slice(*self.turns[-1])] if self.turns else []
        info = EpisodeInfo(decode(last), len(self.turns), self.tool_calls, self.tool_errors, self.stop,
                           self.env_tokens, self.tool_seconds, sum(self.rewards) if self.rewards else None)
        return Completion(self.prompt_ids, self.ids, decode(self.ids), self.stop in ("done", "eos"), self.logprobs,
                          self.policy_mask, info)

    @property
    def policy_tokens(self) -> int:
        return sum(self.policy_mask)

    @property
    def env_tokens(self) -> int:
        return len(self.ids) - self.policy_tokens


# sample_turns(contexts, which, offsets, budgets, stops) -> one (new ids, their log-probs, why) per context, why
# "eos" | "stop" | "length": a policy turn of each episode still running, in one batch. `which`: the episodes' places
# in the batch given to run_episodes (their sampling keys); `offsets`: how many tokens each already has after its
# prompt (the position its sampling noise is keyed by); `budgets`: the most tokens each turn may take.
TurnSampler = Callable[[list[list[int]], list[int], list[int], list[int], tuple[str, ...]],
                       list[tuple[list[int], list[float], str]]]


def run_episodes(sample_turns: TurnSampler, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                 envs: list[Env], rows: list[dict], prompt_ids: list[list[int]],
                 limits: Limits = Limits()) -> list[Episode]:
    """A batch of episodes, episode i of `envs[i]` on `rows[i]` after `prompt_ids[i]` (see the module's docstring):
    each round samples one policy turn of every episode still running, in one call, then the environments answer."""
    eps = [Episode(list(p)) for p in prompt_ids]
    try:
        for ep, env, row in zip(eps, envs, rows):
            opening = _timed(ep, env.reset, row)
            if getattr(env, "failed", False):  # a user's environment that could not start: the episode ends now
                ep.stop = "tool_error"
            elif opening:
                ep.add_env(encode(opening)[: limits.max_env_tokens])
        running = [i for i, ep in enumerate(eps) if not ep.stop]
        while running:  # (an episode leaves `running` at a limit before it could ask for a turn it has no room for)
            asking = [(i, min(limits.turn_tokens, limits.max_tokens - eps[i].policy_tokens)) for i in running]
            turns = sample_turns([eps[i].prompt_ids + eps[i].ids for i, _ in asking], [i for i, _ in asking],
                                 [len(eps[i].ids) for i, _ in asking], [b for _, b in asking], envs[0].stops)
            running = [i for (i, _), turn in zip(asking, turns)
                       if _answer(eps[i], envs[i], *turn, encode, decode, limits)]
    finally:  # a sampler that failed mid-batch too (the batch runs again on another path, with new environments)
        for ep, env in zip(eps, envs):
            if callable(getattr(env, "release", None)):  # a sandboxed environment's object is dropped with it
                _timed(ep, env.release)
    return eps


def _timed(ep: Episode, fn, *args):
    t = time.perf_counter()
    try:
        return fn(*args)
    finally:
        ep.tool_seconds += time.perf_counter() - t


def _answer(ep: Episode, env: Env, ids: list[int], logps: list[float], why: str, encode, decode,
            limits: Limits) -> bool:
    """The environment's answer to the turn the policy just wrote (ids); False when the episode has ended."""
    ep.add_policy(ids, logps)
    step = _timed(ep, env.step, decode(ids))
    ep.tool_calls += step.tool_call
    ep.tool_errors += step.tool_error
    if step.reward is not None:
        ep.rewards.append(step.reward)
    if step.done or (why == "eos" and not step.tool_call and not getattr(env, "decides_end", False)):
        ep.stop = "tool_error" if step.failed else "done" if step.done else "eos"
        return False
    if len(ep.turns) == limits.max_turns or ep.policy_tokens >= limits.max_tokens:  # no turn left to read it
        ep.stop = "max_turns" if len(ep.turns) == limits.max_turns else "max_tokens"
        return False
    if step.observation:
        room = limits.max_env_tokens - ep.env_tokens
        if room <= 0:
            ep.stop = "max_env_tokens"
            return False
        ep.add_env(encode(step.observation)[:room])
    return True


def run_episode(sample_turns: TurnSampler, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                env: Env, row: dict, prompt_ids: list[int], limits: Limits = Limits()) -> Episode:
    """One episode (run_episodes of one)."""
    return run_episodes(sample_turns, encode, decode, [env], [row], [prompt_ids], limits)[0]


def model_turn_sampler(model, tokenizer, temperature: float, keys: list[int]) -> TurnSampler:
    """A TurnSampler over a causal LM, one context at a time (a plain module, no engine: the reference the batched
    samplers are tested against). It prefills the context and samples with align.rollout.sampling's keyed noise —
    episode `which`'s key, at the token's position after the prompt, so a turn's tokens do not depend on how the
    episode was split into calls or batched — and stops at EOS, at a stop text or at the budget. Log-probs are
    log_softmax(logits / T) at the drawn token, in fp32."""
    import torch

    from align.rollout.sampling import choose, sampled_logprobs

    eos = tokenizer.eos_token_id
    # the KV cache's argument: `cache` from transformers 5.25 (`past_key_values` deprecated there), else the old name
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @torch.no_grad()
    def one(context: list[int], key: int, offset: int, budget: int, stops: tuple[str, ...]):
        out = model(input_ids=torch.tensor([context]), use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1].float()  # (the output keeps the old name)
        ids, logps = [], []
        for i in range(budget):
            token = choose(logits / temperature, torch.tensor([key], dtype=torch.int64), offset + i)
            ids.append(int(token))
            logps.append(float(sampled_logprobs(logits, token, temperature)))
            if ids[-1] == eos:
                return ids, logps, "eos"
            if stopped(tokenizer, ids, stops):
                return ids, logps, "stop"
            out = model(input_ids=token[:, None], use_cache=True, **{cache_arg: past})
            past, logits = out.past_key_values, out.logits[:, -1].float()
        return ids, logps, "length"

    def sample_turns(contexts, which, offsets, budgets, stops):
        return [one(c, keys[w], o, b, stops) for c, w, o, b in zip(contexts, which, offsets, budgets)]

    return sample_turns


def stopped(tokenizer, ids: list[int], stops: tuple[str, ...]) -> bool:
    """Whether the turn's tokens so far end in a stop text (its last token completing it: the text may end inside
    that token, which is kept whole)."""
    if not stops:
        return False
    longest = max(map(len, stops))
    tail = tokenizer.decode(ids[-longest:])  # a token is at least one character: the stop lies within these
    last = tokenizer.decode(ids[-1:])
    return any(s in tail and s not in tail[: len(tail) - len(last)] for s in stops)


def first_stop(tokenizer, ids: list[int], stops: tuple[str, ...], start: int = 0) -> int | None:
    """The length of the shortest prefix ids[:n] (n > start) that `stopped` ends: where a batched sampler that ran
    past the stop cuts the turn; None when no stop text completes after ids[:start]. One decode rules out a row
    with no stop text in its new tokens."""
    if not stops:
        return None
    tail = tokenizer.decode(ids[max(0, start - max(map(len, stops))):])
    if not any(s in tail for s in stops):
        return None
    return next((n for n in range(start + 1, len(ids) + 1) if stopped(tokenizer, ids[:n], stops)), None)
