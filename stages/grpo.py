"""GRPO / RLVR: G samples per prompt, verifiable rewards, group-relative advantages, clipped policy update.

Per step (Shao et al. 2024, with DAPO's and Dr. GRPO's options):
  1. rollout: G completions for each of P prompts from π_θ;
  2. score: r_pg = Σ_k w_k · f_k(prompt_p, completion_pg, **row_p) (+ w_RM · RM(prompt_p, completion_pg), the
     normalised score of an `align rm train` artifact, with --reward-model; + optional overlong penalty);
  3. advantages A_pg from the group of prompt p (the estimator registered as --advantage); groups with no reward variance
     carry no signal (A = 0) and leave the loss with --drop-zero-std-groups (DAPO dynamic sampling, without
     the resampling): their terms go (the KL's too), their tokens stay in --loss-agg's normaliser, so a step
     with few informative groups is not scaled up (the normaliser of TRL's and verl's token-mean);
  4. update, --num-iterations times over the batch: ρ = π_θ/π_old, per token
     −min(ρA, clip(ρ, 1−ε, 1+ε_high)A) + β·k3(π_θ, π_ref), aggregated by --loss-agg over the global batch
     (the policy loss registered as --loss: clip; CISPO's −sg(clip(ρ))·A·log π; gspo, GSPO's one clipped
     length-normalised ratio per sequence, alias --ratio sequence; reinforce, nanochat's on-policy −A·log π,
     alias --reinforce).
The estimators and losses are align.objectives' registries: a new one is a registered function.
Log-probs are taken at the sampling temperature, as sampled.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from align import data as D
from align import objectives, runtime, tools
from align.artifacts import describe_inputs
from align.console import info
from align.engine.build import Optim, rows_within
from align.engine.plan import (DECODER, Data, Device, Family, Model, Plan, RLPlan, Setup, decoder_terms, frozen_weights,
                               judge_terms, judge_tokens, memory_changes, micro_changes, model_state, nproc_changes,
                               reference_model, rollout_changes, rollout_terms, score_terms, trained_model,
                               update_terms, zero3_blocks)
from align.engine.run import Output, step_indices, train
from align.engine.stats import Stats
from align.errors import UserError
from align.judge import RUBRIC, judge_model, judged_records, the_judge, watched
from align.logprobs import batched_logprobs, logprobs
from align.routing_replay import routing_replay
from align.models import context_length, count_parameters, disable_dropout, load_causal_lm, load_tokenizer, resolve
from align.objectives.advantages import zero_spread
from align.objectives.grpo import GRPOBatch, GRPOCoefs, grpo_loss
from align.reward_model import load_reward_model, require_trained, score
from align.rewards import RewardError, call_rewards, parse_rewards, probe
from align.rollout import disagg
from align.rollout.batch import (Rollout, record_completions, record_episodes, record_mismatch, rollout_sampling, sample,
                                 select, timed)
from align.rollout.evaluation import (evaluate_policy, fitting, fitting_rows, held_out_verifier, save_eval_samples,
                                      verifier_note)
from align.rollout.generation import Sampling
from align.rollout.queue import LocalSampler, Rollouts
from align.rollout.sampling import derive
from stages.grpo_config import GRPOConfig  # the options (light: no torch), re-exported


def rewards_of(cfg: GRPOConfig, fns: list, rows: list[dict], completions: list) -> list[tuple[float | None, dict]]:
    """`reward` of each completion (completions[i] of data row rows[i]) under the reward functions `fns`
    (parse_rewards): each function called on them all (a batched one once), then their values summed per
    sample."""
    texts, ids = [c.text for c in completions], [c.ids for c in completions]
    answers = [c.answer for c in completions]  # a built-in verifier grades an episode's last turn, yours all of it
    table = [call_rewards(r, rows, texts if r.path else answers, ids, cfg.reward_timeout) if r.fn is not None
             else [None] * len(texts) for r in fns]
    return [reward(cfg, fns, [values[i] for values in table], c) for i, c in enumerate(completions)]


def reward(cfg: GRPOConfig, fns: list, values: list, c) -> tuple[float | None, dict]:
    """(Σ w_k f_k + overlong penalty, {name: f_k}) of completion `c`, values[k] being what function fns[k]
    returned for it (call_rewards: a number, None — TRL's "does not apply": left out of the sum and of
    rewards/NAME — or a RewardError). None when a function failed and --on-reward-error is skip, or when every
    function returned None and no --reward-model scores it (TRL's unscorable sample: left out as a skipped one is,
    not counted as an error). A failure under skip or zero is counted in parts["errors"]. An episode a tool ended
    by failing (stop "tool_error": align.tools.functions) is skipped under skip and scores 0 otherwise (fail too:
    a tool's failure never stops the run), counted in parts["errors"]."""
    if c.episode and c.episode.stop == "tool_error":  # a tool hung, crashed or returned garbage: never the run
        return (None if cfg.on_reward_error == "skip" else 0.0), {"errors": 1.0}
    parts, total, scored = {"errors": 0.0}, 0.0, False
    for r, v in zip(fns, values):
        if r.fn is None:  # a group reward (length), added per group in score()
            continue
        if isinstance(v, RewardError):
            if cfg.on_reward_error == "fail":
                raise UserError(f"{v}. {v.fix()}") from None
            if cfg.on_reward_error == "skip":
                return None, {"errors": 1.0}
            v, parts["errors"] = 0.0, 1.0
        if v is None:
            continue
        scored = True
        parts[r.name] = v
        total += r.weight * v
    env_fn = next((r for r in fns if r.name == "env"), None)
    if env_fn and c.episode and c.episode.env_reward is not None:  # --reward env: what the environment gave
        scored, parts["env"] = True, c.episode.env_reward
        total += env_fn.weight * c.episode.env_reward
    if not scored and not cfg.reward_model:
        return None, parts
    if cfg.overlong_cache:
        n = len(c.policy_ids) if c.finished else cfg.max_new_tokens + 1
        overlong = objectives.get("shaping", "overlong").fn
        total += overlong([n], max_len=cfg.max_new_tokens, cache=cfg.overlong_cache)[0]
    return total, parts


def announce(algo, world: int, n_local: int) -> None:
    """The run's first line: the model, the batch, the rewards, the reference, teacher and tools."""
    cfg, layout = algo.cfg, algo.run.layout
    info(f"grpo: {count_parameters(algo.policy.module) / 1e6:.2f}M parameters, {len(algo.rows)} prompts, "
         f"{cfg.prompts_per_step} prompts x G={cfg.num_generations} per step, {world} process(es), "
         f"ZeRO-{layout.zero_stage}, {layout.precision}, micro batch {algo.micro} x {n_local // algo.micro}, "
         f"rewards {', '.join(f'{r.name}:{r.weight:g}' for r in algo.reward_fns)}"
         f"{f', reward model {cfg.reward_model}:{cfg.reward_model_weight:g}' if algo.rm else ''}, "
         f"reference model {'on (beta ' + str(cfg.beta) + ')' if algo.reference else 'off (beta 0)'}"
         f"{f', teacher {cfg.teacher} (distill coef {cfg.distill_coef:g})' if algo.teacher else ''}"
         f"{f', tools {cfg.tools or cfg.env} (up to {cfg.max_turns} turns)' if algo.agent else ''}")


def judged_eval(fns: list, records: list[dict], history: dict, step: int) -> tuple[list[dict], dict]:
    """With a judge among --reward: each held-out greedy answer's judge score in its record ("judge"), and what
    RLMonitor's reward_hacking_heldout reads beside the verified pass rate: eval/reward, the judge's mean score of
    those answers (the proxy), and eval/kl, the latest step's KL to the reference (0 before training; NaN with
    --beta 0, where none is measured). Without a judge: the records as they are, no metrics."""
    judge = the_judge(fns)
    if judge is None or not records:
        return records, {}
    records, proxy = judged_records(judge, records)
    return records, {"eval/reward": proxy, "eval/kl": history.get("kl", [math.nan])[-1] if step else 0.0}


@dataclass(frozen=True)
class GRPOPlan(RLPlan):
    """GRPO in the memory plan: the rollout of G samples per prompt (or, with --rollout-gpus, a decoder rank's
    column), the no-gradient passes of π_old, the reference, the teacher and the reward model, and the update;
    under LoRA on a GPU a micro-batch left at 0 keeps the update within the rollout's memory."""

    cfg: GRPOConfig
    name: ClassVar[str] = "grpo"
    lora_within_rollout: ClassVar[bool] = True

    @property
    def checkpointing(self) -> bool:
        return self.cfg.gradient_checkpointing

    @property
    def decoders(self) -> int:
        return max(self.cfg.rollout_gpus, 0)  # (its auto value -1 is resolved before the run)

    def models(self) -> dict[str, str]:
        cfg = self.cfg
        judge = judge_model(cfg.reward)
        return {"policy": cfg.model, **({"teacher": cfg.teacher} if cfg.teacher else {}),
                **({"reward model": cfg.reward_model} if cfg.reward_model else {}),
                **({"judge": judge} if judge else {})}

    def phases(self) -> tuple[str, ...]:
        return (DECODER if self.decoders else "rollout", "score", "update")

    def micro_rows(self, world: int, data: Data) -> tuple[int, int]:
        return self._rows(world, self.cfg.micro_batch_size, data)

    def batch(self, world: int, micro_batch_size: int, data: Data) -> tuple[int, int]:
        micro, n = self._rows(world, micro_batch_size, data)
        if n % micro:
            raise UserError(f"--micro-batch-size {micro} must divide the {n} sequences per process and step.")
        return micro, n // micro

    def _rows(self, world: int, micro_batch_size: int, data: Data) -> tuple[int, int]:
        """(rows per micro-batch: `micro_batch_size`, or (0) as many as --micro-batch-tokens allows; the
        sequences per process and step)."""
        cfg = self.cfg
        n = cfg.prompts_per_step // world * cfg.num_generations
        longest = data.prompt() + cfg.episode_tokens
        return min(micro_batch_size or rows_within(n, longest, cfg.micro_batch_tokens), n), n

    def terms(self, plan: Plan, models: dict[str, Model], s: Setup, data: Data) -> None:
        cfg, a, prompt = self.cfg, models["policy"].arch, data.prompt()
        micro, n = self.micro_rows(s.world, data)
        policy = trained_model(cfg, "policy", a)
        plan.add_state(policy, s)
        ref = reference_model(plan, models, cfg.lora_r) if cfg.beta else None
        others = ([ref] if ref else []) + frozen_weights(plan, models, ("teacher", "reward model"), s)
        if ref:
            plan.add("reference: weights", model_state(ref, s)["weights"])
        if self.decoders:
            decoder_terms(plan, policy, self.decoders, cfg.prompts_per_step * cfg.num_generations, prompt,
                          cfg.episode_tokens, s)
        else:
            rollout_terms(plan, policy, n, prompt, cfg.episode_tokens, s)
        score_terms(plan, ([policy] if cfg.num_iterations > 1 else []) + others, micro, prompt + cfg.episode_tokens, s)
        judge_terms(plan, models, n, judge_tokens(cfg.rubric() or RUBRIC, prompt, cfg.episode_tokens), s, "score")
        zero3_blocks(plan, [policy, *others], s)
        update_terms(plan, a, micro, prompt + cfg.episode_tokens, s)

    def changes(self, device: Device, data: Data) -> Iterator[Family]:
        """No decoder ranks (every process trains), a smaller micro-batch, gradient checkpointing, LoRA, optimizer
        offload, a smaller rollout, more processes."""
        if self.decoders:
            yield [({"rollout_gpus": 0}, replace(device, world=device.world + self.decoders))]
        yield micro_changes(self, device, data)
        if not self.cfg.gradient_checkpointing:
            yield [({"gradient_checkpointing": True}, device)]
        yield from memory_changes(self.cfg, device)
        yield from rollout_changes(self.cfg, device)
        yield nproc_changes(self, device)


class GRPO:
    progress = ("reward", "frac_reward_zero_std", "eval/pass@1/greedy")
    eval_at_start = True

    def __init__(self, cfg: GRPOConfig, run):
        cfg = run.cfg  # as the run resolved it: --rollout-gpus, --lr, --warmup-steps left to it made concrete
        self.cfg, self.run = cfg, run
        source = resolve(cfg.model)
        self.reward_fns = parse_rewards(cfg.reward, judge_rubric=cfg.rubric())
        self.rows = D.load_rows(cfg.data, "prompts", cfg.columns)
        self.rows, split = D.split_off(self.rows, cfg.eval_split, cfg.data)
        self.tok = load_tokenizer(source, cfg.trust_remote_code, cfg.chat_template)
        # each reward function on the first rows: a wrong signature or return fails here, before any model is built
        probe(self.reward_fns, self.rows, timeout=cfg.reward_timeout, tokenizer=self.tok, where=cfg.data)
        # your tools' sandbox started (their file loaded, their schemas read) before any model is built
        self.agent = tools.agent(cfg.tools, cfg.max_new_tokens, cfg.max_turns, cfg.max_tool_tokens,
                                 cfg.tool_timeout, cfg.env, tokenizer=self.tok)
        self.eval_rows = fitting_rows(D.load_rows(cfg.eval_data, "verifiable", cfg.columns, limit=cfg.eval_samples,
                                                  held_out=True) if cfg.eval_data and cfg.eval_samples else
                                      D.verifiable_rows(split[: cfg.eval_samples], cfg.data),
                                      self.tok, source, cfg.episode_tokens, cfg.eval_data or cfg.data)
        self.verifier = held_out_verifier(cfg.verifier, self.eval_rows, self.tok, cfg.eval_data or cfg.data)
        rm_source = require_trained(resolve(cfg.reward_model, expect="reward"), cfg.reward_model) if cfg.reward_model else None
        self.rm_tok = load_tokenizer(rm_source, cfg.trust_remote_code) if rm_source else None
        schemas = self.agent and self.agent.schemas  # tools the chat template shows in the prompt
        self.rows, self.prompt_ids = fitting(self.rows, D.encode_prompts(self.tok, [r["prompt"] for r in self.rows],
                                                                         schemas),
                                             context_length(source), cfg.episode_tokens, cfg.data)

        teacher_source = resolve(cfg.teacher, expect="policy") if cfg.teacher else None
        if teacher_source and load_tokenizer(teacher_source, cfg.trust_remote_code).get_vocab() != self.tok.get_vocab():
            raise UserError(f"--teacher {cfg.teacher}: its tokenizer is not the policy's; per-token distillation "
                            "compares the two models on the same tokens.")

        inputs = describe_inputs(source, cfg.data, cfg.eval_data)
        if rm_source:
            inputs["reward_model"] = describe_inputs(rm_source)["model"]
        if teacher_source:
            inputs["teacher"] = describe_inputs(teacher_source)["model"]
        if judge_model(cfg.reward):  # --reward judge:MODEL
            inputs["judge"] = describe_inputs(resolve(judge_model(cfg.reward), expect=None))["model"]
        if cfg.prompts_per_step % runtime.world_size():
            raise UserError(f"--prompts-per-step {cfg.prompts_per_step} must be a multiple of {runtime.world_size()} processes.")
        n_local = cfg.prompts_per_step // runtime.world_size() * cfg.num_generations
        run.choose_verifier(self.verifier)
        dist = run.open(inputs, GRPOPlan(cfg), lora=(source,), prompt_tokens=max(map(len, self.prompt_ids), default=0),
                        notes=verifier_note(self.verifier))
        self.micro = run.layout.micro
        self.policy = run.train("policy", self.load_policy(source),
                                # β2 = 0.999 (not SFT's 0.95): policy gradients are noisy, a longer memory keeps steps small
                                Optim(cfg.lr, cfg.max_steps, cfg.warmup_steps, cfg.schedule, cfg.weight_decay, (0.9, 0.999)),
                                micro=self.micro, accum=n_local // self.micro)
        self.reference = run.reference(self.policy, self.load_policy(source)) if cfg.beta else None
        self.teacher = run.frozen(self.load_policy(teacher_source)) if cfg.teacher else None
        self.rm = (run.frozen(lambda dtype: load_reward_model(rm_source, self.rm_tok, dtype, cfg.seed,
                                                              cfg.trust_remote_code)) if rm_source else None)
        self.sampling = rollout_sampling(cfg, self.policy.eng)
        self.beta = cfg.beta  # the KL weight (an --on-alarm rollback may raise it)
        self.rollouts = self.rollout_queue()
        self.stale = False  # the rollout being trained on was sampled from older weights
        announce(self, dist.world_size, n_local)

    def load_policy(self, source):
        cfg = self.cfg

        def load(dtype):
            model = disable_dropout(load_causal_lm(source, self.tok, dtype, cfg.seed, cfg.trust_remote_code))
            if cfg.gradient_checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return model

        return load

    # ---- 1. rollout

    def rollout_queue(self) -> Rollouts:
        """Where each step's rollout comes from: the policy engine samples it, in the step (--max-staleness 0: the
        synchronous algorithm) or K steps ahead (--max-staleness K), or decoder ranks do (--rollout-gpus)."""
        cfg = self.cfg
        if cfg.max_staleness and not cfg.tis_cap:
            info(f"--max-staleness {cfg.max_staleness} without --tis-cap: the stale samples' loss is not reweighted by "
                 "π_train / π_sampler")
        if cfg.rollout_gpus:
            info(f"rollouts: {cfg.rollout_gpus} of {disagg.world()} processes decode, the others train; each step trains "
                 f"on a rollout {cfg.max_staleness} update(s) old (--max-staleness), TIS cap {cfg.tis_cap:g} "
                 "(--rollout-gpus 0: every process samples and trains, on-policy)")
            sampler = disagg.RemoteSampler(self.policy.eng, self.run.dist, self.step_prompts, self.sampling_of,
                                           cfg.num_generations, self.step_rows if self.agent else None)
        else:
            sampler = LocalSampler(lambda step: self.local_rollout(step).completions)
        return Rollouts(cfg.max_staleness, cfg.max_steps, sampler)

    def sampling_of(self, step: int) -> Sampling:
        """The sampling settings of rollout `step`: its samples are keyed by (seed, step)."""
        return replace(self.sampling, seed=derive(self.cfg.seed, step))

    def local_rollout(self, step: int) -> Rollout:
        """This rank's share of rollout `step`, sampled now by the policy engine."""
        cfg = self.cfg
        idx = self.run.indices(len(self.rows), cfg.prompts_per_step, step)
        return sample(self.policy.eng, self.tok, [self.rows[i] for i in idx], [self.prompt_ids[i] for i in idx],
                      cfg.num_generations, self.sampling_of(step), self.run.dist, cfg.gather, self.agent)

    def step_prompts(self, step: int) -> list[list[int]]:
        """The token ids of every prompt of rollout `step` (all ranks')."""
        return [self.prompt_ids[i] for i in step_indices(len(self.rows), self.cfg.prompts_per_step, step, self.cfg.seed)]

    def step_rows(self, step: int) -> list[dict]:
        """The data rows of every prompt of rollout `step` (episodes' environments are made of them)."""
        return [self.rows[i] for i in step_indices(len(self.rows), self.cfg.prompts_per_step, step, self.cfg.seed)]

    # ---- 2. rewards

    def score(self, r: Rollout) -> None:
        """r.rewards [P, G], r.valid [P, G] and r.parts (per reward function)."""
        G = r.group_size
        results = rewards_of(self.cfg, self.reward_fns, r.sample_rows, r.completions)
        r.valid = r.grouped(torch.tensor([float(v is not None) for v, _ in results]))
        r.rewards = r.grouped(torch.tensor([v if v is not None else 0.0 for v, _ in results]))
        length_fn = next((f for f in self.reward_fns if f.name == "length"), None)
        if length_fn is not None:  # Kimi k1.5: shorter correct answers earn more, within each group
            for p in range(len(r.rows)):
                group = range(p * G, (p + 1) * G)
                correct = [results[j][1].get("math") == 1.0 for j in group]
                lengths = [len(r.completions[j].policy_ids) for j in group]
                shaped = objectives.get("shaping", "length").fn(lengths, correct)
                r.rewards[p] += length_fn.weight * torch.tensor(shaped)
        if self.rm is not None:  # every rank scores its equal share (ZeRO-3 forwards are collective)
            rm = score(self.rm, self.rm_tok, r.prompts, [c.text for c in r.completions], self.micro).float().cpu()
            r.rewards += self.cfg.reward_model_weight * r.grouped(rm)
            for (_, parts), v in zip(results, rm.tolist()):
                parts["reward_model"] = v
        # every function's name on every rank (a name none of a rank's samples has still enters the all-reduce)
        r.parts = {"errors": [], **{f.name: [] for f in self.reward_fns if f.fn is not None}, **r.parts}
        for _, parts in results:
            for k, v in parts.items():
                r.parts.setdefault(k, []).append(v)
        r.watched = watched(self.reward_fns, [parts for _, parts in results], self.rm is not None)

    # ---- 3. advantages

    def advantages(self, r: Rollout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(A [P, G], keep [P, G]: the samples whose terms enter the loss, counted [P, G]: the samples its
        normaliser counts, zero_std [P]: groups without signal). Skipped samples (r.valid 0) take no part in
        their group's statistics nor in the loss; --mask-truncated takes truncated samples out of both the loss
        and its normaliser (DAPO's overlong filtering); --drop-zero-std-groups takes the groups without signal
        out of the loss only: their A is 0, so what dropping changes is the KL term, not the scale of the step."""
        device = self.run.dist.device
        adv = objectives.get("advantage", self.cfg.advantage).fn(
            r.rewards, r.valid, reduce=lambda t: runtime.all_reduce_sum(t.to(device)).cpu())
        zero_std = zero_spread(r.rewards, r.valid).float()
        no_signal = ((adv != 0) & r.valid.bool()).sum(dim=1) == 0  # = zero_std, except under reinforce++
        counted = r.valid.clone()
        if self.cfg.mask_truncated:
            counted *= r.finished
        keep = counted * (~no_signal).float()[:, None] if self.cfg.drop_zero_std_groups else counted
        return adv, keep, counted, zero_std

    # ---- 4. update

    def update(self, batch: dict, adv: torch.Tensor, old_logp, ref_logp, n_tokens: float, n_seqs: float,
               stats: Stats) -> None:
        cfg = self.cfg
        n = batch["input_ids"].shape[0]
        coefs = GRPOCoefs(cfg.policy_loss, cfg.epsilon, cfg.epsilon_high, self.beta, cfg.tis_cap, cfg.distill_coef,
                          cfg.loss_agg, cfg.max_new_tokens)
        for it in range(cfg.num_iterations):
            for i in range(0, n, self.micro):
                sl = slice(i, i + self.micro)
                mb = select(batch, sl)
                logp, ent = logprobs(self.policy, mb, temperature=cfg.temperature, with_entropy=(it == 0), pack=cfg.packing)
                old = old_logp[sl] if old_logp is not None else logp.detach()
                loss, metrics = grpo_loss(GRPOBatch(logp, old, adv[sl], mb["loss_mask"],
                                                    ref_logp[sl] if ref_logp is not None else None,
                                                    mb.get("sampler_logp"), mb.get("teacher_logp"),
                                                    mb.get("counted_mask")), coefs, n_tokens=n_tokens, n_seqs=n_seqs)
                self.policy.backward(loss)
                # clipping over every pass (the first is at ratio 1 unless the rollout is stale); kl and the
                # distillation KL of the first pass
                for name, (x, m) in metrics.items():
                    if name.startswith("clip_ratio") or it == 0:
                        stats.mean(name, (x.detach().float() * m).sum(), m.sum())
                if it == 0:
                    stats.sum("loss", loss)
                    record_mismatch(stats, mb, old, "rollout/stale_" if self.stale else "rollout/")
                    # over every sampled token, the dropped groups' too: measured even when no group has signal
                    stats.mean("entropy", (ent * mb["response_mask"]).sum(), mb["response_mask"].sum())

    # ---- the step: 1-4

    def step(self, step: int) -> Stats:
        """Rollout `step` (align.rollout.queue: sampled now from the current weights, or ahead of its step from
        older ones, or by decoder ranks), then its rewards, advantages and update."""
        cfg, stats, times = self.cfg, Stats(), {}
        pending = self.rollouts.before_update(step, times)
        idx = self.run.indices(len(self.rows), cfg.prompts_per_step, step)
        r = Rollout([self.rows[i] for i in idx], pending.completions, cfg.num_generations)
        self.stale = pending.version != step
        with routing_replay(self.policy.eng, cfg.routing_replay, stats):  # through the backward: recomputes too
            zero_std = self.learn(r, stats, times)
        self.rollouts.after_update(times)
        if not self.rollouts.synchronous:
            stats.value("rollout/staleness", step - pending.version)
        if cfg.rollout_gpus:
            times["time/wait_decoder"] = pending.idle
        self.record(r, zero_std, stats, times)
        return stats

    def learn(self, r: Rollout, stats: Stats, times: dict) -> torch.Tensor:
        """Score rollout `r` and update the policy on it; returns its groups without reward spread."""
        cfg, dist = self.cfg, self.run.dist
        with timed(times, "time/reward"):
            self.score(r)
            adv, keep, counted, zero_std = self.advantages(r)
        with timed(times, "time/logprobs"):
            batch = r.batch(self.tok.pad_token_id, dist.device)
            batch["loss_mask"] = batch["response_mask"] * keep.flatten().to(dist.device)[:, None]
            counted_mask = batch["response_mask"] * counted.flatten().to(dist.device)[:, None]
            old_logp = (batched_logprobs(self.policy, batch, self.micro, cfg.temperature, pack=cfg.packing)
                        if cfg.num_iterations > 1 else None)
            ref_logp = batched_logprobs(self.reference, batch, self.micro, cfg.temperature, pack=cfg.packing) if self.reference else None
            if self.teacher is not None:  # the teacher scores every counted sample, dropped groups' too
                batch["teacher_logp"] = batched_logprobs(self.teacher, batch, self.micro, cfg.temperature, pack=cfg.packing)
                batch["counted_mask"] = counted_mask
            n_tokens, n_seqs, n_kept = runtime.all_reduce_sum(torch.stack([
                counted_mask.sum(), counted.sum().to(dist.device), batch["loss_mask"].sum()])).tolist()
            stats.value("kept_token_frac", n_kept / max(n_tokens, 1.0))
        with timed(times, "time/update"):
            self.update(batch, adv.flatten().to(dist.device), old_logp, ref_logp, n_tokens, n_seqs, stats)
        # the samples that teach the policy something (RLMonitor's no_signal rule): a non-zero advantage in the
        # loss, or, with a teacher, the distillation term every counted sample carries
        signal = counted.bool() & ((adv != 0) | (self.teacher is not None))
        stats.mean("signal_frac", signal.sum(), signal.numel())
        return zero_std

    def record(self, r: Rollout, zero_std: torch.Tensor, stats: Stats, times: dict) -> None:
        """The step's rollout metrics (TRL's names), reduced over the ranks with the update's."""
        lengths = r.lengths
        stats.mean("reward", (r.rewards * r.valid).sum(), r.valid.sum())  # skipped samples have no reward
        stats.std("reward_std", r.rewards[r.valid.bool()])
        stats.mean("frac_reward_zero_std", zero_std.sum(), len(zero_std))
        record_completions(stats, r)
        if self.agent:
            record_episodes(stats, r)
        stats.sum("completions/tokens_per_s", lengths.sum() / max(times["time/generate"], 1e-9))
        stats.sum("tokens", lengths.sum())  # sampled and trained on: the run logs tokens_per_s of the whole step
        for k, v in r.parts.items():  # NaN: a function that applied to no sample of the step (TRL's nanmean)
            stats.mean(f"rewards/{k}", sum(v), len(v), math.nan)
        for k, v in r.watched.items():  # proxy_reward, gold_reward: a learned scorer's and a verifier's
            stats.mean(k, sum(v), len(v), math.nan)
        for k, v in times.items():
            stats.value(k, v)

    # ---- --on-alarm rollback and resumable state

    def raise_kl(self, factor: float) -> str | None:
        """β ×factor; None when β is 0 (no reference model is loaded: nothing to raise)."""
        if not self.beta:
            return None
        old, self.beta = self.beta, self.beta * factor
        return f"beta {old:g} -> {self.beta:g}"

    def state_dict(self) -> dict:
        """β, and the rollouts sampled ahead of their step (collective: every rank's; none when synchronous)."""
        return {"beta": self.beta, **({} if self.rollouts.synchronous else {"rollouts": self.rollouts.state_dict()})}

    def load_state_dict(self, state: dict) -> None:
        self.beta = state.get("beta", self.cfg.beta)
        self.rollouts.load_state_dict(state.get("rollouts") or [[] for _ in range(self.run.dist.world_size)])

    # ---- evaluation and the end

    def evaluate(self, step: int) -> dict:
        if not self.eval_rows:
            return {}
        ks = self.cfg.ks()
        m, recs = evaluate_policy(self.policy.eng, self.tok, self.eval_rows, self.run.dist, ks=ks, samples=max(ks),
                                  sampling=replace(self.sampling, seed=self.cfg.seed, precision="", routes=False), gather=self.cfg.gather,
                                  verifier=self.verifier, agent=self.agent)
        recs, judged = judged_eval(self.reward_fns, recs, self.run.monitor.history, step)
        save_eval_samples(self.run.out, step, recs, self.run.dist)
        return {**{f"eval/{k}": v for k, v in m.items()}, **judged}

    def final_metrics(self, last: dict, start: dict) -> dict:
        final = {**{f"start/{k[5:]}": v for k, v in start.items()},
                 **{k: v for k, v in last.items() if k.startswith("eval/")}, "reward": last["reward"]}
        if "eval/pass@1/greedy" in last and "eval/pass@1/greedy" in start:
            final["gain/pass@1/greedy"] = last["eval/pass@1/greedy"] - start["eval/pass@1/greedy"]
        return final

    def output(self) -> Output:
        return Output(self.policy.eng, self.tok, extra={"rollout_gpus": self.cfg.rollout_gpus} if self.cfg.rollout_gpus else {})

    def close(self, failed: bool = False) -> None:
        """The decoder ranks stop (--rollout-gpus); `failed`: the bridge is dropped without a word to them. Your
        tools' sandbox stops (--tools FILE.py:fn)."""
        self.rollouts.sampler.close(failed)
        if self.agent:
            self.agent.close()


def run(cfg: GRPOConfig) -> dict:
    resolved = cfg.resolved()
    if resolved.rollout_gpus and not cfg.plan and disagg.split(resolved.rollout_gpus):  # --plan: one process plans them all
        return decoder(resolved)
    return train(cfg, "grpo", GRPO)  # (StageRun resolves it, and says what it chose)


def decoder(cfg: GRPOConfig) -> dict:
    """A --rollout-gpus process: the policy's architecture (LoRA adapters included), then rollouts on request."""
    from align.engine.build import compute_dtype, resolve_precision
    from align.lora import with_lora
    from align.models import mark_autocast

    source = resolve(cfg.model)
    tok = load_tokenizer(source, cfg.trust_remote_code, cfg.chat_template)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    precision = resolve_precision(device, cfg.precision)

    def load(dtype):
        model = disable_dropout(load_causal_lm(source, tok, dtype, cfg.seed, cfg.trust_remote_code))
        mark_autocast(model, {"torch_autocast": {"enabled": precision == "bf16-mixed"}})
        return model

    # --tools / --env: the decoder runs the episodes, their environments (a sandbox's worker) beside it
    agent = tools.agent(cfg.tools, cfg.max_new_tokens, cfg.max_turns, cfg.max_tool_tokens, cfg.tool_timeout, cfg.env,
                        tokenizer=tok)
    disagg.serve(with_lora(load, cfg), tok, compute_dtype(device, precision), agent)
    return {}
