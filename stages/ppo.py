"""PPO-ptx: `align ppo` (InstructGPT, Ouyang et al. 2022; Ziegler et al. 2019; Stiennon et al. 2020).

Four ZeRO-3 engines: the policy π_θ (trained, from the SFT model), the frozen reference π_ref (the same SFT model
or --ref-model), the frozen reward model r (an `align rm train` artifact; normalised scores) and the value network
V_φ: its own transformer with a scalar head, initialised from the reward model, with its own AdamW and --vf-lr.

Per step:
  1. rollout: one response per prompt for --prompts-per-step prompts (the shared generation path, stop at EOS);
  2. score s = r(prompt + response up to EOS), normalised; − --missing-eos-penalty without EOS; clipped to
     ±--reward-clip. With an `answer` column the gold reward (the verifier) is logged beside it, never trained on;
  3. per-token rewards r_t = −β·KL_t on every response token (KL_t: k1 = log π_old − log π_ref, or k3),
     + s on the last one;
  4. advantages: GAE(γ, λ) on V_φ's per-token values, whitened over the batch; returns R = A + V_old;
  5. --ppo-epochs over shuffled minibatches, each an optimiser step of both networks:
       policy  −min(ρA, clip(ρ, 1 ± ε)A) (token mean) − c_ent·H  + γ_ptx · LM loss on a --ptx-data batch
       value   c_vf · ½·max((V − R)², (V_old + clip(V − V_old, ±ε_v) − R)²)
     an epoch whose approx-KL(π_old‖π_θ) passes --max-approx-kl ends the epoch loop;
  6. β ← β·(1 + clip(KL/target − 1, ±0.2)·n/horizon) (Ziegler et al. 2019) with KL the mean per-episode KL and n
     the episodes of the step; --fixed-kl keeps β. β is saved in the checkpoint and restored by --resume.
Only response tokens (EOS included) enter a loss: prompt, padding and post-EOS positions are masked everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from align.config import TrainedStageConfig, opt
from align.errors import UserError
from align.paths import DATA_DIR

DEFAULT_SFT, DEFAULT_RM = "runs/default/sft", "runs/default/rm"


@dataclass
class PPOConfig(TrainedStageConfig):
    model: str = opt(DEFAULT_SFT, "Policy to train (an sft artifact); also the reference unless --ref-model.", path=True)
    out: str = opt("runs/ppo", "Output artifact directory.", path=True)
    ref_model: str = opt("", "Frozen reference policy for the KL penalty (default: --model).", path=True)
    reward_model: str = opt(DEFAULT_RM, "Reward model: an `align rm train` artifact (normalised scores).", path=True)
    value_model: str = opt("", "Value network init (default: the reward model; a policy gets a new scalar head).",
                           path=True)
    data: str = opt(str(DATA_DIR / "arithmetic/train.jsonl"), "Prompts {prompt[, answer]}; with `answer` the gold "
                                                                "reward is logged.", path=True)
    columns: str = opt("", "Rename columns: old=new,old2=new2.")
    gold_reward: str = opt("math", "Verifier for the gold reward when the prompts carry an `answer` (a grpo "
                                   "--reward spec; '' : off).")
    eval_data: str = opt(str(DATA_DIR / "arithmetic/test.jsonl"), "Held-out verifiable data: greedy pass@1 and RM "
                                                                      "reward at start and end ('' : skip).", path=True)
    eval_samples: int = opt(200, "Held-out problems to evaluate.")
    ptx_data: str = opt(str(DATA_DIR / "arithmetic/train.jsonl"), "ptx data: pretraining text {text} (loss on every "
                        "token) or SFT data {prompt, completion} (loss on the completion).", path=True)
    ptx_coef: float = opt(0.1, "γ: weight of the pretraining LM loss (PPO-ptx); 0: plain PPO.")
    ptx_batch_size: int = opt(8, "Pretraining texts per optimiser step (all processes).")
    ptx_max_length: int = opt(128, "Max tokens per pretraining text (cut on the right).")
    max_steps: int = opt(50, "PPO steps (a rollout batch and its updates).")
    prompts_per_step: int = opt(64, "Episodes (prompts, one response each) per step, all processes.")
    minibatch_size: int = opt(32, "Episodes per optimiser step (all processes).")
    micro_batch_size: int = opt(16, "Sequences per forward per process.")
    ppo_epochs: int = opt(4, "Passes over each rollout batch.")
    max_prompt_length: int = opt(128, "Prompts longer than this many tokens are dropped (all of them: exit 2).")
    max_new_tokens: int = opt(48, "Response budget (tokens).")
    temperature: float = opt(1.0, "Sampling temperature (log-probs use the same temperature).")
    top_k: int = opt(0, "Top-k sampling (0: off).")
    top_p: float = opt(1.0, "Top-p sampling (1: off).")
    lr: float = opt(1e-4, "Policy learning rate (AdamW, constant after warmup).")
    vf_lr: float = opt(3e-4, "Value network learning rate (its own AdamW).")
    warmup_steps: int = opt(0, "Linear warmup, in optimiser steps.")
    grad_clip: float = opt(1.0, "Gradient clipping (global norm), each network.")
    cliprange: float = opt(0.2, "ε of the clipped surrogate.")
    cliprange_value: float = opt(0.2, "ε_v of the clipped value loss.")
    vf_coef: float = opt(0.1, "Value loss coefficient.")
    ent_coef: float = opt(0.0, "Entropy bonus coefficient (0: off).")
    gamma: float = opt(1.0, "GAE discount γ.")
    lam: float = opt(0.95, "GAE λ.")
    kl_estimator: str = opt("k1", "Per-token KL penalty: k1 (log π − log π_ref) or k3 (clamped log-ratio).")
    init_kl_coef: float = opt(0.1, "Initial β of the KL penalty.")
    target_kl: float = opt(2.0, "Adaptive controller target: mean KL per episode (nats, summed over tokens).")
    kl_horizon: float = opt(200.0, "Adaptive controller horizon (episodes).")
    fixed_kl: bool = opt(False, "Keep β fixed at --init-kl-coef (no adaptive controller).")
    max_approx_kl: float = opt(0.0, "Stop a step's epoch loop once an epoch's approx-KL(π_old‖π_θ) exceeds this "
                                     "(0: off).")
    missing_eos_penalty: float = opt(0.0, "Subtracted from the score of responses that never emit EOS.")
    reward_clip: float = opt(0.0, "Clip the score to [−c, c] (0: off).")
    offload_frozen: bool = opt(False, "ZeRO-3: keep the frozen reference and reward model parameters on the CPU.")
    gather: bool = opt(True, "ZeRO-3: gather weights once per generation phase (off: synced_gpus).")
    save_every: int = opt(0, "Checkpoint every N steps (always one at the end; 0: end only).")
    resume: bool = opt(False, "Resume from the checkpoint in --out (β included).")
    monitor: str = opt("", "TOML file with RLMonitor rule overrides.", path=True)

    def validate(self):
        if self.kl_estimator not in ("k1", "k3"):
            raise UserError(f"--kl-estimator must be k1 or k3, not {self.kl_estimator!r}.")
        if self.max_steps <= 0 or self.prompts_per_step <= 0 or self.ppo_epochs <= 0:
            raise UserError("--max-steps, --prompts-per-step and --ppo-epochs must be positive.")
        if self.minibatch_size <= 0 or self.prompts_per_step % self.minibatch_size:
            raise UserError(f"--minibatch-size {self.minibatch_size} must divide --prompts-per-step "
                            f"{self.prompts_per_step}.")
        if self.temperature <= 0:
            raise UserError("--temperature must be > 0: PPO samples its rollouts.")
        if self.ptx_coef < 0 or self.init_kl_coef < 0 or self.target_kl <= 0 or self.kl_horizon <= 0:
            raise UserError("--ptx-coef and --init-kl-coef must be >= 0, --target-kl and --kl-horizon > 0.")
        if self.ptx_coef and self.ptx_batch_size <= 0:
            raise UserError("--ptx-batch-size must be positive when --ptx-coef > 0.")


# ------------------------------------------------------------------------------------------------ helpers


def resolve_default(spec: str, expect: str | None, what: str):
    """resolve(), with a hint when a default (the default pipeline's sft / rm artifact) does not exist yet."""
    from pathlib import Path

    from align.models import resolve

    if spec in (DEFAULT_SFT, DEFAULT_RM) and not Path(spec).exists():
        raise UserError(f"{spec}: not found. `align ppo` defaults to the default pipeline's sft and rm artifacts: "
                        f"run `align pipeline run pipelines.toml` first, or pass {what}.")
    return resolve(spec, expect=expect)


def tokenizer_difference(a, b) -> str:
    """'' when two tokenizers encode alike (same vocabulary, special tokens and chat template), else what differs."""
    if a.get_vocab() != b.get_vocab():
        return f"vocabularies differ ({len(a)} vs {len(b)} tokens)"
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "chat_template"):
        if getattr(a, attr) != getattr(b, attr):
            return f"{attr} differs"
    return ""


def ptx_examples(tok, path: str, max_length: int) -> list[dict]:
    """The ptx batch source. Pretraining text {text}: BOS + text + EOS cut on the right at `max_length`, LM loss
    on every token. SFT data {prompt, completion} (or {messages}): the chat-templated example, loss on the
    completion only — the right "pretraining distribution" for a model whose only training is its SFT corpus
    (the embedded tiny model). Empty texts are dropped."""
    from align import data as D

    cols = D.load_dataset(path).column_names
    if "text" not in cols and ("prompt" in cols or "messages" in cols):
        out = D.sft_examples(tok, D.load_rows(path, "sft"), max_length)
    else:
        ids = tok([str(r["text"]) for r in D.load_rows(path, "text")], add_special_tokens=False)["input_ids"]
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        out = [{"input_ids": s, "labels": s} for x in ids if x for s in [(bos + x + [tok.eos_token_id])[:max_length]]]
    if not out:
        raise UserError(f"{path}: no usable pretraining text (every `text` is empty, or no completion fits "
                        "--ptx-max-length); fix --ptx-data or pass --ptx-coef 0.")
    return out


def token_values(v_eng, mb: dict):
    """V(s_t) at every position [N, L−1]: the scalar head applied to every position's hidden state. A sequence
    classifier returns only the last token's score, so the head's own output (all positions) is captured with a
    forward hook during a normal engine forward (ZeRO-3 gathers and releases parameters as for any forward)."""
    head = getattr(v_eng.module, "score", None)
    if head is None:
        raise UserError(f"{type(v_eng.module).__name__}: no `score` head; the value network needs a "
                        "ForSequenceClassification model with a `score` layer (Llama, Qwen, Mistral, GPT-2...).")
    from align.reward_model import normalized_reward

    got = {}
    hook = head.register_forward_hook(lambda module, inputs, output: got.__setitem__("v", output))
    try:
        v_eng(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False)
    finally:
        hook.remove()
    # in the reward's units: the normalisation of the RM it starts from ((raw − offset) / scale; none: identity)
    return normalized_reward(got["v"][..., 0][:, :-1].float(), v_eng.module.config)


def batched_values(v_eng, batch: dict, micro: int):
    """No-grad token_values over a whole rollout batch, `micro` rows at a time (V_old)."""
    import torch

    from align.rollout import select

    n = batch["input_ids"].shape[0]
    with torch.no_grad():
        return torch.cat([token_values(v_eng, select(batch, slice(i, i + micro))) for i in range(0, n, micro)])


# ---------------------------------------------------------------------------------------------------- run


def run(cfg: PPOConfig) -> dict:
    import copy
    import random
    import time
    from pathlib import Path

    import torch

    from align import data as D
    from align import monitor as M
    from align import rl, runtime, training
    from align.artifacts import ArtifactWriter
    from align.config import as_dict
    from align.console import TrainProgress, info, summary_table, warn
    from align.evaluation import evaluate_policy
    from align.generation import Sampling, generate_local
    from align.losses import completion_nll
    from align.models import count_parameters, load_causal_lm, load_tokenizer, resolve
    from align.report import plot_report
    from align.reward_fns import RewardError, call_reward, parse_rewards
    from align.reward_model import load_sequence_classifier, require_trained, score, score_ids
    from align.rollout import batched_logprobs, forward_logprobs, rollout_batch, select
    from align.stage_io import describe_inputs, monitor_overrides

    # ---- inputs, all checked before --out is touched
    pol_ref = resolve_default(cfg.model, "policy", "--model SFT_ARTIFACT")
    ref_ref = resolve(cfg.ref_model, expect="policy") if cfg.ref_model else pol_ref
    rm_ref = require_trained(resolve_default(cfg.reward_model, "reward", "--reward-model RM_ARTIFACT"),
                             cfg.reward_model)
    v_ref = resolve(cfg.value_model, expect=None) if cfg.value_model else rm_ref
    tok = load_tokenizer(pol_ref, cfg.trust_remote_code)
    rm_tok = load_tokenizer(rm_ref, cfg.trust_remote_code)
    rm_same_tok = not tokenizer_difference(tok, rm_tok)
    for spec, other, role, fix in (
            (cfg.ref_model, ref_ref, "reference", "pass a --ref-model trained with the policy's tokenizer"),
            (cfg.value_model or cfg.reward_model, v_ref, "value network",
             f"pass --value-model with the policy's tokenizer (e.g. --value-model {cfg.model}: its body, new head)")):
        diff = tokenizer_difference(tok, load_tokenizer(other, cfg.trust_remote_code)) if other is not pol_ref else ""
        if diff:
            raise UserError(f"{spec}: its tokenizer differs from the policy's ({diff}), but the {role} reads the "
                            f"policy's tokens; {fix}.")
    rows = D.load_rows(cfg.data, "prompts", cfg.columns)
    prompt_ids = D.encode_prompts(tok, [r["prompt"] for r in rows])
    keep = [i for i, p in enumerate(prompt_ids) if len(p) <= cfg.max_prompt_length]
    if not keep:
        raise UserError(f"{cfg.data}: every prompt is longer than --max-prompt-length {cfg.max_prompt_length} tokens "
                        f"(shortest {min(map(len, prompt_ids))}); raise --max-prompt-length or shorten the prompts.")
    dropped = len(rows) - len(keep)
    rows, prompt_ids = [rows[i] for i in keep], [prompt_ids[i] for i in keep]
    gold_fn = parse_rewards([cfg.gold_reward])[0] if cfg.gold_reward and "answer" in rows[0] else None
    eval_rows = (D.load_rows(cfg.eval_data, "verifiable", cfg.columns, limit=cfg.eval_samples)
                 if cfg.eval_data and cfg.eval_samples else [])
    ptx = ptx_examples(tok, cfg.ptx_data, cfg.ptx_max_length) if cfg.ptx_coef else []
    dist = runtime.init()
    world = dist.world_size
    for flag, n in (("--prompts-per-step", cfg.prompts_per_step), ("--minibatch-size", cfg.minibatch_size),
                    ("--ptx-batch-size", cfg.ptx_batch_size if ptx else world)):
        if n % world:
            raise UserError(f"{flag} {n} must be a multiple of the {world} processes.")
    random.seed(cfg.seed)
    out = Path(cfg.out)
    inputs = describe_inputs(pol_ref, cfg.data, cfg.eval_data if eval_rows else "", cfg.ptx_data if ptx else "")
    for key, r in (("ref_model", ref_ref), ("reward_model", rm_ref), ("value_model", v_ref)):
        inputs[key] = describe_inputs(r)["model"]
    writer = ArtifactWriter(out, "ppo", as_dict(cfg), inputs, dist.is_main)

    # ---- engines: policy + value (trained, each its own AdamW), reference + reward model (frozen)
    n_local, mb_local = cfg.prompts_per_step // world, cfg.minibatch_size // world
    micro = min(cfg.micro_batch_size, mb_local)
    if mb_local % micro:
        raise UserError(f"--micro-batch-size {micro} must divide the {mb_local} episodes per process and minibatch.")
    accum = mb_local // micro
    updates_per_step = cfg.ppo_epochs * (n_local // mb_local)
    p_accum = accum + bool(ptx)  # the ptx batch is one more micro-batch of each policy optimiser step
    dtype = runtime.compute_dtype(dist, cfg.precision)
    schedule = training.lr_lambda("constant", cfg.warmup_steps, cfg.max_steps * updates_per_step)

    def ds_for(grad_accum: int) -> dict:
        return runtime.ds_config(zero_stage=cfg.zero_stage, micro_batch=micro, grad_accum=grad_accum, world_size=world,
                                 dtype=dtype, grad_clip=cfg.grad_clip, user_config=cfg.deepspeed,
                                 precision=cfg.precision, offload_optimizer=cfg.offload_optimizer)

    def trainable(model, lr, ds):
        opt_ = training.adamw(model, lr, 0.0, betas=(0.9, 0.999), offload=cfg.offload_optimizer)
        return runtime.engine(model, ds, opt_, lambda o: torch.optim.lr_scheduler.LambdaLR(o, schedule))

    ds = ds_for(accum)
    loader = runtime.ZeroLoader(ds)  # noqa: F841  (ZeRO-3: load straight into shards)
    eng = trainable(load_causal_lm(pol_ref, tok, dtype, cfg.seed, cfg.trust_remote_code), cfg.lr, ds_for(p_accum))
    v_eng = trainable(load_sequence_classifier(v_ref, tok, dtype, cfg.seed, cfg.trust_remote_code), cfg.vf_lr, ds)
    frozen_ds = copy.deepcopy(ds)
    if cfg.offload_frozen and cfg.zero_stage == 3:
        frozen_ds["zero_optimization"]["offload_param"] = {"device": "cpu"}
    frozen_loader = runtime.ZeroLoader(frozen_ds)  # noqa: F841
    ref_eng = runtime.engine(load_causal_lm(ref_ref, tok, dtype, cfg.seed, cfg.trust_remote_code), frozen_ds)
    rm_eng = runtime.engine(load_sequence_classifier(rm_ref, rm_tok, dtype, cfg.seed, cfg.trust_remote_code), frozen_ds)
    kl_ctl = (rl.FixedKLController(cfg.init_kl_coef) if cfg.fixed_kl
              else rl.AdaptiveKLController(cfg.init_kl_coef, cfg.target_kl, cfg.kl_horizon))
    kl_fn = rl.KL_ESTIMATORS[cfg.kl_estimator]
    info(f"ppo: {count_parameters(eng.module) / 1e6:.2f}M-parameter policy, {len(rows)} prompts"
         f"{f' ({dropped} longer than --max-prompt-length dropped)' if dropped else ''}, {cfg.prompts_per_step} "
         f"episodes/step in minibatches of {cfg.minibatch_size} x {cfg.ppo_epochs} epochs, {world} process(es), "
         f"ZeRO-{cfg.zero_stage}; β {cfg.init_kl_coef} ({'fixed' if cfg.fixed_kl else f'adaptive, target {cfg.target_kl}'}"
         f"), ptx γ {cfg.ptx_coef}{f' on {len(ptx)} texts' if ptx else ''}, gold reward "
         f"{gold_fn.name if gold_fn else 'off (no answer column)' if cfg.gold_reward else 'off'}")
    if not rm_same_tok:
        warn(f"{cfg.reward_model}: tokenizer differs from the policy's ({tokenizer_difference(tok, rm_tok)}); "
             "responses are re-tokenised from text with the reward model's tokenizer and chat template.")

    start = 0
    if cfg.resume:
        start = training.load_checkpoint(eng, out)["step"]
        kl_ctl.value = training.load_checkpoint(v_eng, out / "value").get("kl_coef", kl_ctl.value)
        writer.rewind(start)
        info(f"resumed from the checkpoint at step {start} (β {kl_ctl.value:.4g})")

    def checkpoint(step: int) -> None:
        training.save_checkpoint(eng, out, step, {"kl_coef": kl_ctl.value})
        training.save_checkpoint(v_eng, out / "value", step, {"kl_coef": kl_ctl.value})

    def rm_scores(comps, idx) -> torch.Tensor:
        """Normalised RM scores of prompt + response (up to EOS): the rollout tokens themselves when the RM
        shares the policy's tokenizer, else the texts re-tokenised with the RM's."""
        if rm_same_tok:
            return score_ids(rm_eng, tok, [c.prompt_ids + c.ids for c in comps], micro)
        return score(rm_eng, rm_tok, [rows[i]["prompt"] for i in idx], [c.text for c in comps], micro)

    monitor = M.RLMonitor(overrides=monitor_overrides(cfg.monitor))
    sampling = Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p)

    def evaluate(step: int) -> dict:
        if not eval_rows:
            return {}
        m, recs = evaluate_policy(eng, tok, eval_rows, dist, sampling=Sampling(cfg.max_new_tokens, 0.0),
                                  gather=cfg.gather)
        r = score(rm_eng, rm_tok, [x["prompt"] for x in recs], [x["greedy"] for x in recs], 64)
        m = {"eval/pass@1/greedy": m["pass@1/greedy"], "eval/reward": r.mean().item()}
        writer.log(step, m)
        return m

    # ---- train
    start_eval = evaluate(start) if start == 0 else {}
    last_eval, t0 = dict(start_eval), time.time()
    history: list[dict] = []
    eng.train()
    v_eng.train()
    keys = ("reward", "gold_reward", "objective/kl", "kl_coef", "eval/pass@1/greedy")
    with TrainProgress("ppo", cfg.max_steps, start, keys=keys) as bar:
        for step in range(start, cfg.max_steps):
            times, beta = {}, kl_ctl.value
            # 1. rollout: this rank's share of the step's prompts (the same global prompts for any world size)
            t = time.time()
            idx = training.rank_share(training.step_indices(len(rows), cfg.prompts_per_step, step, cfg.seed), dist)
            torch.manual_seed(cfg.seed * 1_000_003 + step * 101 + dist.rank)
            synced = runtime.is_zero3(eng) and not cfg.gather and world > 1
            with runtime.gathered_for_generation(eng, cfg.gather) as module:
                comps = generate_local(module, tok, [prompt_ids[i] for i in idx], sampling, n_local, dist.device,
                                       synced_gpus=synced)
            times["time/generate"] = time.time() - t

            # 2. scores: proxy (the RM, normalised) and gold (the verifier; logged, never trained on)
            t = time.time()
            proxy = rm_scores(comps, idx).to(dist.device)
            finished = torch.tensor([float(c.finished) for c in comps], device=dist.device)
            scores = proxy - cfg.missing_eos_penalty * (1 - finished)
            if cfg.reward_clip:
                scores = scores.clamp(-cfg.reward_clip, cfg.reward_clip)
            gold = torch.zeros(n_local, device=dist.device)
            if gold_fn is not None:
                try:
                    gold = torch.tensor([call_reward(gold_fn, rows[i]["prompt"], c.text, rows[i])
                                         for i, c in zip(idx, comps)], device=dist.device)
                except RewardError as e:
                    raise UserError(f"--gold-reward: {e}") from None
            times["time/reward"] = time.time() - t

            # 3-4. π_old, π_ref and V_old on the rollout; per-token rewards; GAE; whitened advantages
            t = time.time()
            batch = rollout_batch(comps, tok.pad_token_id, dist.device)
            mask = batch["response_mask"]
            old_logp = batched_logprobs(eng, batch, micro, cfg.temperature)
            ref_logp = batched_logprobs(ref_eng, batch, micro, cfg.temperature)
            old_values = batched_values(v_eng, batch, micro) * mask
            kl = kl_fn(old_logp, ref_logp) * mask
            rewards = rl.token_rewards(scores, kl, mask, beta)
            adv, returns = rl.gae(rewards, old_values, mask, cfg.gamma, cfg.lam)
            adv = rl.whiten(adv, mask, reduce=runtime.all_reduce_sum)
            times["time/score"] = time.time() - t

            # 5. PPO epochs over shuffled minibatches: one optimiser step of each network per minibatch
            t = time.time()
            names = ("pg", "vf", "ptx", "low", "high", "vclip", "approxkl", "entropy", "tokens")
            sums = torch.zeros(len(names), device=dist.device, dtype=torch.float64)
            epochs_run = 0
            for epoch in range(cfg.ppo_epochs):
                gen = torch.Generator().manual_seed(cfg.seed * 7_919 + step * 131 + epoch * 17 + dist.rank)
                perm = torch.randperm(n_local, generator=gen)
                epoch_sums = torch.zeros_like(sums)
                for u, s0 in enumerate(range(0, n_local, mb_local)):
                    mb_idx = perm[s0 : s0 + mb_local].to(dist.device)
                    mb = {**select(batch, mb_idx), "old_logp": old_logp[mb_idx], "ref_logp": ref_logp[mb_idx],
                          "adv": adv[mb_idx], "returns": returns[mb_idx], "old_values": old_values[mb_idx]}
                    n_tok = runtime.all_reduce_sum(mb["response_mask"].sum().double()).item()
                    for m in range(accum):
                        mm = select(mb, slice(m * micro, (m + 1) * micro))
                        mmask = mm["response_mask"]
                        logp, ent = forward_logprobs(eng, mm, with_entropy=True, temperature=cfg.temperature,
                                                     entropy_grad=bool(cfg.ent_coef))
                        pg, low, high = rl.clipped_surrogate(logp, mm["old_logp"], mm["adv"], cfg.cliprange)
                        per_tok = pg - cfg.ent_coef * ent if cfg.ent_coef else pg
                        loss = rl.aggregate_loss(per_tok, mmask, "token-mean", n_tokens=n_tok, n_seqs=0, max_len=0)
                        # DeepSpeed averages over ranks and accumulation steps: undo both (global token means)
                        eng.backward(loss * world * p_accum)
                        eng.step()
                        values = token_values(v_eng, mm)
                        vf, vclip = rl.clipped_value_loss(values, mm["old_values"], mm["returns"], cfg.cliprange_value)
                        vf_loss = rl.aggregate_loss(vf, mmask, "token-mean", n_tokens=n_tok, n_seqs=0, max_len=0)
                        v_eng.backward(cfg.vf_coef * vf_loss * world * accum)
                        v_eng.step()
                        with torch.no_grad():
                            epoch_sums += torch.stack([
                                (pg * mmask).sum(), (vf * mmask).sum(), mmask.new_zeros(()),
                                (low * mmask).sum(), (high * mmask).sum(), (vclip * mmask).sum(),
                                (rl.kl_k3(mm["old_logp"], logp.detach()) * mmask).sum(),  # approx-KL(π_old‖π_θ)
                                (ent.detach() * mmask).sum(), mmask.sum()]).double()
                    if ptx:  # PPO-ptx: + γ · LM loss on a batch of pretraining text (token mean over all ranks)
                        update = step * updates_per_step + epoch * (n_local // mb_local) + u
                        p_idx = training.rank_share(
                            training.step_indices(len(ptx), cfg.ptx_batch_size, update, cfg.seed + 1), dist)
                        p_batch = {k: v.to(dist.device)
                                   for k, v in D.collate_sft([ptx[i] for i in p_idx], tok.pad_token_id).items()}
                        n_ptx = runtime.all_reduce_sum((p_batch["labels"][:, 1:] != -100).sum().double()).item()
                        nll, _ = completion_nll(eng(**D.model_inputs(p_batch)).logits, p_batch["labels"])
                        ptx_loss = nll / max(n_ptx, 1.0)
                        eng.backward(cfg.ptx_coef * ptx_loss * world * p_accum)
                        eng.step()
                        epoch_sums[2] += ptx_loss.detach().double()  # summed over ranks below: the global mean
                runtime.all_reduce_sum(epoch_sums)
                sums += epoch_sums
                epochs_run += 1
                if cfg.max_approx_kl and (epoch_sums[6] / epoch_sums[8].clamp(min=1)).item() > cfg.max_approx_kl:
                    break
            times["time/update"] = time.time() - t

            # 6. KL controller on the batch's mean per-episode KL (of the sampling policy)
            g = runtime.all_reduce_sum(torch.stack([
                proxy.sum(), scores.sum(), gold.sum(), kl.sum(), mask.sum(), finished.new_tensor(float(n_local)),
                finished.sum()]).double())
            n_ep = g[5].item()
            kl_episode = g[3].item() / n_ep
            kl_ctl.update(kl_episode, int(n_ep))

            # metrics, monitor, progress
            all_ids = [ids for shard in runtime.all_gather_objects([c.ids for c in comps]) for ids in shard]
            tok_n = max(sums[8].item(), 1.0)
            n_updates = max(epochs_run * (n_local // mb_local), 1)
            metrics = {
                "reward": g[0].item() / n_ep, "objective/scores": g[1].item() / n_ep,
                "objective/kl": kl_episode, "objective/rlhf_reward": g[1].item() / n_ep - beta * kl_episode,
                "kl": g[3].item() / max(g[4].item(), 1.0), "kl_coef": beta,
                "loss": sums[0].item() / tok_n, "loss/policy": sums[0].item() / tok_n,
                "loss/value": sums[1].item() / tok_n, "grad_norm": float(eng.get_global_grad_norm() or 0.0),
                "val/grad_norm": float(v_eng.get_global_grad_norm() or 0.0),
                "clip_ratio": (sums[3] + sums[4]).item() / tok_n, "clip_ratio/low": sums[3].item() / tok_n,
                "clip_ratio/high": sums[4].item() / tok_n, "val/clipfrac": sums[5].item() / tok_n,
                "policy/approxkl": sums[6].item() / tok_n, "entropy": sums[7].item() / tok_n,
                "val/explained_variance": rl.explained_variance(old_values, returns, mask, reduce=runtime.all_reduce_sum),
                "ppo/epochs": epochs_run,
                "completions/mean_length": sum(map(len, all_ids)) / len(all_ids),
                "completions/clipped_ratio": 1 - g[6].item() / n_ep,
                "distinct_1": rl.distinct_n(all_ids, 1), "distinct_2": rl.distinct_n(all_ids, 2),
                "lr": eng.lr_scheduler.get_last_lr()[0], **times,
            }
            if ptx:
                metrics["loss/ptx"] = sums[2].item() / n_updates
            if gold_fn is not None:
                metrics["gold_reward"] = g[2].item() / n_ep
            done = step + 1
            if done == cfg.max_steps:
                last_eval = evaluate(done)
            history.append(metrics)
            try:
                training.end_step(done, metrics, writer=writer, monitor=monitor, bar=bar, eng=eng, out=out,
                                  shown=last_eval)
            except SystemExit:  # an RLMonitor stop: end_step saved the policy; keep the value network and β too
                training.save_checkpoint(v_eng, out / "value", done, {"kl_coef": kl_ctl.value})
                raise
            if cfg.save_every and done % cfg.save_every == 0 and done < cfg.max_steps:
                checkpoint(done)

    # ---- save
    wall = time.time() - t0
    checkpoint(cfg.max_steps)
    runtime.save_model(eng, tok, writer.begin_model(), dist)
    w = max(1, min(5, len(history) // 2))
    first = {k: sum(h.get(k, 0.0) for h in history[:w]) / w for k in ("reward", "gold_reward", "objective/kl")}
    last = {k: sum(h.get(k, 0.0) for h in history[-w:]) / w for k in ("reward", "gold_reward", "objective/kl")}
    final = {**{f"start/{k[5:]}": v for k, v in start_eval.items()}, **last_eval,
             f"reward/first{w}": first["reward"], f"reward/last{w}": last["reward"],
             f"objective/kl/last{w}": last["objective/kl"], "kl_coef/final": kl_ctl.value,
             "steps": cfg.max_steps, "wall_seconds": round(wall, 1),
             "peak_memory_gib_per_rank": [round(m, 3) for m in runtime.all_gather_objects(runtime.peak_memory_gib(dist))]}
    if gold_fn is not None:
        final.update({f"gold_reward/first{w}": first["gold_reward"], f"gold_reward/last{w}": last["gold_reward"]})
    if dist.is_main:
        plot_report(out / "metrics.jsonl", out / "report.png", f"ppo — {cfg.model}",
                    xy=("objective/kl", ["reward", "gold_reward"]))
    writer.complete(final, monitor.summary(), extra={"model_kind": "policy", "world_size": world})
    summary_table(f"ppo complete → {out}", final)
    return final
