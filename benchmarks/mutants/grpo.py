"""Wiring mutations of stages/grpo.py, the off-policy queue (align/async_rl.py) and the rollout (align/rollout.py,
the samplers' log-probs in align/generation.py and align/fast_generate.py), caught by tests/test_grpo_wiring.py.

MUTATIONS: the benchmark's. AUDIT: more mutations of the same kinds, each checked to be caught by the tests it
names too, left out of the default run to keep CI short (`python -m benchmarks.mutations --mutants FILE` runs a
file whose MUTATIONS is this AUDIT list).
"""

from benchmarks.mutants import Mutation

M = Mutation
W = "tests/test_grpo_wiring.py::"
REF = W + "test_the_reference_is_the_frozen_start_and_the_kl_term_is_beta_times_k3"
KL_GRAD = W + "test_the_kl_term_alone_pulls_the_policy_back_to_the_reference"
CLIP = W + "test_old_logprobs_are_the_pre_update_policy_and_the_ratio_is_clipped_on_both_sides"
CLIP_TOKEN, CLIP_GSPO = CLIP + "[token]", CLIP + "[gspo]"
GSPO_UNIT = W + "test_gspo_clips_the_sequence_ratio_below_and_above"
TIS = W + "test_truncated_is_weights_the_pg_term_by_the_sampler_logprobs_of_each_response_token"
QUEUE = W + "test_the_queue_tags_each_rollout_with_the_weights_it_was_sampled_from"
STALE = W + "test_a_run_one_step_off_trains_each_step_on_the_rollout_of_the_weights_before"
TEMP = W + "test_the_samplers_logprobs_are_the_trainers_at_the_sampling_temperature"
LENGTHS = W + "test_lengths_and_loss_masks_count_response_tokens_only"
TOKEN_MEAN = LENGTHS + "[token-mean-False-True]"
SEQ_MEAN = LENGTHS + "[seq-mean-token-mean-True-True]"
SEQ_SUM = LENGTHS + "[seq-sum-False-False]"
WHOLE = W + "test_a_whole_step_samples_its_prompts_skips_failed_rewards_and_distils_from_the_teacher"
RWD = W + "test_rewards_errors_timeouts_the_reward_model_and_the_loss_choices_enter_the_step"
SHAPE = W + "test_the_length_reward_shapes_each_group_and_evaluate_uses_the_eval_options"
RWD_CISPO, RWD_REINFORCE, RWD_RPP = RWD + "[rloo-cispo]", RWD + "[batch-reinforce]", RWD + "[reinforce++-clip]"
RWD_FLAG = RWD + "[rloo---reinforce]"
RPP = W + "test_reinforce_pp_keeps_groups_without_spread_and_skipped_samples_leave_the_batch_statistics"

EOS_HF = W + "test_rollouts_end_at_their_first_eos_kept_with_one_sampler_logprob_per_kept_token[False]"
EOS_FAST = W + "test_rollouts_end_at_their_first_eos_kept_with_one_sampler_logprob_per_kept_token[True]"
GEN = "align/generation.py"

G, ROLLOUT, QUEUE_PY = "stages/grpo.py", "align/rollout.py", "align/async_rl.py"
MUTATIONS: list[Mutation] = [
    M("grpo wiring: kl logged over every pass of --num-iterations", "stages/grpo.py",
      '("kl", kl if it == 0 else None)', '("kl", kl)', (W + "test_kl_is_logged_from_the_first_pass_of_num_iterations",)),
    M("grpo wiring: rollout prompts repeated group-major (a sample paired with another row)", "align/rollout.py",
      "prompts = [p for p in prompt_ids for _ in range(group_size)]",
      "prompts = [p for _ in range(group_size) for p in prompt_ids]",
      (W + "test_each_sample_of_a_rollout_is_of_its_own_rows_prompt",)),
    M("grpo wiring: clip fractions from the first pass only (0 whenever π_old is the sampling policy)", "stages/grpo.py",
      '("clip_ratio/low", low), ("clip_ratio/high", high), ("clip_ratio", low | high),',
      '("clip_ratio/low", low if it == 0 else None), ("clip_ratio/high", high if it == 0 else None), '
      '("clip_ratio", (low | high) if it == 0 else None),', (CLIP_TOKEN, CLIP_GSPO)),
    # ---- the reference and the KL term
    M("grpo wiring: KL term detached", G, "per_tok = per_tok + self.beta * kl",
      "per_tok = per_tok + self.beta * kl.detach()", (KL_GRAD,)),
    M("grpo wiring: reference is the policy itself", G,
      "self.reference = run.reference(self.policy, self.load_policy(source)) if cfg.beta else None",
      "self.reference = self.policy if cfg.beta else None", (REF,)),
    M("grpo wiring: reference log-probs at T = 1", G,
      "ref_logp = batched_logprobs(self.reference, batch, self.micro, cfg.temperature)",
      "ref_logp = batched_logprobs(self.reference, batch, self.micro)", (REF,)),
    M("grpo wiring: KL term without beta", G, "per_tok = per_tok + self.beta * kl", "per_tok = per_tok + kl",
      (REF,)),
    # ---- π_old, the ratio and its clip
    M("grpo wiring: pi_old ignored (ratio against the current policy)", G,
      "old = old_logp[sl] if old_logp is not None else logp.detach()", "old = logp.detach()", (CLIP_TOKEN,)),
    M("grpo wiring: ratio's denominator not detached", G,
      "old = old_logp[sl] if old_logp is not None else logp.detach()",
      "old = old_logp[sl] if old_logp is not None else logp", (REF,)),
    M("grpo wiring: --epsilon-high ignored (symmetric clip)", G,
      "policy_loss(logp, old, adv[sl, None], mask, cfg.epsilon, cfg.epsilon_high)",
      "policy_loss(logp, old, adv[sl, None], mask, cfg.epsilon, cfg.epsilon)", (CLIP_TOKEN, CLIP_GSPO)),
    M("grpo wiring: --ratio sequence ignored", G,
      'return "reinforce" if self.reinforce else "gspo" if self.ratio == "sequence" else self.loss',
      'return "reinforce" if self.reinforce else self.loss', (CLIP_GSPO,)),
    M("grpo wiring: GSPO ignores the upper clip bound", "align/objectives/policy.py",
      "loss = -torch.minimum(s * a, s.clamp(1 - eps_low, 1 + eps_high) * a)",
      "loss = -torch.minimum(s * a, s.clamp(min=1 - eps_low) * a)", (GSPO_UNIT, CLIP_GSPO)),
    M("grpo wiring: advantages not prompt-major", G,
      "self.update(batch, adv.flatten().to(dist.device), old_logp, ref_logp, n_tokens, n_seqs, stats)",
      "self.update(batch, adv.t().flatten().to(dist.device), old_logp, ref_logp, n_tokens, n_seqs, stats)",
      (TOKEN_MEAN,)),
    M("grpo wiring: update log-probs at T = 1", G,
      "logp, ent = logprobs(self.policy, mb, temperature=cfg.temperature, with_entropy=(it == 0))",
      "logp, ent = logprobs(self.policy, mb, with_entropy=(it == 0))", (REF,)),
    # ---- truncated IS and the mismatch metrics
    M("grpo wiring: TIS weights uncapped", G,
      'per_tok = per_tok * rl.truncated_is_weights(old, mb["sampler_logp"], cfg.tis_cap)',
      'per_tok = per_tok * rl.truncated_is_weights(old, mb["sampler_logp"], 1e9)', (TIS,)),
    M("grpo wiring: sampler log-probs one position early", ROLLOUT,
      "            start = len(c.prompt_ids) - 1\n            sampler[i, start",
      "            start = len(c.prompt_ids) - 2\n            sampler[i, start", (TIS,)),
    M("grpo wiring: mismatch metrics over the loss's tokens only", ROLLOUT,
      'rl.rollout_mismatch(mb["sampler_logp"], trainer_logp, mb["response_mask"])',
      'rl.rollout_mismatch(mb["sampler_logp"], trainer_logp, mb["loss_mask"])', (TIS,)),
    # ---- the sampler's temperature
    M("grpo wiring: HF sampler's log-probs at T = 1", "align/generation.py",
      "logps.append(sampled_logprobs(scores, tok, s.temperature))", "logps.append(sampled_logprobs(scores, tok, 1.0))",
      (TEMP,)),
    M("grpo wiring: fast decoder's log-probs at T = 1", "align/fast_generate.py",
      "self.out_logp.index_copy_(1, self.sidx, sampled_logprobs(logits, nxt, sampling.temperature)[:, None])",
      "self.out_logp.index_copy_(1, self.sidx, sampled_logprobs(logits, nxt, 1.0)[:, None])", (TEMP,)),
    # ---- the off-policy queue
    M("grpo wiring: the first rollouts tagged with their own step", QUEUE_PY,
      "self.queue.append(self._receive(j, step, times))", "self.queue.append(self._receive(j, j, times))",
      (QUEUE + "[2]",)),
    M("grpo wiring: rollout/staleness from the rollout's own step", G,
      'stats.value("rollout/staleness", step - pending.version)',
      'stats.value("rollout/staleness", step - pending.step)', (STALE,)),
    # ---- which tokens count
    M("grpo wiring: response mask counts the prompt", ROLLOUT, "resp[i, start : start + len(c.ids)] = 1",
      "resp[i, : start + len(c.ids)] = 1", (TOKEN_MEAN,)),
    M("grpo wiring: completion lengths count the prompt", ROLLOUT,
      "torch.tensor([float(len(c.ids)) for c in self.completions])",
      "torch.tensor([float(len(c.prompt_ids) + len(c.ids)) for c in self.completions])", (TOKEN_MEAN,)),
    M("grpo wiring: overlong penalty on prompt + response", G,
      "n = len(c.ids) if c.finished else cfg.max_new_tokens + 1",
      "n = len(c.prompt_ids) + len(c.ids) if c.finished else cfg.max_new_tokens + 1", (TOKEN_MEAN,)),
    M("grpo wiring: --mask-truncated ignored", G, "if self.cfg.mask_truncated:", "if False:", (SEQ_MEAN,)),
    M("grpo wiring: --drop-zero-std-groups ignored", G,
      "keep = counted * (~no_signal).float()[:, None] if self.cfg.drop_zero_std_groups else counted",
      "keep = counted", (TOKEN_MEAN,)),
    M("grpo wiring: --loss-agg ignored", G, "rl.aggregate_loss(per_tok, mask, cfg.loss_agg,",
      'rl.aggregate_loss(per_tok, mask, "token-mean",', (SEQ_SUM,)),
    # ---- a whole step: prompts, sampling, rewards, skipped samples, the teacher (gaps audit 1)
    M("grpo wiring: skipped reward errors counted as valid", G, "float(v is not None)", "1.0", (WHOLE,)),
    M("grpo wiring: --distill-coef ignored", G, "cfg.distill_coef * d_loss", "d_loss", (WHOLE,)),
    M("grpo wiring: teacher log-probs from the policy", G, "batched_logprobs(self.teacher, batch,",
      "batched_logprobs(self.policy, batch,", (WHOLE,)),
    M("grpo wiring: teacher log-probs at T = 1", G,
      'batch["teacher_logp"] = batched_logprobs(self.teacher, batch, self.micro, cfg.temperature)',
      'batch["teacher_logp"] = batched_logprobs(self.teacher, batch, self.micro)', (WHOLE,)),
    M("grpo wiring: distillation only on the kept groups", G,
      'per_tok = per_tok * mask + cfg.distill_coef * d_loss * mb["counted_mask"]',
      'per_tok = per_tok * mask + cfg.distill_coef * d_loss * mask', (WHOLE,)),
    M("grpo wiring: distillation's log-ratio not detached", "align/rl.py",
      "k1 = (logp - teacher_logp).detach()", "k1 = logp - teacher_logp", (WHOLE,)),
    M("grpo wiring: distillation's log-ratio reversed", G, "rl.reverse_kl_distill(logp, mb[\"teacher_logp\"])",
      "rl.reverse_kl_distill(mb[\"teacher_logp\"], logp)", (WHOLE,)),
    M("grpo wiring: the same prompts every step (synchronous)", G,
      "        idx = self.run.indices(len(self.rows), cfg.prompts_per_step, step)\n        return sample(",
      "        idx = self.run.indices(len(self.rows), cfg.prompts_per_step, 0)\n        return sample(", (WHOLE,)),
    M("grpo wiring: --top-k ignored", G, "Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p)",
      "Sampling(cfg.max_new_tokens, cfg.temperature, 0, cfg.top_p)", (WHOLE,)),
    M("grpo wiring: --top-p ignored", G, "Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p)",
      "Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_k, 1.0)", (WHOLE,)),
    M("grpo wiring: --on-reward-error skip scores 0 instead", G, 'if cfg.on_reward_error == "skip":', "if False:",
      (WHOLE,)),
    M("grpo wiring: skipped samples not counted as errors", G, 'return None, {"errors": 1.0}',
      'return None, {"errors": 0.0}', (WHOLE,)),
    M("grpo wiring: advantages over the skipped samples too", G, "r.rewards, r.valid, reduce=lambda",
      "r.rewards, None, reduce=lambda", (WHOLE,)),
    M("grpo wiring: skipped samples stay in the loss", G, "counted = r.valid.clone()",
      "counted = torch.ones_like(r.valid)", (WHOLE,)),
    M("grpo wiring: reward metric over the skipped samples too", G,
      'stats.mean("reward", (r.rewards * r.valid).sum(), r.valid.sum())',
      'stats.mean("reward", r.rewards.sum(), r.rewards.numel())', (WHOLE,)),
    M("grpo wiring: reward_std over the skipped samples too", G, 'stats.std("reward_std", r.rewards[r.valid.bool()])',
      'stats.std("reward_std", r.rewards.flatten())', (WHOLE,)),
    M("grpo wiring: signal_frac ignores the teacher", G,
      "signal = counted.bool() & ((adv != 0) | (self.teacher is not None))", "signal = counted.bool() & (adv != 0)",
      (WHOLE,)),
    # ---- rewards, the reward model, --on-reward-error zero, --reward-timeout, --advantage, --loss
    M("grpo wiring: --reward-model-weight scales every reward", G,
      "r.rewards += self.cfg.reward_model_weight * r.grouped(rm)",
      "r.rewards = self.cfg.reward_model_weight * (r.rewards + r.grouped(rm))", (RWD_CISPO,)),
    M("grpo wiring: --reward-timeout ignored", G, "call_reward(r, row[\"prompt\"], c.text, row, cfg.reward_timeout)",
      "call_reward(r, row[\"prompt\"], c.text, row)", (RWD_CISPO,)),
    M("grpo wiring: --on-reward-error zero skips", G, 'v, parts["errors"] = 0.0, 1.0',
      'return None, {"errors": 1.0}', (RWD_CISPO,)),
    M("grpo wiring: zeroed reward errors not counted", G, 'v, parts["errors"] = 0.0, 1.0',
      'v, parts["errors"] = 0.0, 0.0', (RWD_CISPO,)),
    M("grpo wiring: the reward model scores the prompts alone", G,
      "score(self.rm, self.rm_tok, r.prompts, [c.text for c in r.completions], self.micro)",
      "score(self.rm, self.rm_tok, r.prompts, [\"\" for c in r.completions], self.micro)", (RWD_CISPO,)),
    M("grpo wiring: reward_model part not logged per sample", G, 'parts["reward_model"] = v',
      'parts["reward_model"] = 0.0', (RWD_CISPO,)),
    # ---- the length reward and evaluate()
    M("grpo wiring: length reward's weight dropped", G, "r.rewards[p] += length_fn.weight * torch.tensor(shaped)",
      "r.rewards[p] += torch.tensor(shaped)", (SHAPE,)),
    M("grpo wiring: length reward added to the first group only", G,
      "r.rewards[p] += length_fn.weight * torch.tensor(shaped)",
      "r.rewards[0] += length_fn.weight * torch.tensor(shaped)", (SHAPE,)),
    M("grpo wiring: length reward treats every answer as correct", G,
      'correct = [results[j][1].get("math") == 1.0 for j in group]', "correct = [True for j in group]", (SHAPE,)),
    M("grpo wiring: eval samples one completion whatever --eval-k", G, "ks=ks, samples=max(ks),",
      "ks=ks, samples=1,", (SHAPE,)),
    M("grpo wiring: eval sampled without --seed", G, "sampling=replace(self.sampling, seed=self.cfg.seed)",
      "sampling=self.sampling", (SHAPE,)),
    M("grpo wiring: eval samples tagged with step 0", G, "save_eval_samples(self.run.out, step, recs,",
      "save_eval_samples(self.run.out, 0, recs,", (SHAPE,)),
    M("grpo wiring: --reinforce ignored", G, 'return "reinforce" if self.reinforce else "gspo"',
      'return "reinforce" if False else "gspo"', (RWD_FLAG,)),
    M("grpo wiring: --micro-batch-tokens ignored", G,
      "rows_within(n_local, longest, cfg.micro_batch_tokens)", "rows_within(n_local, longest, 16384)", (SHAPE,)),
    M("grpo wiring: gain of pass@1 sign flipped", G,
      'last["eval/pass@1/greedy"] - start["eval/pass@1/greedy"]',
      'start["eval/pass@1/greedy"] - last["eval/pass@1/greedy"]', (SHAPE,)),
    M("grpo wiring: final reward from the start", G, '"reward": last["reward"]}', '"reward": start.get("reward", 0.0)}',
      (SHAPE,)),
    M("grpo wiring: raise_kl raises a beta of 0", G, "        if not self.beta:\n            return None\n",
      "", (WHOLE,)),
    M("grpo wiring: no-signal groups = zero-spread groups (reinforce++ drops them)", G,
      "no_signal = ((adv != 0) & r.valid.bool()).sum(dim=1) == 0", "no_signal = zero_spread(r.rewards, r.valid)",
      (RPP,)),
    M("grpo wiring: zero-spread groups over the skipped samples too", G,
      "zero_std = zero_spread(r.rewards, r.valid).float()", "zero_std = zero_spread(r.rewards).float()", (RPP,)),
    M("grpo wiring: reinforce++ advantages over the skipped samples too", "align/objectives/advantages.py",
      "    v = torch.ones_like(rewards) if valid is None else valid\n    sums = masked_sums(rewards, v)",
      "    v = torch.ones_like(rewards) if valid is None else valid\n"
      "    sums = masked_sums(rewards, torch.ones_like(rewards))",
      (RPP,)),
    # ---- where a rollout ends (align/generation.py): its EOS kept, one sampler log-prob per kept token
    M("grpo wiring: completions lose their EOS (trim_at_eos off by one)", GEN,
      "return ids[: ids.index(eos_id) + 1], True", "return ids[: ids.index(eos_id)], True", (EOS_HF, EOS_FAST)),
    M("grpo wiring: HF sampler's log-probs keep the post-EOS steps", GEN,
      "                resp = resp[: s.max_new_tokens]\n"
      "            out.append(Completion(p, resp, tokenizer.decode(resp, skip_special_tokens=True), finished,\n"
      "                                  None if row_lp is None else row_lp[: len(resp)]))",
      "                resp = resp[: s.max_new_tokens]\n"
      "            out.append(Completion(p, resp, tokenizer.decode(resp, skip_special_tokens=True), finished,\n"
      "                                  None if row_lp is None else row_lp))", (EOS_HF,)),
    M("grpo wiring: fast decoder's log-probs keep the post-EOS steps", GEN,
      "            resp, finished = trim_at_eos(row, eos, pad_id)\n"
      "            out.append(Completion(p, resp, tokenizer.decode(resp, skip_special_tokens=True), finished,\n"
      "                                  None if row_lp is None else row_lp[: len(resp)]))",
      "            resp, finished = trim_at_eos(row, eos, pad_id)\n"
      "            out.append(Completion(p, resp, tokenizer.decode(resp, skip_special_tokens=True), finished,\n"
      "                                  None if row_lp is None else row_lp))", (EOS_FAST,)),
    M("grpo wiring: a finished row marked unfinished", GEN,
      "return ids[: ids.index(eos_id) + 1], True", "return ids[: ids.index(eos_id) + 1], False", (EOS_HF, EOS_FAST)),
    M("grpo wiring: HF completion text keeps the special tokens", GEN,
      "            out.append(Completion(p, resp, tokenizer.decode(resp, skip_special_tokens=True), finished,\n"
      "                                  None if row_lp is None else row_lp[: len(resp)]))\n        if on_batch:\n"
      "            on_batch(len(chunk))\n    module.train(was_training)",
      "            out.append(Completion(p, resp, tokenizer.decode(resp), finished,\n"
      "                                  None if row_lp is None else row_lp[: len(resp)]))\n        if on_batch:\n"
      "            on_batch(len(chunk))\n    module.train(was_training)", (EOS_HF,)),
    M("grpo wiring: the off-policy queue left out of the checkpoint", G,
      'return {"beta": self.beta, **({"rollouts": self.rollouts.state_dict()} if self.rollouts else {})}',
      'return {"beta": self.beta}', ("tests/test_async_grpo.py::test_the_queued_rollout_is_in_the_stages_checkpoint_state",)),
    M("grpo wiring: held-out evaluation ignores --verifier", G,
      "gather=self.cfg.gather,\n                                  verifier=self.cfg.verifier)",
      'gather=self.cfg.gather,\n                                  verifier="auto")', (SHAPE,)),
    M("grpo wiring: rewards/NAME averaged over every sample, skipped ones included", G,
      'stats.mean(f"rewards/{k}", sum(v), len(v))', 'stats.mean(f"rewards/{k}", sum(v), len(r.completions))',
      (WHOLE,)),
    M("grpo wiring: the KL term only in the first of --num-iterations passes", G,
      "kl = kl_k3(logp, ref_logp[sl]) if ref_logp is not None else None",
      "kl = kl_k3(logp, ref_logp[sl]) if ref_logp is not None and it == 0 else None",
      (W + "test_every_pass_of_num_iterations_carries_the_kl_term",)),
    M("grpo wiring: --overlong-cache's length ignored", G,
      "total += overlong([n], max_len=cfg.max_new_tokens, cache=cfg.overlong_cache)[0]",
      "total += overlong([n], max_len=cfg.max_new_tokens, cache=1)[0]", (LENGTHS,)),
    M("grpo wiring: --advantage ignored (zscore)", G, 'adv = objectives.get("advantage", self.cfg.advantage).fn(',
      'adv = objectives.get("advantage", "zscore").fn(', (CLIP_TOKEN,)),
    M("grpo wiring: one pass whatever --num-iterations", G, "for it in range(cfg.num_iterations):", "for it in range(1):",
      (CLIP_TOKEN,)),
    M("grpo wiring: held-out rows from the training data", G,
      'self.eval_rows = fitting_rows(D.load_rows(cfg.eval_data, "verifiable"',
      'self.eval_rows = fitting_rows(D.load_rows(cfg.data, "verifiable"', (SHAPE,)),
    M("grpo wiring: training prompts read from --eval-data", G, 'self.rows = D.load_rows(cfg.data, "prompts", cfg.columns)',
      'self.rows = D.load_rows(cfg.eval_data or cfg.data, "prompts", cfg.columns)', (SHAPE,)),
]

AUDIT: list[Mutation] = [
    M("grpo wiring: reference log-probs from the policy", G,
      "ref_logp = batched_logprobs(self.reference, batch, self.micro, cfg.temperature)",
      "ref_logp = batched_logprobs(self.policy, batch, self.micro, cfg.temperature)", (REF,)),
    M("grpo wiring: KL weight from --beta, not the (raised) current beta", G, "per_tok = per_tok + self.beta * kl",
      "per_tok = per_tok + cfg.beta * kl", (REF,)),
    M("grpo wiring: pi_old at T = 1", G,
      "old_logp = (batched_logprobs(self.policy, batch, self.micro, cfg.temperature)",
      "old_logp = (batched_logprobs(self.policy, batch, self.micro)", (CLIP_TOKEN,)),
    M("grpo wiring: one pass whatever --num-iterations", G, "for it in range(cfg.num_iterations):",
      "for it in range(1):", (CLIP_TOKEN,)),
    M("grpo wiring: --epsilon and --epsilon-high swapped", G,
      "policy_loss(logp, old, adv[sl, None], mask, cfg.epsilon, cfg.epsilon_high)",
      "policy_loss(logp, old, adv[sl, None], mask, cfg.epsilon_high, cfg.epsilon)", (CLIP_TOKEN, CLIP_GSPO)),
    M("grpo wiring: advantages negated", G,
      "policy_loss(logp, old, adv[sl, None], mask, cfg.epsilon, cfg.epsilon_high)",
      "policy_loss(logp, old, -adv[sl, None], mask, cfg.epsilon, cfg.epsilon_high)", (REF,)),
    M("grpo wiring: --tis-cap ignored", G, 'if cfg.tis_cap and "sampler_logp" in mb:', "if False:", (TIS,)),
    M("grpo wiring: TIS weights the KL term too", G,
      '''                if cfg.tis_cap and "sampler_logp" in mb:
                    per_tok = per_tok * rl.truncated_is_weights(old, mb["sampler_logp"], cfg.tis_cap)
                kl = kl_k3(logp, ref_logp[sl]) if ref_logp is not None else None
                if kl is not None:
                    per_tok = per_tok + self.beta * kl
''', '''                kl = kl_k3(logp, ref_logp[sl]) if ref_logp is not None else None
                if kl is not None:
                    per_tok = per_tok + self.beta * kl
                if cfg.tis_cap and "sampler_logp" in mb:
                    per_tok = per_tok * rl.truncated_is_weights(old, mb["sampler_logp"], cfg.tis_cap)
''', (TIS,)),
    M("grpo wiring: fast decoder's first log-prob at T = 1", "align/fast_generate.py",
      "self.out_logp[:, 0] = sampled_logprobs(logits, first, sampling.temperature)",
      "self.out_logp[:, 0] = sampled_logprobs(logits, first, 1.0)", (TEMP,)),
    M("grpo wiring: rollouts sampled at T = 1", G,
      "self.sampling = Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p)",
      "self.sampling = Sampling(cfg.max_new_tokens, 1.0, cfg.top_k, cfg.top_p)", (TEMP,)),
    M("grpo wiring: a rollout asked ahead tagged with its own step", QUEUE_PY,
      "self.asked = (step + self.K, step)", "self.asked = (step + self.K, step + self.K)", (QUEUE + "[1]",)),
    M("grpo wiring: the queue holds one rollout whatever K", QUEUE_PY,
      "while len(self.queue) < max(self.K, 1) and", "while len(self.queue) < 1 and", (QUEUE + "[2]",)),
    M("grpo wiring: stale rollouts logged as fresh", G, "self.stale = pending.version != step", "self.stale = False",
      (STALE,)),
    M("grpo wiring: response mask counts the padding after EOS", ROLLOUT, "resp[i, start : start + len(c.ids)] = 1",
      "resp[i, start:] = 1", (TOKEN_MEAN,)),
    M("grpo wiring: dropped groups leave the normaliser", G,
      'counted_mask.sum(), counted.sum().to(dist.device), batch["loss_mask"].sum()]',
      'batch["loss_mask"].sum(), keep.sum().to(dist.device), batch["loss_mask"].sum()]', (TOKEN_MEAN,)),
    M("grpo wiring: seq-sum normalised by the batch's width", G, "max_len=cfg.max_new_tokens)",
      "max_len=mask.shape[1])", (SEQ_SUM,)),
    M("grpo wiring: entropy over the loss's tokens only", G,
      'stats.mean("entropy", (ent * mb["response_mask"]).sum(), mb["response_mask"].sum())',
      'stats.mean("entropy", (ent * mb["loss_mask"]).sum(), mb["loss_mask"].sum())', (TOKEN_MEAN,)),
    M("grpo wiring: KL estimator's arguments swapped", G, "kl = kl_k3(logp, ref_logp[sl])",
      "kl = kl_k3(ref_logp[sl], logp)", (REF,)),
    M("grpo wiring: KL term's sign flipped", G, "per_tok = per_tok + self.beta * kl",
      "per_tok = per_tok - self.beta * kl", (REF,)),
    M("grpo wiring: beta doubled at the start", G, "self.beta = cfg.beta  #", "self.beta = 2 * cfg.beta  #", (REF,)),
    M("grpo wiring: raise_kl adds its factor", G, "old, self.beta = self.beta, self.beta * factor",
      "old, self.beta = self.beta, self.beta + factor", (REF,)),
    M("grpo wiring: a restored beta ignored", G, 'self.beta = state.get("beta", self.cfg.beta)',
      "self.beta = self.cfg.beta", (KL_GRAD,)),
    M("grpo wiring: kl metric over every response token", G,
      'stats.mean(name, (x.detach().float() * mb["loss_mask"]).sum(), mb["loss_mask"].sum())',
      'stats.mean(name, (x.detach().float() * mb["response_mask"]).sum(), mb["response_mask"].sum())', (TOKEN_MEAN,)),
    M("grpo wiring: metrics of every pass summed", G, "if it == 0:", "if True:", (CLIP_TOKEN,)),
    M("grpo wiring: pi_old only from 3 iterations on", G, "if cfg.num_iterations > 1 else None",
      "if cfg.num_iterations > 2 else None", (CLIP_TOKEN,)),
    M("grpo wiring: every micro-batch its own optimiser step", G, "micro=self.micro, accum=n_local // self.micro)",
      "micro=self.micro, accum=1)", (CLIP_TOKEN,)),
    M("grpo wiring: every micro-batch the first", G, "sl = slice(i, i + self.micro)", "sl = slice(0, self.micro)",
      (REF,)),
    M("grpo wiring: normalisers swapped", G,
      "self.update(batch, adv.flatten().to(dist.device), old_logp, ref_logp, n_tokens, n_seqs, stats)",
      "self.update(batch, adv.flatten().to(dist.device), old_logp, ref_logp, n_seqs, n_tokens, stats)", (REF,)),
    M("grpo wiring: fused head's log-probs at T = 1", "align/logprobs.py",
      "            h = h / temperature  # (h / T)·Wᵀ = logits / T", "            pass", (REF,)),
    M("grpo wiring: TIS ratio inverted", G, 'rl.truncated_is_weights(old, mb["sampler_logp"], cfg.tis_cap)',
      'rl.truncated_is_weights(mb["sampler_logp"], old, cfg.tis_cap)', (TIS,)),
    M("grpo wiring: mismatch of the sampler with itself", G, "record_mismatch(stats, mb, old,",
      'record_mismatch(stats, mb, mb["sampler_logp"],', (TIS,)),
    M("grpo wiring: HF sampler's log-probs after top-k", "align/generation.py",
      "logps.append(sampled_logprobs(scores, tok, s.temperature))",
      "logps.append(z.log_softmax(-1).gather(-1, tok[:, None])[:, 0])", (TEMP,)),
    M("grpo wiring: fast decoder's log-probs after top-k", "align/fast_generate.py",
      "self.out_logp.index_copy_(1, self.sidx, sampled_logprobs(logits, nxt, sampling.temperature)[:, None])",
      "self.out_logp.index_copy_(1, self.sidx, sampled_logprobs(filter_logits(logits / sampling.temperature, "
      "sampling.top_k, sampling.top_p), nxt, 1.0)[:, None])", (TEMP,)),
    M("grpo wiring: the same sampling keys every step", G, "seed=derive(self.cfg.seed, step)", "seed=self.cfg.seed",
      (TEMP,)),
    M("grpo wiring: the queue asks past --max-steps", QUEUE_PY, "if self.K and step + self.K < self.max_steps:",
      "if self.K and step + self.K <= self.max_steps:", (QUEUE + "[1]",)),
    M("grpo wiring: the queue pops its newest rollout", QUEUE_PY, "out = self.queue.popleft()",
      "out = self.queue.pop()", (QUEUE + "[2]",)),
    M("grpo wiring: a rollback keeps the queue of later steps", QUEUE_PY,
      "if self.queue and self.queue[0].step != step:", "if False:", (QUEUE + "[1]",)),
    M("grpo wiring: the queued rollout paired with its version's rows", G,
      "idx = self.run.indices(len(self.rows), cfg.prompts_per_step, step)\n            r = Rollout(",
      "idx = self.run.indices(len(self.rows), cfg.prompts_per_step, pending.version)\n            r = Rollout(",
      (STALE,)),
    M("grpo wiring: stale flag inverted", G, "self.stale = pending.version != step",
      "self.stale = pending.version == step", (STALE,)),
    M("grpo wiring: the rollout asked ahead never received", G, "self.rollouts.after_update(times)", "pass",
      (STALE,)),
    M("grpo wiring: sample rows group-major", ROLLOUT,
      "return [row for row in self.rows for _ in range(self.group_size)]",
      "return [row for _ in range(self.group_size) for row in self.rows]", (STALE,)),
    M("grpo wiring: loss mask of the counted samples", G,
      'batch["loss_mask"] = batch["response_mask"] * keep.flatten()',
      'batch["loss_mask"] = batch["response_mask"] * counted.flatten()', (TOKEN_MEAN,)),
    M("grpo wiring: update over every response token", G, 'mask = mb["loss_mask"]\n', 'mask = mb["response_mask"]\n',
      (TOKEN_MEAN,)),
    M("grpo wiring: reward weight dropped", G, "total += r.weight * v", "total += v", (TOKEN_MEAN,)),
    M("grpo wiring: --mask-truncated keeps only the truncated", G, "counted *= r.finished",
      "counted *= 1 - r.finished", (SEQ_MEAN,)),
    M("grpo wiring: rows left-padded", ROLLOUT, "ids = torch.tensor(pad(seqs, pad_id), device=device)",
      'ids = torch.tensor(pad(seqs, pad_id, side="left"), device=device)', (TOKEN_MEAN,)),
    M("grpo wiring: clipped_ratio counts the finished", ROLLOUT,
      'stats.mean("completions/clipped_ratio", n - finished.sum(), n)',
      'stats.mean("completions/clipped_ratio", finished.sum(), n)', (TOKEN_MEAN,)),
    M("grpo wiring: tokens metric counts the prompts", G, 'stats.sum("tokens", lengths.sum())',
      'stats.sum("tokens", lengths.sum() + sum(len(c.prompt_ids) for c in r.completions))', (TOKEN_MEAN,)),
]
