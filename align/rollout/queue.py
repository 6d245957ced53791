"""Where GRPO's rollouts come from: the queue of the rollouts of the steps to come (off-policy, --max-staleness K:
sampled ahead of their step) and the sampler that fills it.

Step t trains on the rollout of step t, sampled from the weights of step max(0, t − K) — θ_s is the policy
after s updates — so with a decoder of its own (--rollout-gpus, align.rollout.disagg) the rollout of step t + K is
sampled while step t trains:

    step t:  publish θ_t to the sampler  ·  take rollout t (queued)  ·  ask for rollout t + K (from θ_t)
             ·  update θ_t -> θ_{t+1}  ·  receive rollout t + K into the queue

In one process the sampler is the policy engine itself and "ask" samples at once, before the update, so the
algorithm is the same as on several GPUs, only sequential. At the start (and after a resume whose checkpoint
holds fewer) the missing rollouts t .. t + K − 1 are sampled from θ_t. K = 0 samples rollout t from θ_t (after
publishing it to a sampler of its own): the synchronous algorithm, which is how GRPO runs at --max-staleness 0 —
in one process (`Rollouts.synchronous`) the rollout is then sampled by the step itself, right before its update.

The queue is part of the checkpoint (`state_dict`): a resumed run trains on the very rollouts the interrupted
one would have. Completions hold token ids and the sampler's log-probs: JSON carries both exactly.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass

from align import runtime
from align.rollout.batch import timed
from align.rollout.generation import Completion


@dataclass
class Pending:
    """A rollout sampled ahead of its step: this rank's completions of step `step`, sampled from the weights of
    step `version`, in `seconds` (the sampler's generation time) after the sampler waited `idle` seconds for
    its request and weights."""

    step: int
    version: int
    completions: list[Completion]
    seconds: float
    idle: float = 0.0

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "completions": [c.to_json() for c in self.completions]}

    @classmethod
    def from_json(cls, d: dict) -> Pending:
        return cls(**{**d, "completions": [Completion.from_json(c) for c in d["completions"]]})


class LocalSampler:
    """The policy engine of this process samples: `sample(step)` -> this rank's completions of `step`, from the
    engine's current weights; a request samples at once, timed as a phase of the step (`timed`: `phase` holds
    the last request's time/generate and, on a GPU, memory/generate)."""

    def __init__(self, sample):
        self.sample = sample
        self.done: dict[int, tuple] = {}
        self.phase: dict[str, float] = {}

    def publish(self, step: int) -> None:
        """The engine is the trainer's: it holds the new weights already."""

    def request(self, step: int) -> None:
        self.phase = {}
        with timed(self.phase, "time/generate"):
            completions = self.sample(step)
        self.done[step] = (completions, self.phase["time/generate"], 0.0)

    def receive(self, step: int) -> tuple[list[Completion], float, float]:
        return self.done.pop(step)

    def close(self, failed: bool = False) -> None:
        pass


class Rollouts:
    """The queue of rollouts ahead of the step (at most max(K, 1) between steps) and the sampler that fills it."""

    def __init__(self, staleness: int, max_steps: int, sampler):
        self.K, self.max_steps, self.sampler = staleness, max_steps, sampler
        self.queue: deque[Pending] = deque()
        self.asked: tuple[int, int] | None = None  # (step, version) of the rollout asked for during the update

    @property
    def synchronous(self) -> bool:
        """Staleness 0 with this process's engine as the sampler: rollout t is sampled in step t, from θ_t, right
        before its update — the synchronous algorithm. Its sampling is a phase of the step like the update
        (time/generate, memory/generate); nothing is waited for (no time/wait), nothing is stale, and nothing is
        kept between steps (no state for a checkpoint)."""
        return not self.K and isinstance(self.sampler, LocalSampler)

    def before_update(self, step: int, times: dict) -> Pending:
        """Rollout `step`, after the sampler was given the weights of `step` and asked for rollout step + K;
        `times`: its generation time (time/generate; synchronous: the sampling phase's figures) and how long the
        trainer waited for it (time/wait)."""
        if self.queue and self.queue[0].step != step:  # a rollback to an earlier checkpoint: its queue is loaded
            self.queue.clear()
        if not self.synchronous:
            times["time/wait"] = 0.0
        self.sampler.publish(step)
        while len(self.queue) < max(self.K, 1) and step + len(self.queue) < self.max_steps:
            j = step + len(self.queue)  # missing (the start, a resume): sampled from the current weights
            self.sampler.request(j)
            self.queue.append(self._receive(j, step, times))
        out = self.queue.popleft()
        if self.K and step + self.K < self.max_steps:
            self.sampler.request(step + self.K)
            self.asked = (step + self.K, step)
        times.update(self.sampler.phase if self.synchronous else {"time/generate": out.seconds})
        return out

    def after_update(self, times: dict) -> None:
        """Receive the rollout asked for before the update (from a decoder: waiting for it if it is not done)."""
        if self.asked is not None:
            j, version = self.asked
            self.asked = None
            self.queue.append(self._receive(j, version, times))

    def _receive(self, j: int, version: int, times: dict) -> Pending:
        t = time.time()
        completions, seconds, idle = self.sampler.receive(j)
        if not self.synchronous:  # synchronous: sampled by the step itself, nothing to wait for
            times["time/wait"] = times.get("time/wait", 0.0) + time.time() - t
        return Pending(j, version, completions, seconds, idle)

    def state_dict(self) -> list:
        """Every rank's queue (collective: every rank calls it, as a checkpoint does)."""
        return runtime.all_gather_objects([p.to_json() for p in self.queue])

    def load_state_dict(self, per_rank: list) -> None:
        self.queue = deque(Pending.from_json(p) for p in per_rank[runtime.rank()])
        self.asked = None
