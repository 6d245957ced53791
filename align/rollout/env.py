"""The environment contract of multi-turn episodes (align.rollout.episode runs them; align.tools makes them):
light, no torch, so a tool or a user's environment file imports only this.

An environment (`Env`) is made per episode from its data row: `reset(row)` may give an opening observation,
`step(turn_text)` answers one policy turn with a `Step`: the next observation (text, or None), an optional reward
and whether the episode is done. `stops` are the texts that end a policy turn (a tool call's closing tag).
Optional attributes: `decides_end` (True: EOS ends a turn, not the episode; the environment says done), `failed`
(set by a reset that could not start the episode) and `release()` (called when the episode ends: a sandboxed
environment's object is dropped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

# why an episode ended: the environment said done, the policy answered (EOS without a call), a limit, or a tool
# that failed (hung, crashed, garbage: align.tools.functions)
STOPS = ("done", "eos", "max_turns", "max_tokens", "max_env_tokens", "tool_error")


@dataclass(frozen=True)
class Step:
    """The environment's answer to one policy turn."""

    observation: str | None = None  # text appended after the turn (None: nothing)
    reward: float | None = None
    done: bool = False
    tool_call: bool = False  # the turn called a tool (counted)
    tool_error: bool = False  # ... and the call failed (counted)
    failed: bool = False  # the tool itself failed (hung, crashed, garbage): the episode ends, stop "tool_error"


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


@dataclass(frozen=True)
class Agent:
    """How a stage's rollouts become episodes: an environment per episode (`make_env(row)`), the limits, and what to
    release at the stage's end (`close`: a sandbox's worker)."""

    name: str  # what the user asked for (--tools calculator, --tools FILE.py:fn)
    make_env: Callable[[dict], Env]
    limits: Limits
    close: Callable[[], None] = lambda: None
    # the tools' JSON schemas, for prompts whose chat template shows them (align.tools.chat_format); None: the
    # policy learned its tools from demonstrations (align's built-in formats)
    schemas: list | None = None
