"""What a rollout returns per prompt: a Completion (one response, or a multi-turn episode with its EpisodeInfo)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EpisodeInfo:
    """What a multi-turn episode (align.rollout.episode) adds to its Completion."""

    final: str  # the text of the policy's last turn: its answer, what a verifier grades
    turns: int  # policy turns
    tool_calls: int
    tool_errors: int
    stop: str  # why it ended (episode.STOPS)
    env_tokens: int
    tool_seconds: float  # in the environment
    env_reward: float | None = None  # the sum of the rewards the environment gave (None: it gave none)


@dataclass
class Completion:
    prompt_ids: list[int]
    ids: list[int]  # response tokens, up to and including EOS when the model stopped
    text: str  # decoded response without special tokens
    finished: bool  # emitted EOS within max_new_tokens
    # the sampler's log-probability of each response token: log_softmax(logits / T)[token] of the logits it sampled
    # from, at the temperature it sampled at, before top-k / top-p (what the trainer scores); None when greedy
    logps: list[float] | None = None
    # a multi-turn episode's (align.rollout.episode): 1 on the tokens the policy sampled, 0 on the environment's;
    # None: every response token is the policy's
    policy_mask: list[int] | None = None
    episode: EpisodeInfo | None = None  # a multi-turn episode's turns, tool calls and stop
    # routing replay (--routing-replay, an MoE policy on the fast decoder): the experts each MoE layer chose for
    # every token of prompt_ids + ids as the decoder read it, [tokens, MoE layers, k] int8/int16, -1 where no
    # decode step read the token (the last one); None: not recorded (the trainer routes those tokens itself)
    routes: torch.Tensor | None = None

    def to_json(self) -> dict:
        """dataclasses.asdict, the routes as nested lists (a checkpoint's queued rollouts, a decoder's answer)."""
        d = dataclasses.asdict(self)
        if self.routes is not None:
            d["routes"] = {"dtype": str(self.routes.dtype).removeprefix("torch."), "values": self.routes.tolist()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> Completion:
        """A Completion from its `to_json` (or dataclasses.asdict) form (a checkpoint's queued rollouts)."""
        episode, routes = d.get("episode"), d.get("routes")
        if isinstance(routes, dict):
            routes = torch.tensor(routes["values"], dtype=getattr(torch, routes["dtype"]))
        return cls(**{**d, "episode": EpisodeInfo(**episode) if episode else None, "routes": routes})

    @property
    def answer(self) -> str:
        """The text a verifier grades: an episode's last policy turn, else the whole completion."""
        return self.episode.final if self.episode else self.text

    @property
    def policy_ids(self) -> list[int]:
        """The tokens the policy sampled (an episode's without the environment's)."""
        return self.ids if self.policy_mask is None else [t for t, m in zip(self.ids, self.policy_mask) if m]
