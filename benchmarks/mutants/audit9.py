"""Audit 9: 40 wiring mutations written by a helper that read the code and the benchmark's lists but not tests/,
frozen before they were run; NOT part of the benchmark's default run (CI time). Each names the test files of its
stage and that stage's characterisation runs. Rerun: `python -m benchmarks.mutations --mutants
benchmarks/mutants/audit9.py`. Results: benchmarks/baselines/mutation-audits.json."""

from benchmarks.mutants import Mutation as M

PPO = ("tests/test_ppo_wiring.py", "tests/test_ppo.py", "tests/test_ppo_rl.py", "tests/test_golden.py::test_a_short_run_gives_the_stored_figures[ppo-adaptive]", "tests/test_golden.py::test_a_short_run_gives_the_stored_figures[ppo-fixed-k3]")
GRPO = ("tests/test_grpo_wiring.py", "tests/test_grpo.py", "tests/test_grpo_update.py", "tests/test_rl.py", "tests/test_async_grpo.py", "tests/test_golden.py::test_a_short_run_gives_the_stored_figures[grpo-clip-kl]", "tests/test_golden.py::test_a_short_run_gives_the_stored_figures[grpo-gspo-teacher]", "tests/test_golden.py::test_a_short_run_gives_the_stored_figures[grpo-cispo-stale]", "tests/test_golden.py::test_a_short_run_gives_the_stored_figures[grpo-reinforce]")
DPO = ("tests/test_dpo_wiring.py", "tests/test_dpo.py", "tests/test_dpo_online.py", "tests/test_pref_losses.py", "tests/test_golden.py::test_a_short_run_gives_the_stored_figures[dpo-sigmoid]", "tests/test_golden.py::test_a_short_run_gives_the_stored_figures[dpo-ipo-precomputed]", "tests/test_golden.py::test_a_short_run_gives_the_stored_figures[dpo-simpo]", "tests/test_golden.py::test_a_short_run_gives_the_stored_figures[dpo-kto]", "tests/test_golden.py::test_a_short_run_gives_the_stored_figures[dpo-online]")
SUP = ("tests/test_supervised_wiring.py", "tests/test_rm.py", "tests/test_sft_lifecycle.py", "tests/test_golden.py::test_a_short_run_gives_the_stored_figures[sft-packing]", "tests/test_golden.py::test_a_short_run_gives_the_stored_figures[rm-scalar]", "tests/test_golden.py::test_a_short_run_gives_the_stored_figures[rm-likelihood]")

MUTATIONS = [
    # ------------------------------------------------------------------------------------------------ PPO (8)
    # Which tokens count: the RM score lands on the FIRST response token instead of the last (EOS). Under GAE
    # with γλ < 1 the score's credit is spread differently over the response (default λ 0.95), and the value
    # targets of every position change. Default config.
    M("audit9 ppo: the RM score credited to the first response token, not the last", "align/objectives/ppo.py",
      "rewards.index_put((rows, last_token_index(mask)),",
      "rewards.index_put((rows, mask.argmax(1)),", PPO),
    # Gradient normaliser: the policy loss is a token mean over each MICRO-batch instead of over the whole
    # minibatch (every rank): with the defaults (minibatch 32, micro 16) two micro-batches each get the weight of
    # a whole minibatch, so the gradient doubles and is reweighted between micro-batches. Default config.
    M("audit9 ppo: the policy loss normalised per micro-batch, not over the minibatch", "stages/ppo.py",
      "tis_cap=cfg.tis_cap,\n                                            n_tokens=n_tok)",
      "tis_cap=cfg.tis_cap,\n                                            n_tokens=mask.sum().item())", PPO),
    # Clipping on one side only: V − V_old is clipped from above only, so a value that falls far below V_old
    # keeps its (unclipped) gradient through the clipped term; the max of the two squared errors changes
    # wherever V < V_old − ε_v. Default config (ε_v 0.2).
    M("audit9 ppo: the value clip one-sided (no lower bound on V − V_old)", "align/objectives/ppo.py",
      "v_clipped = old_values + (values - old_values).clamp(-clip, clip)",
      "v_clipped = old_values + (values - old_values).clamp(max=clip)", PPO),
    # Which model / argument: the value loss's clip is centred on the returns instead of V_old, so the clipped
    # term is at most ε_v² and the loss is (nearly) the unclipped one; val/clipfrac changes too. Default config.
    M("audit9 ppo: the value clip centred on the returns, not on V_old", "stages/ppo.py",
      'mm["old_values"], mm["returns"], mask,',
      'mm["returns"], mm["returns"], mask,', PPO),
    # Option ignored: the decoder's sampling log-probs are never passed to the policy loss, so --tis-cap has no
    # effect in PPO (no truncated-IS weights). Less common option (--tis-cap > 0).
    M("audit9 ppo: --tis-cap ignored (the sampler's log-probs not given to the loss)", "stages/ppo.py",
      '                                                           mm.get("sampler_logp")),',
      '                                                           None),', PPO),
    # Coefficient / baseline: the gold term is no longer centred on the other episodes' mean gold:
    # s = r_RM + c·gold. The score, the returns and the value targets shift by c·mean(gold). Needs
    # --gold-reward-coef > 0 (less common).
    M("audit9 ppo: the gold term not centred (its baseline ignored)", "align/objectives/ppo.py",
      "s = rm_score + gold_coef * (gold.to(rm_score.dtype) - gold_baseline)",
      "s = rm_score + gold_coef * gold.to(rm_score.dtype)", PPO),
    # Metric from the wrong quantity: kl_coef logs the β AFTER the controller's update, not the β the step's
    # rewards used. Differs under the default adaptive controller.
    M("audit9 ppo: kl_coef logs the updated β, not the one the step used", "stages/ppo.py",
      '"kl_coef": beta,', '"kl_coef": self.kl_ctl.value,', PPO),
    # Which model: rollout/logp_abs_diff and rollout/kl compare the sampler with the frozen reference instead
    # of π_old; the same at step 0, different once the policy has moved (RLMonitor's rollout_mismatch then fires
    # on a healthy run). Default config (the HF sampler returns log-probs at T > 0).
    M("audit9 ppo: the rollout mismatch measured against the reference, not π_old", "stages/ppo.py",
      'record_mismatch(stats, batch, ro["old_logp"])', 'record_mismatch(stats, batch, ro["ref_logp"])', PPO),

    # ------------------------------------------------------------------------------------------------ GRPO (8)
    # Off-by-one / wrong window: the length reward's group of prompt p is samples p .. p+G−1 (a sliding window
    # over the flat list) instead of p·G .. (p+1)·G−1: the shaped rewards are computed from other prompts'
    # lengths and correctness. Needs --reward length (less common).
    M("audit9 grpo: the length reward's group read as a sliding window, not the prompt's G samples",
      "stages/grpo.py", "group = range(p * G, (p + 1) * G)", "group = range(p, p + G)", GRPO),
    # Which model: the KL term's "reference" is π_old (the detached policy) instead of π_ref: k3 and its gradient
    # are 0 on the first pass, so β has no effect. Needs --beta > 0.
    M("audit9 grpo: the KL term taken toward π_old, not the reference", "stages/grpo.py",
      "ref_logp[sl] if ref_logp is not None else None,",
      "old if ref_logp is not None else None,", GRPO),
    # Metric over the wrong set: completions/mean_terminated_length sums the lengths of ALL completions (the
    # truncated ones too) over the count of finished ones. Default config whenever some completion is truncated.
    M("audit9 grpo: mean_terminated_length sums the truncated completions too", "align/rollout/batch.py",
      "(lengths * finished).sum(), finished.sum(), math.nan)",
      "lengths.sum(), finished.sum(), math.nan)", GRPO),
    # Which tokens count (metric): distinct_1/2 are computed over prompt + completion tokens, so the prompts'
    # n-grams (repeated G times per prompt) enter the diversity metrics RLMonitor watches. Default config.
    M("audit9 grpo: distinct-n counts the prompt tokens", "align/rollout/batch.py",
      "runtime.all_gather_objects([c.ids for c in r.completions])",
      "runtime.all_gather_objects([c.prompt_ids + c.ids for c in r.completions])", GRPO),
    # Off-by-one in steps: the rollouts missing at the start (or after a resume) are sampled for step+1.. instead
    # of step..: step 0 trains on rollout 1's completions paired with step 0's rows (wrong prompts' answers
    # scored). Needs --max-staleness > 0.
    M("audit9 grpo: the queue's missing rollouts sampled one step ahead", "align/rollout/queue.py",
      "j = step + len(self.queue)  #", "j = step + len(self.queue) + 1  #", GRPO),
    # Which tokens count (metric): held-out completions/mean_length counts the prompt tokens. Default eval.
    M("audit9 grpo: held-out completions/mean_length counts the prompt", "align/rollout/evaluation.py",
      '"completions/mean_length": sum(len(o.ids) for o in outs) / len(outs)',
      '"completions/mean_length": sum(len(o.prompt_ids) + len(o.ids) for o in outs) / len(outs)', GRPO),
    # Bound off by one: top-k masks logits <= the k-th largest, so only k−1 tokens stay (top-k 1: every logit
    # masked, a uniform draw). Both samplers (HF and fast) share filter_logits. Needs --top-k > 0.
    M("audit9 grpo: top-k keeps k − 1 tokens (the k-th masked too)", "align/rollout/sampling.py",
      "logits = logits.masked_fill(logits < kth, neg)", "logits = logits.masked_fill(logits <= kth, neg)", GRPO),
    # Seeding: the HF sampler's noise is keyed by the absolute position (prompt included) instead of the
    # response position: samples now depend on the prompt's padded width (the batch's company) and differ from
    # the fast decoder's for the same key. Default config on CPU (HF generate).
    M("audit9 grpo: the HF sampler's noise keyed by the absolute position, not the response position",
      "align/rollout/generation.py", "tok = choose(z, key_t, input_ids.shape[1] - prompt_len)",
      "tok = choose(z, key_t, input_ids.shape[1])", GRPO),

    # ------------------------------------------------------------------------------------------------ DPO (8)
    # Wrong count: KTO's reference point z0 divides the mismatched rows' summed log-ratio by the number of
    # micro-batches instead of the rows (by default one micro-batch: z0 becomes a sum). Default --loss kto.
    M("audit9 dpo: KTO's reference point divided by the micro-batches, not the rows", "stages/dpo.py",
      "torch.tensor(float(cfg.batch_size), device=kl.device)",
      "torch.tensor(float(len(batches)), device=kl.device)", DPO),
    # Sign flipped: KTO's undesirable term uses σ(β(r − z0)) like the desirable one, so the loss pushes the
    # undesirable completions' likelihood UP. Default --loss kto.
    M("audit9 dpo: KTO's undesirable term with the desirable sign", "align/objectives/preference.py",
      "w_undesirable * (1 - torch.sigmoid(beta * (z0 - r))))",
      "w_undesirable * (1 - torch.sigmoid(beta * (r - z0))))", DPO),
    # Which model: KTO's held-out implicit reward uses the policy as its own reference (r = 0 for every row),
    # so eval/rewards/accuracies is the share of undesirable rows and the margin 0. Default --loss kto.
    M("audit9 dpo: KTO held-out reward against the policy itself", "stages/dpo.py",
      "- self.logps_of(self.reference, examples))[:, 0]",
      "- self.logps_of(self.policy.eng, examples))[:, 0]", DPO),
    # Off-by-one index: online DPO's chosen answer is read at j + best (another slot's sample) instead of
    # j·K + best: chosen and rejected come from different prompts. --online.
    M("audit9 dpo: online chosen read at the wrong sample index (j + best, not j·K + best)", "stages/dpo.py",
      '"chosen_ids": done[j * K + best[j]].ids,', '"chosen_ids": done[j + best[j]].ids,', DPO),
    # Data order: the judge's rows are repeated group-major, so the verifier checks sample k of prompt j against
    # another row's answer; the ranking (and the pairs) change. --online with the verifier.
    M("audit9 dpo: online judge rows repeated group-major (samples judged against other rows)", "stages/dpo.py",
      "rows = [self.rows[i] for i in idx for _ in range(K)]",
      "rows = [self.rows[i] for _ in range(K) for i in idx]", DPO),
    # Option ignored: --nll-coef never reaches the loss (RPO's NLL term off). Less common (--nll-coef > 0).
    M("audit9 dpo: --nll-coef ignored (no RPO term)", "stages/dpo.py",
      "nll_coef=cfg.nll_coef)", "nll_coef=0.0)", DPO),
    # Window off by one: pass@1 is measured only at the end, not at step 0, so the input model's pass@1
    # (pass@1/reference) is never measured. Default config (--pass-data, --eval-samples 200).
    M("audit9 dpo: pass@1 of the input model skipped (only at the last step)", "stages/dpo.py",
      "if self.verifiable and step in (0, cfg.max_steps):",
      "if self.verifiable and step == cfg.max_steps:", DPO),
    # Metric from the wrong quantity: held-out accuracy compares the policy's summed log-probs of chosen and
    # rejected instead of the loss's implicit rewards (the reference ignored, lengths not normalised).
    M("audit9 dpo: held-out accuracy from the policy's summed log-probs, not the implicit rewards", "stages/dpo.py",
      '"eval/rewards/accuracies": m["rewards/accuracies"].mean().item()',
      '"eval/rewards/accuracies": (pol[:, 0] > pol[:, 1]).float().mean().item()', DPO),

    # ------------------------------------------------------------------------------------------------ RM (8)
    # Metric: the calibration's confidence is σ(Δ) (signed) instead of σ(|Δ|): wrongly ranked pairs fall below
    # 0.5 and leave every bucket; bucket accuracies become 1. Default `rm eval`.
    M("audit9 rm: calibration confidence from the signed margin, not |Δ|", "stages/rm.py",
      "conf = torch.sigmoid(diff.abs())", "conf = torch.sigmoid(diff)", SUP),
    # Option lost: sequence_rewards drops normalize=False, so `rm score` normalises the rewards twice
    # ((raw − o)/s − o)/s: every score is shifted by −offset. Default `rm score` of a trained RM.
    M("audit9 rm: sequence_rewards normalised (rm score normalises twice)", "stages/rm.py",
      "batch_size, normalize=False),", "batch_size),", SUP),
    # Length normalisation dropped: the likelihood head's reward is β · the SUMMED response log-prob, not the
    # mean: it favours short answers. --head likelihood.
    M("audit9 rm: the likelihood head's reward summed, not the per-token mean", "align/objectives/reward.py",
      "return beta * sequence_logps(logits, labels) / n", "return beta * sequence_logps(logits, labels)", SUP),
    # Metric from the wrong quantity: eval/margin reports the chosen responses' mean reward, not the margin.
    M("audit9 rm: eval/margin reads the chosen rewards, not the margin", "stages/rm.py",
      '"eval/margin": m["margin/mean"]', '"eval/margin": m["rewards/chosen"]', SUP),
    # Which data: the held-out evaluation scores the first training pairs instead of --eval-data.
    M("audit9 rm: held-out accuracy measured on the training pairs", "stages/rm.py",
      "pair_rewards(self.rm.eng, self.tok, self.eval_examples, self.run.dist)",
      "pair_rewards(self.rm.eng, self.tok, self.examples[: len(self.eval_examples)], self.run.dist)", SUP),
    # Which tokens count (length window): the prompt is cut for the CHOSEN response only, so a pair whose
    # rejected answer is longer exceeds --max-length (and its rejected row is longer than any limit allows).
    # Whenever a prompt needs cutting (long prompts or a small --max-length).
    M("audit9 rm: the prompt cut to fit the chosen response only, not the longer one", "align/data.py",
      "cut = max(0, len(p) + longer - max_length)", "cut = max(0, len(p) + len(c) - max_length)", SUP),
    # Option ignored: the reward model's optimiser gets no warmup (--warmup-steps, default 50 for rm).
    M("audit9 rm: --warmup-steps ignored for the reward model", "stages/rm.py",
      "Optim(cfg.lr, cfg.max_steps, cfg.warmup_steps, cfg.schedule, cfg.weight_decay),",
      "Optim(cfg.lr, cfg.max_steps, 0, cfg.schedule, cfg.weight_decay),", SUP),
    # Option ignored in the engine: where Trained clips itself (ZeRO-0 without DeepSpeed mixed precision: the
    # one-GPU default, or --zero-stage 0 in fp32) the gradient norm is measured but never clipped, so
    # --grad-clip has no effect there.
    M("audit9 rm: --grad-clip ignored where the engine clips itself (norm measured, not clipped)",
      "align/engine/build.py",
      "torch.nn.utils.clip_grad_norm_(self.params, self.clip) if self.clip > 0",
      "torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None]) if self.clip > 0", SUP),

    # ------------------------------------------------------------------------------------------------ SFT (8)
    # Which tokens count: completions no longer end with EOS, so SFT never teaches the model to stop (and the
    # RM / DPO responses lose their EOS). Default config.
    M("audit9 sft: completions encoded without EOS", "align/data.py",
      "return [c + [tokenizer.eos_token_id] for c in ids]", "return [c for c in ids]", SUP),
    # Schedule off by the warmup: the cosine decay's progress counts from step 0, not from the end of warmup,
    # so the learning rate after warmup is already decayed. Default config (cosine, warmup 50 for sft).
    M("audit9 sft: the lr decay counted from step 0, not from the end of warmup", "align/engine/build.py",
      "progress = min(1.0, (step - warmup) / max(1, total - warmup))",
      "progress = min(1.0, step / max(1, total))", SUP),
    # Which data: eval/loss is the loss of the TRAINING rows, not of --eval-data.
    M("audit9 sft: the held-out loss measured on the training rows", "stages/sft.py",
      "self.eval_examples = D.sft_examples(self.tok, eval_rows, cfg.max_length, cfg.assistant_only_loss)",
      "self.eval_examples = D.sft_examples(self.tok, rows, cfg.max_length, cfg.assistant_only_loss)", SUP),
    # Metric over the wrong mask: `tokens` (and tokens_per_s) count the padding too. Default config (rows of
    # different lengths are right-padded).
    M("audit9 sft: the tokens metric counts the padding", "stages/sft.py",
      'stats.sum("tokens", (b["input_ids"] != self.tok.pad_token_id).sum())',
      'stats.sum("tokens", b["input_ids"].numel())', SUP),
    # Length window: a prompt too long for --max-length keeps its START (cut on the right, away from the
    # completion) instead of its end. Whenever a prompt is cut.
    M("audit9 sft: a too-long prompt cut on the right (keeps its start)", "align/data.py",
      "p = p[max(0, len(p) + len(c) - max_length):]", "p = p[: max(0, max_length - len(c))]", SUP),
    # Off by one: packing never fills a row to exactly --max-length (strict <), so the rows, their number and
    # every step's batch change. --packing.
    M("audit9 sft: packing never fills a row to exactly --max-length", "align/data.py",
      'len(r["input_ids"]) + n <= max_length), None)', 'len(r["input_ids"]) + n < max_length), None)', SUP),
    # Off by one: the NLL scores token t+1 with the logits of position t+1 (logits[:, 1:]) instead of position
    # t: the model is trained to copy its input. Default config (also PPO's ptx term).
    M("audit9 sft: the NLL's logits shifted the wrong way (position t+1 scores token t+1)",
      "align/objectives/tokens.py", "    logits = logits[:, :-1]\n", "    logits = logits[:, 1:]\n", SUP),
    # Option ignored: SFT's --schedule is replaced by a constant learning rate (default cosine).
    M("audit9 sft: --schedule ignored (constant)", "stages/sft.py",
      "Optim(cfg.lr, cfg.max_steps, cfg.warmup_steps, cfg.schedule, cfg.weight_decay),",
      'Optim(cfg.lr, cfg.max_steps, cfg.warmup_steps, "constant", cfg.weight_decay),', SUP),
]
