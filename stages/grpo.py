"""GRPO / RLVR: G samples per prompt, verifiable rewards, group-relative advantages, clipped policy update.

Per step (Shao et al. 2024, with DAPO's and Dr. GRPO's options):
  1. sample G completions for each of P prompts from π_θ (the shared generation path);
  2. reward r_ij = Σ_k w_k · f_k(prompt_i, completion_ij, **row_i) (+ w_RM · RM(prompt_i, completion_ij), the
     normalised score of an `align rm train` artifact, with --reward-model; + optional overlong penalty);
  3. advantages A_ij from the group of prompt i (zscore | mean | batch); groups with no reward variance carry
     no signal and are dropped from the loss with --drop-zero-std-groups (DAPO dynamic sampling);
  4. --num-iterations updates on the batch: ρ = π_θ/π_old, loss = −min(ρA, clip(ρ, 1−ε, 1+ε_high)A)
     + β·k3(π_θ, π_ref), aggregated by --loss-agg; --reinforce is nanochat's on-policy −A·log π instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from align.config import TrainedStageConfig, opt
from align.errors import UserError
from align.paths import DATA_DIR


@dataclass
class GRPOConfig(TrainedStageConfig):
    out: str = opt("runs/grpo", "Output artifact directory.", path=True)
    data: str = opt(str(DATA_DIR / "arithmetic/train.jsonl"), "Prompts with answers: {prompt, answer, ...}.", path=True)
    eval_data: str = opt(str(DATA_DIR / "arithmetic/test.jsonl"), "Held-out verifiable data for pass@k.", path=True)
    columns: str = opt("", "Rename columns: old=new,old2=new2.")
    reward: list[str] = opt(["math"], "Reward NAME[:WEIGHT] or file.py:FUNCTION[:WEIGHT]; repeat for several.")
    reward_model: str = opt("", "An `align rm train` artifact as one more reward: its normalised score of prompt + "
                                "completion, times --reward-model-weight, added to --reward's ('' : none).", path=True)
    reward_model_weight: float = opt(1.0, "Weight of the --reward-model score.")
    on_reward_error: str = opt("fail", "A reward that raises or returns NaN/non-number: fail, skip (drop the "
                                       "sample) or zero.")
    max_steps: int = opt(150, "Optimiser steps (batches of rollouts x --num-iterations).")
    prompts_per_step: int = opt(16, "Prompts per step (all processes).")
    num_generations: int = opt(8, "G: completions per prompt.")
    max_new_tokens: int = opt(48, "Completion budget (tokens).")
    temperature: float = opt(1.0, "Sampling temperature.")
    top_k: int = opt(0, "Top-k sampling (0: off).")
    top_p: float = opt(1.0, "Top-p sampling (1: off).")
    lr: float = opt(5e-5, "Learning rate (AdamW, constant after warmup).")
    warmup_steps: int = opt(5, "Linear warmup steps.")
    grad_clip: float = opt(1.0, "Gradient clipping (global norm).")
    advantage: str = opt("zscore", "zscore ((r-mean)/std, GRPO), mean (r-mean, Dr. GRPO) or batch (batch std).")
    loss_agg: str = opt("token-mean", "seq-mean-token-mean (GRPO), token-mean (DAPO) or seq-sum (Dr. GRPO).")
    epsilon: float = opt(0.2, "Clip range below 1 (and above, unless --epsilon-high).")
    epsilon_high: float = opt(0.28, "Clip range above 1 (DAPO clip-higher).")
    num_iterations: int = opt(1, "Updates per rollout batch (π_old ≠ π_θ after the first).")
    beta: float = opt(0.0, "KL(π_θ‖π_ref) weight, k3 estimator; 0 loads no reference model.")
    reinforce: bool = opt(False, "nanochat's on-policy REINFORCE: −A·log π with the group-mean baseline; "
                                 "no ratio, clip or KL.")
    drop_zero_std_groups: bool = opt(True, "Drop groups whose rewards are all equal (no signal) from the loss.")
    mask_truncated: bool = opt(False, "Drop completions that hit --max-new-tokens without EOS from the loss.")
    overlong_cache: int = opt(0, "Soft overlong penalty over the last N tokens of the budget (DAPO); 0: off.")
    micro_batch_size: int = opt(32, "Sequences per forward per process.")
    eval_every: int = opt(0, "pass@k on the held-out split every N steps (always at start and end; 0: only then).")
    eval_samples: int = opt(200, "Held-out problems for pass@k.")
    eval_k: str = opt("1,4,8", "pass@k values (samples per problem = max k).")
    gather: bool = opt(True, "ZeRO-3: gather weights once per generation phase (off: synced_gpus).")
    gradient_checkpointing: bool = opt(False, "Recompute activations in the backward (less memory, more compute).")
    monitor: str = opt("", "TOML file with RLMonitor rule overrides.", path=True)

    def validate(self):
        from align.rl import ADVANTAGE_MODES, LOSS_AGGREGATIONS

        if self.advantage not in ADVANTAGE_MODES:
            raise UserError(f"--advantage must be one of {', '.join(ADVANTAGE_MODES)}, not {self.advantage!r}.")
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise UserError(f"--loss-agg must be one of {', '.join(LOSS_AGGREGATIONS)}, not {self.loss_agg!r}.")
        if self.on_reward_error not in ("fail", "skip", "zero"):
            raise UserError(f"--on-reward-error must be fail, skip or zero, not {self.on_reward_error!r}.")
        if self.num_generations < 2:
            raise UserError("--num-generations must be >= 2: advantages are relative to the group.")
        if self.reinforce and (self.num_iterations != 1 or self.beta):
            raise UserError("--reinforce is on-policy without KL: use it with --num-iterations 1 and --beta 0.")
        if self.max_steps <= 0 or self.prompts_per_step <= 0:
            raise UserError("--max-steps and --prompts-per-step must be positive.")

    def ks(self) -> list[int]:
        try:
            return sorted({int(k) for k in self.eval_k.split(",") if k.strip()})
        except ValueError:
            raise UserError(f"--eval-k must be comma-separated integers, not {self.eval_k!r}.") from None


def run(cfg: GRPOConfig) -> dict:
    import random
    import time
    from pathlib import Path

    import torch

    from align import data as D
    from align import monitor as M
    from align import rl, runtime, training
    from align.artifacts import ArtifactWriter
    from align.config import as_dict
    from align.console import TrainProgress, info, summary_table
    from align.evaluation import evaluate_policy
    from align.generation import Sampling, generate_local
    from align.models import count_parameters, load_causal_lm, load_tokenizer, resolve
    from align.report import plot_report
    from align.reward_fns import RewardError, call_reward, parse_rewards
    from align.reward_model import load_sequence_classifier, require_trained
    from align.reward_model import score as score_rm
    from align.fast_logprobs import batched_fused_logprobs, fused_logprobs, supports
    from align.rollout import batched_logprobs, forward_logprobs, rollout_batch, select
    from align.stage_io import describe_inputs, monitor_overrides

    # ---- inputs (checked before --out is touched)
    ks = cfg.ks()
    ref_spec = resolve(cfg.model)
    reward_fns = parse_rewards(cfg.reward)
    rows = D.load_rows(cfg.data, "prompts", cfg.columns)
    eval_rows = D.load_rows(cfg.eval_data, "verifiable", cfg.columns, limit=cfg.eval_samples) if cfg.eval_data else []
    tok = load_tokenizer(ref_spec, cfg.trust_remote_code)
    rm_spec = (require_trained(resolve(cfg.reward_model, expect="reward"), cfg.reward_model)
               if cfg.reward_model else None)
    rm_tok = load_tokenizer(rm_spec, cfg.trust_remote_code) if rm_spec else None
    prompt_ids = D.encode_prompts(tok, [r["prompt"] for r in rows])
    dist = runtime.init()
    if cfg.prompts_per_step % dist.world_size:
        raise UserError(f"--prompts-per-step {cfg.prompts_per_step} must be a multiple of {dist.world_size} processes.")
    random.seed(cfg.seed)
    out = Path(cfg.out)
    inputs = describe_inputs(ref_spec, cfg.data, cfg.eval_data)
    if rm_spec:
        inputs["reward_model"] = describe_inputs(rm_spec)["model"]
    writer = ArtifactWriter(out, "grpo", as_dict(cfg), inputs, dist.is_main)

    # ---- models: the policy, and a frozen reference only when β > 0
    n_local = cfg.prompts_per_step // dist.world_size * cfg.num_generations
    micro = min(cfg.micro_batch_size, n_local)
    if n_local % micro:
        raise UserError(f"--micro-batch-size {micro} must divide the {n_local} sequences per process and step.")
    accum = n_local // micro
    dtype = runtime.compute_dtype(dist, cfg.precision)
    ds = runtime.ds_config(zero_stage=cfg.zero_stage, micro_batch=micro, grad_accum=accum, world_size=dist.world_size,
                           dtype=dtype, grad_clip=cfg.grad_clip, user_config=cfg.deepspeed,
                           precision=cfg.precision, offload_optimizer=cfg.offload_optimizer)
    loader = runtime.ZeroLoader(ds)  # noqa: F841
    policy = load_causal_lm(ref_spec, tok, dtype, cfg.seed, cfg.trust_remote_code)
    if cfg.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # log-probs through a chunked LM head (no [B, T, V] logits) where the model allows it
    logprobs_fn = fused_logprobs if supports(policy) else forward_logprobs
    batched_fn = batched_fused_logprobs if supports(policy) else batched_logprobs
    schedule = training.lr_lambda("constant", cfg.warmup_steps, cfg.max_steps)
    # β2 = 0.999 (not SFT's 0.95): policy gradients are noisy, a longer second-moment memory keeps steps small.
    optimizer = training.adamw(policy, cfg.lr, 0.0, betas=(0.9, 0.999), offload=cfg.offload_optimizer)
    eng = runtime.engine(policy, ds, optimizer, lambda o: torch.optim.lr_scheduler.LambdaLR(o, schedule))
    ref_eng = runtime.engine(load_causal_lm(ref_spec, tok, dtype, cfg.seed, cfg.trust_remote_code), ds) if cfg.beta else None
    rm_eng = (runtime.engine(load_sequence_classifier(rm_spec, rm_tok, dtype, cfg.seed, cfg.trust_remote_code), ds)
              if rm_spec else None)
    info(f"grpo: {count_parameters(eng.module) / 1e6:.2f}M parameters, {len(rows)} prompts, "
         f"{cfg.prompts_per_step} prompts x G={cfg.num_generations} per step, {dist.world_size} process(es), "
         f"ZeRO-{cfg.zero_stage}, rewards {', '.join(f'{r.name}:{r.weight:g}' for r in reward_fns)}"
         f"{f', reward model {cfg.reward_model}:{cfg.reward_model_weight:g}' if rm_eng else ''}, "
         f"reference model {'on (beta ' + str(cfg.beta) + ')' if ref_eng else 'off (beta 0)'}")

    monitor = M.RLMonitor(overrides=monitor_overrides(cfg.monitor))
    sampling = Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p)

    def evaluate(step: int) -> dict:
        if not eval_rows:
            return {}
        torch.manual_seed(cfg.seed * 7919 + 1 + dist.rank)  # same eval samples before and after training
        m, _ = evaluate_policy(eng, tok, eval_rows, dist, ks=ks, samples=max(ks), sampling=sampling,
                               gather=cfg.gather)
        m = {f"eval/{k}": v for k, v in m.items()}
        writer.log(step, m)
        return m

    def score(i_row: int, text: str, n_tokens: int, finished: bool) -> tuple[float | None, dict]:
        row = rows[i_row]
        parts, total = {}, 0.0
        for r in reward_fns:
            if r.fn is None:
                continue
            try:
                v = call_reward(r, row["prompt"], text, row)
            except RewardError as e:
                if cfg.on_reward_error == "fail":
                    raise UserError(f"{e}. Fix the function, or pass --on-reward-error skip|zero.") from None
                if cfg.on_reward_error == "skip":
                    return None, {}
                v = 0.0
            parts[r.name] = v
            total += r.weight * v
        if cfg.overlong_cache:
            total += rl.overlong_penalty(n_tokens if finished else cfg.max_new_tokens + 1, cfg.max_new_tokens,
                                         cfg.overlong_cache)
        return total, parts

    # ---- train
    start_eval = evaluate(0)
    last_eval = dict(start_eval)
    t0 = time.time()
    eng.train()
    with TrainProgress("grpo", cfg.max_steps, keys=("reward", "frac_reward_zero_std", "eval/pass@1/greedy")) as bar:
        for step in range(cfg.max_steps):
            times = {}
            # 1. rollouts for this rank's prompts (same global prompt set for any number of ranks)
            t = time.time()
            idx = training.rank_share(training.step_indices(len(rows), cfg.prompts_per_step, step, cfg.seed), dist)
            torch.manual_seed(cfg.seed * 1_000_003 + step * 101 + dist.rank)
            prompts = [prompt_ids[i] for i in idx for _ in range(cfg.num_generations)]
            synced = runtime.is_zero3(eng) and not cfg.gather and dist.world_size > 1
            with runtime.gathered_for_generation(eng, cfg.gather) as module:
                comps = generate_local(module, tok, prompts, sampling, len(prompts), dist.device, synced_gpus=synced)
            times["time/generate"] = time.time() - t

            # 2. rewards
            t = time.time()
            G = cfg.num_generations
            rewards = torch.zeros(len(comps))
            keep = torch.ones(len(comps))
            parts_all: list[dict] = []
            for j, c in enumerate(comps):
                value, parts = score(idx[j // G], c.text, len(c.ids), c.finished)
                parts_all.append(parts)
                if value is None:
                    keep[j] = 0
                else:
                    rewards[j] = value
            length_fn = next((r for r in reward_fns if r.name == "length"), None)
            if length_fn is not None:  # Kimi k1.5: shorter correct answers earn more, within each group
                for g in range(len(comps) // G):
                    group = range(g * G, (g + 1) * G)
                    correct = [parts_all[j].get("math") == 1.0 for j in group]
                    for j, v in zip(group, rl.length_rewards([len(comps[j].ids) for j in group], correct)):
                        rewards[j] += length_fn.weight * v
            if rm_eng is not None:  # the RM's normalised score (every rank scores its equal share: ZeRO-3 collectives)
                rm_scores = score_rm(rm_eng, rm_tok, [rows[idx[j // G]]["prompt"] for j in range(len(comps))],
                                     [c.text for c in comps], micro).float().cpu()
                rewards += cfg.reward_model_weight * rm_scores
                for parts, v in zip(parts_all, rm_scores.tolist()):
                    parts["reward_model"] = v
            per_fn: dict[str, list[float]] = {}
            for parts in parts_all:
                for k, v in parts.items():
                    per_fn.setdefault(k, []).append(v)
            if cfg.mask_truncated:
                keep *= torch.tensor([float(c.finished) for c in comps])
            grouped = rewards.view(-1, G)
            batch_std = None
            if cfg.advantage == "batch":
                s = runtime.all_reduce_sum(torch.tensor([rewards.sum(), (rewards**2).sum(), float(len(rewards))],
                                                        dtype=torch.float64, device=dist.device))
                n = s[2]
                batch_std = torch.sqrt(((s[1] - s[0] ** 2 / n) / (n - 1)).clamp(min=0)).float().cpu()
            adv = rl.group_advantages(grouped, cfg.advantage, batch_std=batch_std).flatten()
            zero_std = (grouped.max(dim=1).values == grouped.min(dim=1).values).float()
            if cfg.drop_zero_std_groups:
                keep *= (1 - zero_std).repeat_interleave(G)
            times["time/reward"] = time.time() - t

            # 3. log-probs of π_old (num_iterations > 1) and π_ref (β > 0), no grad
            t = time.time()
            batch = rollout_batch(comps, tok.pad_token_id, dist.device)
            batch["response_mask"] *= keep.to(dist.device)[:, None]
            adv_t = adv.to(dist.device)
            old_logp = batched_fn(eng, batch, micro) if cfg.num_iterations > 1 else None
            ref_logp = batched_fn(ref_eng, batch, micro) if ref_eng is not None else None
            counts = runtime.all_reduce_sum(torch.stack([batch["response_mask"].sum(), keep.sum().to(dist.device),
                                                         zero_std.sum().to(dist.device),
                                                         torch.tensor(float(len(zero_std)), device=dist.device)]))
            n_tokens, n_seqs = counts[0].item(), counts[1].item()
            times["time/logprobs"] = time.time() - t

            # 4. policy update(s)
            t = time.time()
            stats = torch.zeros(6, device=dist.device)  # loss, kl, low, high, entropy sums over kept tokens; tokens
            for it in range(cfg.num_iterations):
                for m in range(accum):
                    sl = slice(m * micro, (m + 1) * micro)
                    mb = select(batch, sl)
                    mask = mb["response_mask"]
                    logp, ent = logprobs_fn(eng, mb, with_entropy=(it == 0))
                    a = adv_t[sl, None]
                    if cfg.reinforce:
                        per_tok = -a * logp
                        low = high = torch.zeros_like(mask, dtype=torch.bool)
                    else:
                        old = old_logp[sl] if old_logp is not None else logp.detach()
                        per_tok, low, high = rl.clipped_surrogate(logp, old, a, cfg.epsilon, cfg.epsilon_high)
                    kl = rl.kl_k3(logp, ref_logp[sl]) if ref_logp is not None else None
                    if kl is not None:
                        per_tok = per_tok + cfg.beta * kl
                    loss = rl.aggregate_loss(per_tok, mask, cfg.loss_agg, n_tokens=n_tokens, n_seqs=n_seqs,
                                             max_len=cfg.max_new_tokens)
                    eng.backward(loss * dist.world_size * accum)
                    eng.step()
                    if it == 0:
                        with torch.no_grad():
                            stats += torch.stack([
                                loss.detach() * n_tokens,  # re-summed below into the global loss
                                (kl.detach() * mask).sum() if kl is not None else mask.new_zeros(()),
                                (low.float() * mask).sum(), (high.float() * mask).sum(),
                                (ent * mask).sum() if ent is not None else mask.new_zeros(()), mask.sum()])
            runtime.all_reduce_sum(stats)
            times["time/update"] = time.time() - t

            # 5. metrics, monitor, progress
            all_rewards = torch.cat(runtime.all_gather_objects(rewards))
            lengths = torch.tensor([float(len(c.ids)) for c in comps])
            tok_n = max(stats[5].item(), 1.0)
            metrics = {
                "reward": all_rewards.mean().item(), "reward_std": all_rewards.std().item(),
                "frac_reward_zero_std": (counts[2] / counts[3]).item(),
                "loss": stats[0].item() / max(n_tokens, 1.0), "grad_norm": float(eng.get_global_grad_norm() or 0.0),
                "clip_ratio/low": stats[2].item() / tok_n, "clip_ratio/high": stats[3].item() / tok_n,
                "clip_ratio": (stats[2] + stats[3]).item() / tok_n, "entropy": stats[4].item() / tok_n,
                "completions/mean_length": lengths.mean().item(),
                "completions/tokens_per_s": lengths.sum().item() * dist.world_size / max(times["time/generate"], 1e-9),
                "completions/clipped_ratio": sum(not c.finished for c in comps) / len(comps),
                "distinct_1": rl.distinct_n([c.ids for c in comps], 1), "distinct_2": rl.distinct_n([c.ids for c in comps], 2),
                "lr": eng.lr_scheduler.get_last_lr()[0], **times,
            }
            if ref_eng is not None:
                metrics["kl"] = stats[1].item() / tok_n
            for k, v in per_fn.items():
                metrics[f"rewards/{k}"] = sum(v) / len(v)
            done = step + 1
            if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.max_steps:
                last_eval = evaluate(done)
            training.end_step(done, metrics, writer=writer, monitor=monitor, bar=bar, eng=eng, out=out, shown=last_eval)

    # ---- save
    wall = time.time() - t0
    training.save_checkpoint(eng, out, cfg.max_steps)
    runtime.save_model(eng, tok, writer.begin_model(), dist)
    final = {**{f"start/{k[5:]}": v for k, v in start_eval.items()}, **last_eval,
             "reward": metrics["reward"], "steps": cfg.max_steps, "wall_seconds": round(wall, 1),
             "peak_memory_gib_per_rank": [round(m, 3) for m in runtime.all_gather_objects(runtime.peak_memory_gib(dist))]}
    if "eval/pass@1/greedy" in last_eval and "eval/pass@1/greedy" in start_eval:
        final["gain/pass@1/greedy"] = last_eval["eval/pass@1/greedy"] - start_eval["eval/pass@1/greedy"]
    if dist.is_main:
        plot_report(out / "metrics.jsonl", out / "report.png", f"grpo — {cfg.model}")
    writer.complete(final, monitor.summary(), extra={"model_kind": "policy", "world_size": dist.world_size})
    summary_table(f"grpo complete → {out}", final)
    return final
