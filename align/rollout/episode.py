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
from dataclasses import dataclass, field
from typing import Callable, Protocol

from align.tools.calculator import calculate

STOPS = ("done", "eos", "max_turns", "max_tokens", "max_env_tokens")  # why an episode ended


@dataclass(frozen=True)
class Step:
    """The environment's answer to one policy turn."""

    observation: str | None = None  # text appended after the turn (None: nothing)
    reward: float | None = None
    done: bool = False
    tool_call: bool = False  # the turn called a tool (counted)
    tool_error: bool = False  # ... and the tool failed (counted)


class Env(Protocol):
    stops: tuple[str, ...]  # texts that end a policy turn (a tool call's closing tag); () for none

    def reset(self, row: dict) -> str | None: ...

    def step(self, turn: str) -> Step: ...


@dataclass(frozen=True)
class Limits:
    max_turns: int = 4  # policy turns
    turn_tokens: int = 64  # tokens of one policy turn
    max_tokens: int = 256  # policy tokens of the episode
    max_env_tokens: int = 256  # environment tokens of the episode; an observation is cut to what is left


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
        tokens only; finished unless a limit cut it."""
        from align.rollout.generation import Completion

        return Completion(self.prompt_ids, self.ids, decode(self.ids), self.stop in ("done", "eos"), self.logprobs,
                          self.policy_mask)

    @property
    def policy_tokens(self) -> int:
        return sum(self.policy_mask)

    @property
    def env_tokens(self) -> int:
        return len(self.ids) - self.policy_tokens


# sample_turn(context_ids, max_new_tokens, stops) -> (new ids, their log-probs, why: "eos" | "stop" | "length")
TurnSampler = Callable[[list[int], int, tuple[str, ...]], tuple[list[int], list[float], str]]


def run_episode(sample_turn: TurnSampler, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                env: Env, row: dict, prompt_ids: list[int], limits: Limits = Limits()) -> Episode:
    """One episode of `env` on `row` after `prompt_ids` (see the module's docstring)."""
    ep = Episode(list(prompt_ids))
    opening = env.reset(row)
    if opening:
        ep.add_env(encode(opening)[: limits.max_env_tokens])
    while True:
        if len(ep.turns) == limits.max_turns:
            ep.stop = "max_turns"
            return ep
        budget = min(limits.turn_tokens, limits.max_tokens - ep.policy_tokens)
        if budget <= 0:
            ep.stop = "max_tokens"
            return ep
        ids, logps, why = sample_turn(ep.prompt_ids + ep.ids, budget, env.stops)
        ep.add_policy(ids, logps)
        step = env.step(decode(ids))
        ep.tool_calls += step.tool_call
        ep.tool_errors += step.tool_error
        if step.reward is not None:
            ep.rewards.append(step.reward)
        if step.done or (why == "eos" and not step.tool_call):
            ep.stop = "done" if step.done else "eos"
            return ep
        if step.observation:
            room = limits.max_env_tokens - ep.env_tokens
            if room <= 0:
                ep.stop = "max_env_tokens"
                return ep
            ep.add_env(encode(step.observation)[:room])


@dataclass
class CalculatorEnv:
    """The built-in calculator as an environment: a turn that ends with `<calc>EXPR</calc>` is answered with
    `<out>VALUE</out>` (align.tools.calculator: exact, bounded, never `eval`); any other turn is the final answer.
    The tags are plain text, so any tokenizer writes them."""

    open: str = "<calc>"
    close: str = "</calc>"
    answer: str = "<out>{}</out>"
    stops: tuple[str, ...] = ("</calc>",)

    def reset(self, row: dict) -> str | None:
        return None

    def step(self, turn: str) -> Step:
        head, sep, _ = turn.rpartition(self.close)
        if not sep or self.open not in head:
            return Step(done=True)
        value = calculate(head.rsplit(self.open, 1)[1])
        return Step(observation=self.answer.format(value), tool_call=True, tool_error=value.startswith("error:"))


def model_turn_sampler(model, tokenizer, temperature: float, key: int) -> TurnSampler:
    """A TurnSampler over a causal LM (a plain module, no engine; the reference path of the tests and the CPU): it
    prefills the context, samples with align.rollout.sampling's keyed noise — keyed by the token's position in the
    episode, so a turn's tokens do not depend on how the episode was split into calls — and stops at EOS, at a
    stop text or at the budget. Log-probs are log_softmax(logits / T) at the drawn token, in fp32."""
    import torch

    from align.rollout.sampling import choose, sampled_logprobs

    keys = torch.tensor([key], dtype=torch.int64)
    eos = tokenizer.eos_token_id
    # the KV cache's argument: `cache` from transformers 5.25 (`past_key_values` deprecated there), else the old name
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @torch.no_grad()
    def sample_turn(context: list[int], budget: int, stops: tuple[str, ...]) -> tuple[list[int], list[float], str]:
        out = model(input_ids=torch.tensor([context]), use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1].float()  # (the output keeps the old name)
        ids, logps = [], []
        for i in range(budget):
            position = len(context) + i
            token = choose(logits / temperature, keys, position)
            ids.append(int(token))
            logps.append(float(sampled_logprobs(logits, token, temperature)))
            if ids[-1] == eos:
                return ids, logps, "eos"
            if stops and any(tokenizer.decode(ids).endswith(s) for s in stops):
                return ids, logps, "stop"
            out = model(input_ids=token[:, None], use_cache=True, **{cache_arg: past})
            past, logits = out.past_key_values, out.logits[:, -1].float()
        return ids, logps, "length"

    return sample_turn
