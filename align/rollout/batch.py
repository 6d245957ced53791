"""Rollouts: G sampled responses for each of P prompts (PPO: G = 1), kept as a [P, G] structure, and the
right-padded token tensors the losses see.

`Rollout.batch()` also carries `sampler_logp` [N, L−1] (when the decoder returned them): the sampler's own log-prob
of every response token at the sampling temperature, compared with the trainer's (objectives.offpolicy.rollout_mismatch);
and, under --routing-replay, `routed_experts` [N, L, MoE layers, k]: the experts the decoder chose for each token
(align.routing_replay).

In `Rollout.batch()`, `response_mask[i, t] = 1` when target token t+1 of row i is a response token (the EOS
included; prompt, padding and anything after EOS excluded; in a multi-turn episode the environment's tokens too). Rows are prompt-major: sample g of prompt p is row
p·G + g, which is what `grouped()` undoes.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch

from align import runtime, vision
from align.data import pad
from align.objectives.offpolicy import rollout_mismatch
from align.rollout.generation import Completion, Sampling, generate_on_rank
from align.routing_replay import KWARG as ROUTES
from align.routing_replay import check, routes_batch


@dataclass
class Rollout:
    rows: list[dict]  # the P prompts' data rows
    completions: list[Completion]  # P·G, prompt-major
    group_size: int  # G
    rewards: torch.Tensor | None = None  # [P, G]
    valid: torch.Tensor | None = None  # [P, G]: 1 where every reward function returned a number
    parts: dict[str, list[float]] = field(default_factory=dict)  # per reward function: the values it returned
    watched: dict[str, list[float]] = field(default_factory=dict)  # proxy_reward / gold_reward (judge.watched)

    @property
    def sample_rows(self) -> list[dict]:
        """The data row of every sample, [P·G]."""
        return [row for row in self.rows for _ in range(self.group_size)]

    @property
    def prompts(self) -> list:
        return [row["prompt"] for row in self.sample_rows]

    @property
    def finished(self) -> torch.Tensor:
        """[P, G]: 1 where the sample ended with EOS within the budget."""
        return self.grouped(torch.tensor([float(c.finished) for c in self.completions]))

    @property
    def lengths(self) -> torch.Tensor:
        """[P, G]: the tokens each sample's policy wrote (an episode's without the environment's)."""
        return self.grouped(torch.tensor([float(len(c.policy_ids)) for c in self.completions]))

    def grouped(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.view(-1, self.group_size)

    def batch(self, pad_id: int, device) -> dict:
        return rollout_batch(self.completions, pad_id, device)


def rollout_sampling(cfg, policy) -> Sampling:
    """An RL stage's rollout Sampling: its --max-new-tokens, temperature, top-k / top-p, --rollout-precision, and
    the routes recorded under --routing-replay (align.routing_replay; `check`ed against the policy)."""
    return Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, precision=cfg.decode_precision(),
                    routes=check(policy, cfg.routing_replay))


def sample(policy, tokenizer, rows: list[dict], prompt_ids: list[list[int]], group_size: int, s: Sampling,
           dist: runtime.Dist, gather: bool = True, agent=None) -> Rollout:
    """G samples of each prompt from the policy engine (one generation phase, ZeRO-3 weights gathered once);
    `agent` (align.rollout.episode.Agent): G multi-turn episodes of each."""
    prompts = [p for p in prompt_ids for _ in range(group_size)]
    sample_rows = [r for r in rows for _ in range(group_size)]
    return Rollout(rows, generate_on_rank(policy, tokenizer, prompts, s, dist, len(prompts), gather, agent=agent,
                                          rows=sample_rows), group_size)


def rollout_batch(completions: list[Completion], pad_id: int, device) -> dict:
    """Right-padded rows and their response mask, with NO attention mask: padding comes after every real token of
    its row, so causal attention never reads it at a position a loss uses, and positions count 0.. either way;
    without a mask attention runs the fused causal (flash) kernel instead of a masked one."""
    seqs = [c.prompt_ids + c.ids for c in completions]
    ids = torch.tensor(pad(seqs, pad_id), device=device)
    resp = torch.zeros(ids.shape[0], ids.shape[1] - 1, device=device)
    for i, c in enumerate(completions):
        start = len(c.prompt_ids) - 1  # logits at position p predict token p+1
        resp[i, start : start + len(c.ids)] = 1
        if c.policy_mask is not None:  # a multi-turn episode: the environment's tokens are no response tokens
            resp[i, start : start + len(c.ids)] = torch.tensor(c.policy_mask, dtype=resp.dtype)
    batch = {"input_ids": ids, "response_mask": resp, **vision.collate_images([c.prompt_ids for c in completions], device)}
    if completions and all(c.logps is not None for c in completions):
        # the sampler's log-probs at the positions the trainer's log-probs take (rollout/logp_abs_diff, --tis-cap)
        sampler = torch.zeros_like(resp)
        for i, c in enumerate(completions):
            start = len(c.prompt_ids) - 1
            sampler[i, start : start + len(c.ids)] = torch.tensor(c.logps, dtype=sampler.dtype)
        batch["sampler_logp"] = sampler
    routes = routes_batch(completions, tuple(ids.shape), device)  # --routing-replay: the decoder's experts
    if routes is not None:
        batch[ROUTES] = routes
    return batch


def record_mismatch(stats, mb: dict, trainer_logp, prefix: str = "rollout/") -> None:
    """rollout/logp_abs_diff and rollout/kl (RLMonitor's rollout_mismatch): the decoder's sampling log-probs against
    the trainer's π_old on every sampled token, when the decoder returned them. A rollout sampled from older weights
    on purpose (--max-staleness) logs them as rollout/stale_logp_abs_diff and rollout/stale_kl (`prefix`): there
    they measure how far the policy moved since, not a broken decoder."""
    if "sampler_logp" in mb:
        abs_sum, kl_sum, n = rollout_mismatch(mb["sampler_logp"], trainer_logp, mb["response_mask"])
        stats.mean(f"{prefix}logp_abs_diff", abs_sum, n)
        stats.mean(f"{prefix}kl", kl_sum, n)


def record_completions(stats, r: Rollout) -> None:
    """The completions' metrics, TRL's names, over every rank's completions: completions/mean_length, the share cut
    off at the token limit (completions/clipped_ratio), the mean length of those that ended with EOS
    (completions/mean_terminated_length, NaN when none did), and distinct_1/2 of all of them (gathered)."""
    ids = [x for part in runtime.all_gather_objects([c.policy_ids for c in r.completions]) for x in part]
    lengths, finished = r.lengths, r.finished  # properties: each builds its tensor
    n = lengths.numel()
    stats.mean("completions/mean_length", lengths.sum(), n)
    stats.mean("completions/clipped_ratio", n - finished.sum(), n)
    stats.mean("completions/mean_terminated_length", (lengths * finished).sum(), finished.sum(), math.nan)
    stats.value("distinct_1", distinct_n(ids, 1))
    stats.value("distinct_2", distinct_n(ids, 2))


def record_episodes(stats, r: Rollout) -> None:
    """A multi-turn rollout's metrics (TRL's and verl's names where they have them): tools/call_frequency (calls
    per episode), tools/failure_frequency (of the calls), num_turns/mean, the share of episodes by how they ended
    (episodes/stop/REASON), episodes/env_tokens (the tools' tokens per episode), episodes/policy_token_frac (of
    the response tokens, those in the loss) and time/tools (seconds in the environments, this rank's)."""
    from align.rollout.episode import STOPS

    eps = [c.episode for c in r.completions]
    if not eps or None in eps:  # single-turn completions: nothing to record
        return
    n = len(eps)
    calls = sum(e.tool_calls for e in eps)
    stats.mean("tools/call_frequency", calls, n)
    stats.mean("tools/failure_frequency", sum(e.tool_errors for e in eps), calls)
    stats.mean("num_turns/mean", sum(e.turns for e in eps), n)
    for why in STOPS:
        stats.mean(f"episodes/stop/{why}", sum(e.stop == why for e in eps), n)
    env = sum(e.env_tokens for e in eps)
    stats.mean("episodes/env_tokens", env, n)
    policy = sum(len(c.ids) for c in r.completions) - env
    stats.mean("episodes/policy_token_frac", policy, policy + env)
    stats.value("time/tools", sum(e.tool_seconds for e in eps))


def select(batch: dict, idx) -> dict:
    """Rows `idx` (a slice or row indices) of a batch, with their images (align.vision.select_rows)."""
    return vision.select_rows(batch, idx)


@contextlib.contextmanager
def timed(times: dict, key: str):
    """times[key] = the seconds the block took (a phase of an RL step: time/generate, time/update, ...); on a GPU
    also times["memory/<phase>"] = the peak GiB allocated during it (which phase sets the run's peak)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        runtime.reset_peak()
    t = time.time()
    with torch.profiler.record_function(key):  # a named range in a profile (benchmarks.profile_step's phases)
        yield
    times[key] = time.time() - t
    if cuda:
        times["memory/" + key.split("/", 1)[-1]] = torch.cuda.max_memory_allocated() / 2**30


def distinct_n(sequences: list[list[int]], n: int) -> float:
    """Distinct-n (Li et al. 2016): unique n-grams / total n-grams over a set of generations."""
    unique, total = set(), 0
    for s in sequences:
        grams = list(zip(*(s[i:] for i in range(n))))
        unique.update(grams)
        total += len(grams)
    return len(unique) / total if total else 0.0
