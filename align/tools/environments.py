"""Your environments (`--env FILE.py:NAME`): a class of yours, one object per episode, living in a sandbox
(align.tools.sandbox: its own process, no network, memory and time limits), never in the trainer or the decoder.

    class Retry:                       # FILE.py; no import of align needed
        stops = ()                     # optional: texts that end a policy turn besides EOS
        def reset(self, row):          # row: the episode's data row; returns the first observation (text) or None
            ...
        def step(self, turn):          # turn: the text the policy just wrote
            return observation, reward, done    # text or None, a number or None, bool

Every policy turn (ended by EOS, a stop text or the turn's budget) is passed to step(); the episode ends when
step() says done or at a limit (--max-turns, --max-new-tokens, --max-tool-tokens). The observation's tokens are
appended after the turn (no loss on them); `--reward env` adds the rewards step() gave, summed over the episode.
A reset() or step() that raises, returns garbage or runs past --tool-timeout ends the episode (stop "tool_error"),
scored as --on-reward-error says (skip, or 0), counted in rewards/errors; the run goes on.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from align.rollout.env import Step
from align.tools.sandbox import Sandbox

_ids = itertools.count()


@dataclass
class SandboxEnv:
    box: Sandbox
    stops: tuple[str, ...] = ()
    decides_end: bool = True  # EOS ends a turn, not the episode: the environment says when it is done
    id: int = field(default_factory=lambda: next(_ids))
    failed: bool = False  # reset() failed: the episode ends before the policy's first turn

    def reset(self, row: dict) -> str | None:
        answer = self.box.request({"op": "new", "id": self.id, "row": row})
        self.failed = not answer.get("ok")
        return None if self.failed else answer["observation"]

    def step(self, turn: str) -> Step:
        answer = self.box.request({"op": "step", "id": self.id, "turn": turn})
        if not answer.get("ok"):
            return Step(done=True, tool_error=True, failed=True)
        return Step(observation=answer["observation"], reward=answer["reward"], done=answer["done"])

    def release(self) -> None:
        self.box.request({"op": "drop", "id": self.id})
