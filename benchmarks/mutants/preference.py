"""Wiring mutations of stages/dpo.py: DPO and its variants (IPO, SimPO, ORPO, KTO, RPO, online DPO); and of the
preference pairs an LLM judge ranks (align/judge_pairs.py, `align data make prefs --judge`)."""

from benchmarks.mutants import Mutation

M = Mutation
F = "stages/dpo.py"
T = "tests/test_dpo_wiring.py::"
SIGMOID = T + "test_sigmoid_reference_is_the_frozen_start_and_the_steps_are_the_hand_loss"
IPO = T + "test_ipo_mean_against_the_ref_model_uses_response_lengths"
SIMPO = T + "test_simpo_takes_gamma_and_response_lengths_and_loads_no_reference"
ORPO = T + "test_orpo_with_the_rpo_nll_term_carries_its_gradient"
RPO = T + "test_rpo_nll_term_on_dpo_against_the_ref_model"
KTO = T + "test_kto_reference_point_weights_and_held_out"
SCHEDULE = T + "test_the_lr_schedule_warmup_weight_decay_and_betas_reach_the_optimiser"
KEYS = T + "test_online_sampling_keys_change_with_the_step_not_with_the_window"
ONLINE = T + "test_online_pairs_are_the_judges_best_and_worst_and_ties_weigh_nothing"
PICK = T + "test_run_picks_the_variant_from_the_options"
TEMP = T + "test_online_samples_at_the_temperature_option"
RMJ = T + "test_online_pairs_ranked_by_the_reward_model_option"
PASS = T + "test_pass_at_1_on_the_first_eval_samples_greedy_with_the_verifier"
OPTIM = T + "test_optimiser_options_and_columns_reach_the_step"
JP = "align/judge_pairs.py"
JUDGE_TWO = "tests/test_judge_stages.py::test_online_dpo_two_samples_are_ranked_by_the_judge_in_both_orders"
JUDGE_MORE = "tests/test_judge_stages.py::test_online_dpo_more_samples_are_ranked_by_the_judges_expected_score"
JT = "tests/test_judge_prefs.py::"
JUDGED = JT + "test_pairwise_chosen_is_the_side_the_judge_prefers_in_both_orders"
BY_HAND = JT + "test_ranking_and_margins_by_hand"
POINTWISE = JT + "test_pointwise_scores_the_best_against_the_worst"
MARGIN = JT + "test_pairs_closer_than_the_margin_are_dropped"

MUTATIONS: list[Mutation] = [
    # which model is the reference
    M("dpo wiring: the reference is the policy itself", F,
      "self.reference = run.reference(self.policy, load(ref_source), ref_model=cfg.ref_model)",
      "self.reference = self.policy", (SIGMOID,)),
    M("dpo wiring: --ref-model ignored (the input model as reference)", F,
      'ref_source = resolve(cfg.ref_model, expect="policy") if cfg.ref_model else source', "ref_source = source",
      (IPO, RPO)),
    M('dpo wiring: chosen and rejected reference log-probs swapped', 'stages/dpo.py',
      'rc, rr = (None, None) if ref is None else ref[:, sl].to(pc.dtype)',
      'rr, rc = (None, None) if ref is None else ref[:, sl].to(pc.dtype)', (IPO,)),
    M("dpo wiring: a micro-batch gets the first micro-batch's reference log-probs", 'stages/dpo.py',
      'else ref[:, sl].to(pc.dtype)',
      'else ref[:, : len(sl)].to(pc.dtype)', (IPO,)),
    M("dpo wiring: --precompute-ref computes the policy's log-probs", F,
      "self.ref_train = dict(zip(used, self.logps_of(self.reference, [self.examples[i] for i in used])))",
      "self.ref_train = dict(zip(used, self.logps_of(self.policy.eng, [self.examples[i] for i in used])))",
      (IPO + "[True]",)),
    M("dpo wiring: --precompute-ref looked up by position in the batch, not by pair", F,
      "self.train_on([self.examples[i] for i in idx], idx,",
      "self.train_on([self.examples[i] for i in idx], list(range(len(idx))),", (IPO + "[True]",)),
    M("dpo wiring: --precompute-ref held-out reference is the policy", F,
      "self.ref_eval = self.logps_of(self.reference, self.eval_examples) if self.eval_examples else None",
      "self.ref_eval = self.logps_of(self.policy.eng, self.eval_examples) if self.eval_examples else None",
      (IPO + "[True]",)),
    # which tokens count
    M("dpo wiring: response lengths count the prompt's tokens too", F,
      'lengths = (b["labels"][:, 1:] != IGNORE).sum(-1).view(2, -1)',
      'lengths = (b["attention_mask"][:, 1:] != 0).sum(-1).view(2, -1)', (IPO, SIMPO, ORPO)),
    M("dpo wiring: summed log-probs over prompt and padding too", F,
      '"response_mask": batch["labels"][:, 1:] != IGNORE}',
      '"response_mask": torch.ones_like(batch["labels"][:, 1:], dtype=torch.bool)}', (SIGMOID, KTO)),
    M("dpo wiring: response mask off by one (last prompt token in, EOS out)", F,
      '"response_mask": batch["labels"][:, 1:] != IGNORE}', '"response_mask": batch["labels"][:, :-1] != IGNORE}',
      (SIGMOID, KTO)),
    M("dpo wiring: held-out lengths count the prompt", F,
      'n = torch.tensor([[len(e["chosen_ids"]), len(e["rejected_ids"])] for e in self.eval_examples])',
      'n = torch.tensor([[len(e["prompt_ids"]) + len(e["chosen_ids"]), len(e["prompt_ids"]) + len(e["rejected_ids"])] '
      "for e in self.eval_examples])", (SIMPO, IPO + "[False]")),
    M("dpo wiring: held-out rewards of summed log-probs, not the loss's own (ipo-mean, simpo)", F,
      "None if ref is None else ref[:, 1], n[:, 0], n[:, 1]))",
      "None if ref is None else ref[:, 1], torch.ones_like(n[:, 0]), torch.ones_like(n[:, 1])))",
      (IPO + "[False]", SIMPO)),
    # the options reach the loss
    M('dpo wiring: --beta ignored (0.1)', 'stages/dpo.py',
      'return dpo_loss(pairs, cfg.loss, cfg.beta,',
      'return dpo_loss(pairs, cfg.loss, 0.1,', (SIGMOID, IPO, SIMPO)),
    M('dpo wiring: --label-smoothing ignored', 'stages/dpo.py',
      'label_smoothing=cfg.label_smoothing, gamma=cfg.simpo_gamma,',
      'label_smoothing=0.0, gamma=cfg.simpo_gamma,', (SIGMOID,)),
    M('dpo wiring: --simpo-gamma ignored (its default)', 'stages/dpo.py',
      'label_smoothing=cfg.label_smoothing, gamma=cfg.simpo_gamma,',
      'label_smoothing=cfg.label_smoothing, gamma=0.5,', (SIMPO,)),
    # RPO's NLL term
    M('dpo wiring: RPO NLL term detached', 'align/objectives/preference.py',
      'nll = rpo_nll(pairs.policy_chosen, pairs.chosen_len, nll_coef)',
      'nll = rpo_nll(pairs.policy_chosen.detach(), pairs.chosen_len, nll_coef)', (ORPO, RPO)),
    M('dpo wiring: RPO NLL of the rejected answer', 'align/objectives/preference.py',
      'nll = rpo_nll(pairs.policy_chosen, pairs.chosen_len, nll_coef)',
      'nll = rpo_nll(pairs.policy_rejected, pairs.rejected_len, nll_coef)', (ORPO, RPO)),
    # the gradient's normaliser and the weights
    M("dpo wiring: loss normalised per micro-batch, not over the global batch", F,
      "self.policy.backward((loss * w).sum() / max(n_pairs, 1.0))", "self.policy.backward((loss * w).mean())",
      (SIGMOID, IPO, ONLINE)),
    M("dpo wiring: online loss divided by the slots, not the pairs", F,
      "n_pairs = runtime.all_reduce_sum(weights.sum().to(device)).item()", "n_pairs = float(len(weights))",
      (ONLINE,)),
    # online DPO's pairs
    M("dpo wiring: online chosen = the worst sample, rejected = the best", F,
      "best, worst = scores.argmax(1), scores.argmin(1)", "best, worst = scores.argmin(1), scores.argmax(1)",
      (ONLINE,)),
    M("dpo wiring: online ties keep a weight", F, "(scores[rows, best] - scores[rows, worst] > tie).float()",
      "(scores[rows, best] - scores[rows, worst] >= tie).float()", (ONLINE,)),
    M("dpo wiring: online samples drawn from the reference", F, "done = generate_on_rank(self.policy.eng,",
      "done = generate_on_rank(self.reference,", (ONLINE,)),
    M("dpo wiring: --online-every ignored (new samples every step)", F, "if step not in self.buffer:", "if True:",
      (ONLINE,)),
    # KTO
    M("dpo wiring: KTO reference point from the matched rows", F,
      '{"input_ids": b["input_ids"][n:], "labels": b["labels"][n:]}',
      '{"input_ids": b["input_ids"][:n], "labels": b["labels"][:n]}', (KTO,)),
    M("dpo wiring: KTO's mismatched rows from their micro-batch only (z0 depends on the split)", F,
      "D.collate_kto(rows, self.tok.pad_token_id, others)", "D.collate_kto(rows, self.tok.pad_token_id)", (KTO,)),
    M("dpo wiring: KTO's mismatched prompt is the row's own", F,
      'others = [self.examples[glob[(k + 1) % len(glob)]]["prompt_ids"] for k in places]',
      'others = [self.examples[glob[k]]["prompt_ids"] for k in places]', (KTO,)),
    M("dpo wiring: KTO reference log-probs from the policy", F, "ref = row_logps(self.reference, matched, cfg.packing)",
      "ref = row_logps(self.policy, matched, cfg.packing)", (KTO,)),
    M("dpo wiring: KTO desirable and undesirable weights swapped", F,
      "cfg.desirable_weight, cfg.undesirable_weight)", "cfg.undesirable_weight, cfg.desirable_weight)", (KTO,)),
    M("dpo wiring: KTO loss averaged per micro-batch", F, "self.policy.backward(loss.sum() / cfg.batch_size)",
      "self.policy.backward(loss.mean())", (KTO,)),
    M("dpo wiring: KTO held-out accuracy on the wrong side of 0", F, '"eval/rewards/accuracies": ((r > 0) == label)',
      '"eval/rewards/accuracies": ((r < 0) == label)', (KTO,)),
    # held-out accuracy
    M("dpo wiring: held-out reference is the policy", F,
      "ref = self.ref_eval if self.ref_eval is not None else self.logps_of(self.reference, self.eval_examples)",
      "ref = self.ref_eval if self.ref_eval is not None else self.logps_of(self.policy.eng, self.eval_examples)",
      (SIGMOID, IPO + "[False]")),
    M("dpo wiring: --eval-pairs ignored", F, "self.eval_examples = self.eval_examples[: cfg.eval_pairs]", "pass",
      (SIGMOID, KTO)),
    # the variant
    M("dpo wiring: --online trains plain DPO", F, "KTO if cfg.unpaired else OnlineDPO if cfg.online else DPO",
      "KTO if cfg.unpaired else DPO", (PICK,)),
    # online sampling options (gaps audit)
    M("dpo wiring: online --temperature ignored (T = 1)", F,
      "Sampling(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed)",
      "Sampling(max_new_tokens=cfg.max_new_tokens, temperature=1.0, seed=cfg.seed)", (TEMP,)),
    M("dpo wiring: online judge scores every sample by the group's first", F,
      "return torch.tensor([float(self.judge(r[\"prompt\"], c.text, **row_fields(r))) for r, c in zip(rows, completions)])",
      "return torch.tensor([float(self.judge(r[\"prompt\"], completions[0].text, **row_fields(r))) for r, c in zip(rows, completions)])",
      (ONLINE,)),
    M("dpo wiring: online --reward-model ranking reversed", F,
      "return score(self.rm, self.rm_tok, texts,", "return -score(self.rm, self.rm_tok, texts,", (RMJ,)),
    M("dpo wiring: online --reward-model scores every sample under the first row's prompt", F,
      'texts = [r["prompt"] for r in rows]', 'texts = [rows[0]["prompt"] for r in rows]', (RMJ,)),
    # pass@1 and the data's options
    M("dpo wiring: pass@1 --max-new-tokens ignored", F,
      "sampling=Sampling(max_new_tokens=cfg.max_new_tokens, temperature=0.0))",
      "sampling=Sampling(max_new_tokens=48, temperature=0.0))", (PASS,)),
    M("dpo wiring: pass@1 --verifier ignored", F,
      "self.verifiable, self.run.dist, verifier=self.verifier,", 'self.verifiable, self.run.dist, verifier="auto",',
      (PASS,)),
    M("dpo wiring: --eval-samples ignored (all of --pass-data)", F, "limit=cfg.eval_samples,", "limit=0,", (PASS,)),
    M("dpo wiring: --max-length ignored for the pairs", F,
      "return load_pairs(path, self.cfg.columns, self.tok, self.cfg.max_length,",
      "return load_pairs(path, self.cfg.columns, self.tok, 256,", (PASS,)),
    M("dpo wiring: --weight-decay ignored", F, "cfg.weight_decay), micro=self.micro, accum=accum)",
      "0.0), micro=self.micro, accum=accum)", (OPTIM,)),
    M("dpo wiring: --lr ignored (the default)", F, "Optim(cfg.lr, cfg.max_steps", "Optim(1e-4, cfg.max_steps", (OPTIM,)),
    M("dpo wiring: --columns ignored", F, "return load_pairs(path, self.cfg.columns,", 'return load_pairs(path, "",',
      (OPTIM,)),
    M("dpo wiring: held-out pairs read from --data, not --eval-data", F,
      "self.eval_examples = self.load_examples(cfg.eval_data) if cfg.eval_data else self.split_examples",
      "self.eval_examples = self.load_examples(cfg.data) if cfg.eval_data else self.split_examples", (SIGMOID, KTO)),
    M("dpo wiring: --eval-pairs keeps the last pairs", F, "self.eval_examples = self.eval_examples[: cfg.eval_pairs]",
      "self.eval_examples = self.eval_examples[-cfg.eval_pairs :]", (SIGMOID, KTO)),
    M("dpo wiring: online window samples step 0's prompts for every step", F,
      "idx = [i for s in steps for i in self.run.indices(len(self.rows), cfg.batch_size, s)]",
      "idx = [i for s in steps for i in self.run.indices(len(self.rows), cfg.batch_size, step)]", (ONLINE,)),
    M("dpo wiring: kto trains on the same global batch every step", F,
      "glob = step_indices(len(self.examples), cfg.batch_size, step, cfg.seed)",
      "glob = step_indices(len(self.examples), cfg.batch_size, 0, cfg.seed)", (KTO,)),
    M("dpo wiring: online sampling keys ignore the step (same keys every step)", F,
      "places = [(s * cfg.batch_size + dist.rank * share + j) * K + k for s in steps",
      "places = [(dist.rank * share + j) * K + k for s in steps", (KEYS,)),
    M("dpo wiring: online sampling keys count the step within the window (depend on --online-every)", F,
      "places = [(s * cfg.batch_size + dist.rank * share + j) * K + k for s in steps",
      "places = [((s - step) * cfg.batch_size + dist.rank * share + j) * K + k for s in steps", (KEYS,)),
    M("dpo wiring: online samples of a slot share one key", F,
      "places = [(s * cfg.batch_size + dist.rank * share + j) * K + k for s in steps",
      "places = [(s * cfg.batch_size + dist.rank * share + j) * K + 0 for s in steps", (KEYS,)),
    # ---- a fifth audit: a resume inside an online window, the sampling seed, the schedule, weight decay's groups
    M("online dpo wiring: a window entered off its --online-every boundary runs a full window", F,
      "steps = range(step, min(cfg.max_steps, step - step % cfg.online_every + cfg.online_every))",
      "steps = range(step, min(cfg.max_steps, step + cfg.online_every))", (KEYS,)),
    M("online dpo wiring: sampling keys from torch's RNG, not the seed", F,
      "Sampling(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed)",
      "Sampling(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=None)", (KEYS,)),
    M("dpo wiring: --schedule ignored (constant)", F, "Optim(cfg.lr, cfg.max_steps, cfg.warmup_steps, cfg.schedule,",
      'Optim(cfg.lr, cfg.max_steps, cfg.warmup_steps, "constant",', (SCHEDULE,)),
    M("engine wiring: weight decay on every parameter (norms and biases too)", "align/engine/build.py",
      '{"params": no_decay, "weight_decay": 0.0}', '{"params": no_decay, "weight_decay": weight_decay}', (SCHEDULE,)),
    M("online dpo wiring: --online-samples ignored", F, "K = cfg.online_samples", "K = 4", (ONLINE,)),
    M("dpo wiring: --precompute-ref never precomputes (the reference stays live)", F,
      "if cfg.precompute_ref and self.ref_train is None:", "if False and self.ref_train is None:", (IPO + "[True]",)),
    M("online dpo wiring: samples drawn group-major (a slot's K samples of different prompts)", F,
      "prompts = [self.prompt_ids[i] for i in idx for _ in range(K)]",
      "prompts = [self.prompt_ids[i] for _ in range(K) for i in idx]", (ONLINE,)),
    # ---- pairs ranked by an LLM judge (align/judge_pairs.py)
    M("judge pairs: the chosen side is the one the judge prefers less", JP,
      "chosen, rejected, p = (a, b, p_ab) if p_ab >= 0.5 else (b, a, 1.0 - p_ab)",
      "chosen, rejected, p = (b, a, p_ab) if p_ab >= 0.5 else (a, b, 1.0 - p_ab)", (JUDGED, BY_HAND)),
    M("judge pairs: pointwise, the worst sample is chosen", JP,
      "order = sorted(range(len(texts)), key=lambda i: -scores[i])",
      "order = sorted(range(len(texts)), key=lambda i: scores[i])", (POINTWISE,)),
    M("judge pairs: --judge-margin ignored (every pair the judge does not tie kept)", JP,
      'return pair["judge_margin"] > TIE and pair["judge_margin"] >= min_margin',
      'return pair["judge_margin"] > TIE', (MARGIN,)),
    # online DPO ranked by an LLM judge (--online --judge)
    M("dpo judge: the pairwise verdict given to the other sample", "align/judge.py",
      "return torch.stack([p, 1.0 - p], 1).flatten()", "return torch.stack([1.0 - p, p], 1).flatten()", (JUDGE_TWO,)),
    M("dpo judge: an even verdict of identical samples kept as a pair", F,
      "best, worst, weights = best_worst(scores, TIE if self.lm_judge is not None else 0.0)",
      "best, worst, weights = best_worst(scores)", (JUDGE_TWO,)),
    M("dpo judge: --judge-rubric ignored with more than 2 samples", F,
      "else (rubric or RUBRIC, PAIR_RUBRIC)", "else (RUBRIC, PAIR_RUBRIC)", (JUDGE_MORE,)),
]
