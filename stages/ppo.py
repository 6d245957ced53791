"""PPO-ptx: `align ppo` (InstructGPT, Ouyang et al. 2022; Ziegler et al. 2019; Stiennon et al. 2020).

Four engines: the policy π_θ (trained, from the SFT model), the frozen reference π_ref (the same SFT model or
--ref-model), the frozen reward model r (an `align rm train` artifact; normalised scores) and the value network
V_φ: its own transformer with a scalar head, initialised from the reward model (without one, from the policy's
body with a new head; or --value-model), with its own AdamW and --vf-lr. With --judge, an LLM judge J (RLAIF; a
frozen causal LM, loaded whole on each process, outside DeepSpeed) scores each episode as well, or instead of r
(--reward-model '').

Per step:
  1. rollout: one response per prompt for --prompts-per-step prompts (stop at EOS);
  2. score s = r(prompt + response up to EOS), normalised, + c_J·J(prompt, response) with --judge (its expected
     score in [0, 1] through --judge-rubric, times --judge-coef c_J); + c·(gold − the batch's other episodes' mean gold),
     gold the verifier's reward on prompts with an `answer` (--gold-reward-coef c, default 0: gold is then only
     logged beside the RM's score); − --missing-eos-penalty without EOS; clipped to ±--reward-clip
     (episode_score);
  3. per-token rewards r_t = −β·KL_t on every response token (KL_t: k1 = log π_old − log π_ref, or k3),
     + s on the last one;
  4. advantages: GAE(γ, λ) on V_φ's per-token values, whitened over the batch; returns R = A + V_old;
  5. --ppo-epochs over shuffled minibatches, each an optimiser step of both networks:
       policy  −min(ρA, clip(ρ, 1 ± ε)A) (token mean) − c_ent·H  + γ_ptx · LM loss on a --ptx-data batch
       value   c_vf · ½·max((V − R)², (V_old + clip(V − V_old, ±ε_v) − R)²)
     an epoch whose approx-KL(π_old‖π_θ) passes --max-approx-kl ends the epoch loop;
  6. β ← β·(1 + clip(KL/target − 1, ±0.2)·n/horizon) (Ziegler et al. 2019) with KL the mean per-episode KL and n
     the episodes of the step; --fixed-kl keeps β. β is part of the checkpoint.
Only response tokens (EOS included) enter a loss: prompt, padding and post-EOS positions are masked everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import torch

from align import data as D
from align import objectives, runtime, tools, vision
from align.artifacts import describe_inputs
from align.console import info, warn
from align.engine.build import Optim
from align.engine.plan import (Data, Device, Family, Model, Plan, RLPlan, Setup, activation_bytes, chunked_logit_bytes,
                               frozen_weights, full_logit_bytes, judge_terms, judge_tokens, memory_changes,
                               micro_changes, model_state, nproc_changes, reference_model, rollout_changes,
                               rollout_terms, score_terms, trained_model, zero3_blocks)
from align.engine.run import Output, train
from align.engine.stats import Stats
from align.errors import UserError
from align.judge import RUBRIC, as_text
from align.judge import load as load_judge
from align.logprobs import batched_logprobs, logprobs
from align.routing_replay import routing_replay
from align.objectives.kl import AdaptiveKLController, FixedKLController
from align.rollout.evaluation import (evaluate_policy, fitting, fitting_rows, held_out_verifier, save_eval_samples,
                                      verifier_note)
from align.rollout.generation import Sampling
from align.rollout.sampling import derive
from align.objectives.ppo import (PPOPolicyBatch, episode_score, explained_variance, gae, leave_one_out_mean,
                                   ppo_policy_loss, ppo_value_loss, token_rewards, whiten)
from align.models import context_length, count_parameters, disable_dropout, load_causal_lm, load_tokenizer, resolve
from align.objectives.tokens import completion_nll
from align.reward_model import (load_reward_model, load_sequence_classifier, normalized_reward, require_trained, score,
                                score_ids)
from align.rewards import RewardError, call_rewards, every_number, parse_rewards, probe
from align.rollout.batch import (Rollout, record_completions, record_episodes, record_mismatch, rollout_sampling, sample,
                                 select, timed)
from stages.ppo_config import DEFAULT_RM, DEFAULT_SFT, PPOConfig  # the options (light: no torch), re-exported

@dataclass(frozen=True)
class PPOPlan(RLPlan):
    """PPO in the memory plan: four models (the policy and the value network trained, the reference and the
    reward model frozen), a rollout of one response per prompt, the no-gradient passes, and the update's largest
    pass (the policy's, the value network's or the ptx batch's)."""

    cfg: PPOConfig
    name: ClassVar[str] = "ppo"

    auto_micro: ClassVar[bool] = False  # --micro-batch-size 0 is the whole minibatch share, as asked

    @property
    def offload_frozen(self) -> bool:
        return self.cfg.offload_frozen

    def models(self) -> dict[str, str]:
        cfg = self.cfg
        return {"policy": cfg.model, **({"reference": cfg.ref_model} if cfg.ref_model else {}),
                **({"reward model": cfg.reward_model} if cfg.reward_model else {}),
                "value": cfg.value_model or cfg.reward_model or cfg.model,  # (no reward model: the policy's body)
                **({"judge": cfg.judge} if cfg.judge else {})}

    def phases(self) -> tuple[str, ...]:
        return ("rollout", "score", "update")

    def micro_rows(self, world: int, data: Data) -> tuple[int, int]:
        n = self.cfg.minibatch_size // world
        return min(self.cfg.micro_batch_size or n, n), n

    def batch(self, world: int, micro_batch_size: int, data: Data) -> tuple[int, int]:
        n = self.cfg.minibatch_size // world
        micro = min(micro_batch_size or n, n)
        if n % micro:
            raise UserError(f"--micro-batch-size {micro} must divide the {n} episodes per process and minibatch.")
        return micro, n // micro

    def terms(self, plan: Plan, models: dict[str, Model], s: Setup, data: Data) -> None:
        cfg, prompt = self.cfg, data.prompt(self.cfg.max_prompt_length)
        micro, _ = self.micro_rows(s.world, data)
        policy = trained_model(cfg, "policy", models["policy"].arch)
        value = trained_model(cfg, "value", models["value"].arch, "score")
        plan.add_state(policy, s)
        plan.add_state(value, s)
        ref = reference_model(plan, models, cfg.lora_r, cfg.ref_model)
        if ref:
            plan.add("reference: weights", model_state(ref, s)["weights"])
        others = ([ref] if ref else []) + frozen_weights(plan, models, ("reward model",), s)
        rollout_terms(plan, policy, cfg.prompts_per_step // s.world, prompt, cfg.episode_tokens, s)
        score_terms(plan, [policy, value, *others], micro, prompt + cfg.episode_tokens, s)
        zero3_blocks(plan, [policy, value, *others], s)
        judge_terms(plan, models, cfg.prompts_per_step // s.world, judge_tokens(cfg.rubric() or RUBRIC, prompt,
                                                                                 cfg.episode_tokens), s, "score")
        self.update_pass(plan, policy, value, micro, prompt + cfg.episode_tokens, s)

    def update_pass(self, plan: Plan, policy: Model, value: Model, micro: int, longest: int, s: Setup) -> None:
        """The update's largest pass: the policy's activations and logits (full with an entropy bonus, which takes
        the plain path), the value network's, or the ptx batch's with its full logits."""
        cfg, a = self.cfg, policy.arch
        logits = "full" if cfg.ent_coef else "chunked"
        head = (full_logit_bytes(micro, longest, a.vocab, s) if cfg.ent_coef else
                chunked_logit_bytes(micro * longest, a.vocab))
        passes = {"policy": activation_bytes(a, micro, longest, s) + head,
                  "value": activation_bytes(value.arch, micro, longest, s)}
        if cfg.ptx_coef:
            rows = max(1, cfg.ptx_batch_size // s.world)
            passes["ptx"] = (activation_bytes(a, rows, cfg.ptx_max_length, s) +
                             full_logit_bytes(rows, cfg.ptx_max_length, a.vocab, s))
        role = max(passes, key=passes.get)
        plan.add(f"activations + logits ({role} pass, {micro} rows x {longest} tokens, {logits} logits)", passes[role],
                 "update")

    def changes(self, device: Device, data: Data) -> Iterator[Family]:
        """A smaller micro-batch, LoRA, optimizer offload, a smaller rollout (its minibatch no larger), more
        processes."""
        yield micro_changes(self, device, data)
        yield from memory_changes(self.cfg, device)
        yield from rollout_changes(self.cfg, device, minibatch=True)
        yield nproc_changes(self, device)


# ------------------------------------------------------------------------------------------------ helpers


def resolve_default(spec: str, expect: str | None, what: str):
    """resolve(), with a hint when a default (the arithmetic pipeline's sft / rm artifact) does not exist yet."""
    if spec in (DEFAULT_SFT, DEFAULT_RM) and not Path(spec).exists():
        raise UserError(f"{spec}: not found. `align ppo` defaults to the arithmetic pipeline's sft and rm artifacts "
                        f"(its default prompts are arithmetic): run `align pipeline run pipelines/arithmetic.toml` first, or pass {what}.")
    return resolve(spec, expect=expect)


def tokenizer_difference(a, b) -> str:
    """'' when two tokenizers encode alike (same vocabulary, special tokens and chat template), else what differs."""
    if a.get_vocab() != b.get_vocab():
        return f"vocabularies differ ({len(a)} vs {len(b)} tokens)"
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "chat_template"):
        if getattr(a, attr) != getattr(b, attr):
            return f"{attr} differs"
    return ""


def check_shared_tokenizers(cfg: PPOConfig, sources: dict, tok) -> None:
    """The reference and the value network read the policy's tokens: a UserError unless their tokenizers (with
    --chat-template's template, as the policy's `tok`) encode alike."""
    for spec, other, role, fix in (
            (cfg.ref_model, sources["reference"], "reference", "pass a --ref-model trained with the policy's tokenizer"),
            (cfg.value_model or cfg.reward_model or cfg.model, sources["value"], "value network",
             f"pass --value-model with the policy's tokenizer (e.g. --value-model {cfg.model}: its body, new head)")):
        diff = (tokenizer_difference(tok, load_tokenizer(other, cfg.trust_remote_code, cfg.chat_template))
                if other is not sources["policy"] else "")
        if diff:
            raise UserError(f"{spec}: its tokenizer differs from the policy's ({diff}), but the {role} reads the "
                            f"policy's tokens; {fix}.")


def ptx_examples(tok, path: str, max_length: int) -> list[dict]:
    """The ptx batch source. Pretraining text {text}: BOS + text + EOS cut on the right at `max_length`, LM loss
    on every token. SFT data {prompt, completion} (or {messages}): the chat-templated example, loss on the
    completion only — the right "pretraining distribution" for a model whose only training is its SFT corpus
    (the embedded tiny model). Empty texts are dropped."""
    cols = D.columns_of(D.read_rows(path))
    if "text" not in cols and ("prompt" in cols or "messages" in cols):
        out = D.sft_examples(tok, D.load_rows(path, "sft"), max_length)
    else:
        texts = [str(r["text"]) for r in D.load_rows(path, "text")]
        ids = tok(texts, add_special_tokens=False, verbose=False)["input_ids"]  # cut below: no length warning
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
    got = {}
    hook = head.register_forward_hook(lambda module, inputs, output: got.__setitem__("v", output))
    try:
        v_eng(input_ids=mb["input_ids"], attention_mask=mb.get("attention_mask"), use_cache=False)
    finally:
        hook.remove()
    # in the reward's units: the normalisation of the RM it starts from ((raw − offset) / scale; none: identity)
    return normalized_reward(got["v"][..., 0][:, :-1].float(), v_eng.module.config)


@torch.no_grad()
def batched_values(v_eng, batch: dict, micro: int):
    """token_values without gradients over a whole rollout batch, `micro` rows at a time (V_old)."""
    n = batch["input_ids"].shape[0]
    return torch.cat([token_values(v_eng, select(batch, slice(i, i + micro))) for i in range(0, n, micro)])


def judge_scores(judge, r: Rollout) -> list[float]:
    """--judge: its pointwise score in [0, 1] of each episode (align.judge.Judge.scores), the prompt as the judge
    reads it (chat messages as `role: content` lines) and the whole response text (an episode's transcript)."""
    return judge.scores([as_text(p) for p in r.prompts], [c.text for c in r.completions])


def heldout_proxy(algo, records: list[dict]) -> tuple[list[dict], float]:
    """Each held-out greedy answer's learned scores in its record — the reward model's ("rm_score") and the
    judge's ("judge") — and their mean proxy score, RM + --judge-coef · judge as in training: eval/reward, which
    RLMonitor's reward_hacking_heldout sets beside the verified pass rate."""
    prompts, answers = [x["prompt"] for x in records], [x["greedy"] for x in records]
    proxy = torch.zeros(len(records))
    if algo.rm is not None:
        rm = score(algo.rm, algo.rm_tok, prompts, answers, 64).float().cpu()
        records, proxy = [{**x, "rm_score": v} for x, v in zip(records, rm.tolist())], rm
    if algo.judge is not None:
        judged = torch.tensor(algo.judge.scores([as_text(p) for p in prompts], answers))
        records = [{**x, "judge": v} for x, v in zip(records, judged.tolist())]
        proxy = proxy + algo.cfg.judge_coef * judged
    return records, proxy.mean().item()


def announce(algo) -> None:
    """The run's first line: the policy, the batch, the KL, ptx, gold reward, the score's parts and the value init."""
    cfg = algo.cfg
    gold = algo.gold_fn.name if algo.gold_fn else "off (no answer column)" if cfg.gold_reward else "off"
    if algo.gold_fn is not None:
        gold += f", trained on x{cfg.gold_reward_coef:g}" if cfg.gold_reward_coef else ", logged only"
    score = " + ".join([f"reward model {cfg.reward_model}"] * bool(cfg.reward_model) +
                       [f"{cfg.judge_coef:g} x judge {cfg.judge}"] * bool(cfg.judge))
    value = cfg.value_model or cfg.reward_model or f"{cfg.model} (the policy)"
    info(f"ppo: {count_parameters(algo.policy.module) / 1e6:.2f}M-parameter policy, {len(algo.rows)} prompts"
         f"{f' ({algo.dropped} longer than --max-prompt-length dropped)' if algo.dropped else ''}, "
         f"{cfg.prompts_per_step} episodes/step in minibatches of {cfg.minibatch_size} x {cfg.ppo_epochs} epochs, "
         f"{algo.run.dist.world_size} process(es), ZeRO-{algo.run.layout.zero_stage}; β {cfg.init_kl_coef} "
         f"({'fixed' if cfg.fixed_kl else f'adaptive, target {cfg.target_kl}'}), ptx γ {cfg.ptx_coef}"
         f"{f' on {len(algo.ptx)} texts' if algo.ptx else ''}, gold reward {gold}; score: {score}; value network "
         f"from {value}{'' if cfg.value_model or cfg.reward_model else ' with a new scalar head'}")
    if algo.rm is not None and not algo.rm_same_tok:
        warn(f"{cfg.reward_model}: tokenizer differs from the policy's "
             f"({tokenizer_difference(algo.tok, algo.rm_tok)}); responses are re-tokenised from text with the "
             "reward model's tokenizer and chat template.")


# ---------------------------------------------------------------------------------------------- the stage


class PPO:
    progress = ("reward", "gold_reward", "objective/kl", "kl_coef", "eval/pass@1/greedy")
    eval_at_start = True
    report_xy = ("objective/kl", ["reward", "gold_reward"])  # over-optimisation: proxy and gold reward vs KL

    def __init__(self, cfg: PPOConfig, run):
        cfg = run.cfg  # as the run resolved it: --lr, --warmup-steps left to it made concrete
        self.cfg, self.run = cfg, run
        sources = self.read_inputs()
        world = runtime.world_size()
        for flag, n in (("--prompts-per-step", cfg.prompts_per_step), ("--minibatch-size", cfg.minibatch_size),
                        ("--ptx-batch-size", cfg.ptx_batch_size if self.ptx else world)):
            if n % world:
                raise UserError(f"{flag} {n} must be a multiple of the {world} processes.")
        self.n_local, self.mb_local = cfg.prompts_per_step // world, cfg.minibatch_size // world
        run.choose_verifier(self.verifier)
        run.open(self.describe(sources), PPOPlan(cfg), lora=(sources["policy"], sources["value"]),
                 prompt_tokens=max(map(len, self.prompt_ids), default=0), notes=verifier_note(self.verifier))
        self.micro, accum = run.layout.micro, run.layout.accum
        self.updates_per_step = cfg.ppo_epochs * (self.n_local // self.mb_local)
        optim = Optim(cfg.lr, cfg.max_steps * self.updates_per_step, cfg.warmup_steps, cfg.schedule, cfg.weight_decay,
                      (0.9, 0.999))
        # the ptx batch is one more micro-batch of each policy optimiser step
        self.policy = run.train("policy", self.load(load_causal_lm, sources["policy"], self.tok), optim,
                                micro=self.micro, accum=accum + bool(self.ptx))
        self.value = run.train("value", self.load(load_sequence_classifier, sources["value"], self.tok),
                               replace(optim, lr=cfg.vf_lr), micro=self.micro, accum=accum, prefix="val/")
        offload = cfg.offload_frozen and run.layout.zero_stage == 3
        self.reference = run.reference(self.policy, self.load(load_causal_lm, sources["reference"], self.tok), offload,
                                       cfg.ref_model)
        self.rm = (run.frozen(self.load(load_reward_model, sources["reward_model"], self.rm_tok), offload)
                   if sources["reward_model"] else None)
        self.judge = load_judge(cfg.judge, cfg.rubric() or RUBRIC, where=f"--judge {cfg.judge}") if cfg.judge else None
        self.kl_ctl = (FixedKLController(cfg.init_kl_coef) if cfg.fixed_kl
                       else AdaptiveKLController(cfg.init_kl_coef, cfg.target_kl, cfg.kl_horizon))
        self.sampling = rollout_sampling(cfg, self.policy.eng)
        announce(self)

    def read_inputs(self) -> dict:
        """Models, tokenizers, prompts, gold verifier, tools, held-out and ptx data, checked before --out is touched."""
        cfg = self.cfg
        policy = resolve_default(cfg.model, "policy", "--model SFT_ARTIFACT")
        rm = cfg.reward_model and require_trained(resolve_default(cfg.reward_model, "reward",
                                                                  "--reward-model RM_ARTIFACT"), cfg.reward_model)
        sources = {"policy": policy, "reference": resolve(cfg.ref_model, expect="policy") if cfg.ref_model else policy,
                   "reward_model": rm, "value": resolve(cfg.value_model, expect=None) if cfg.value_model else rm or policy,
                   "judge": cfg.judge and resolve(cfg.judge, expect=None)}  # (no reward model: the policy's body)
        self.tok = load_tokenizer(policy, cfg.trust_remote_code, cfg.chat_template)
        self.rm_tok = rm and load_tokenizer(rm, cfg.trust_remote_code)
        self.rm_same_tok = bool(rm) and not tokenizer_difference(self.tok, self.rm_tok)
        check_shared_tokenizers(cfg, sources, self.tok)
        rows = D.load_rows(cfg.data, "prompts", cfg.columns)
        self.gold_fn = parse_rewards([cfg.gold_reward], "--gold-reward")[0] if cfg.gold_reward and "answer" in rows[0] else None
        probe([self.gold_fn] if self.gold_fn else [], rows, "--gold-reward", tokenizer=self.tok, where=cfg.data)
        rows, split = D.split_off(rows, cfg.eval_split, cfg.data)
        self.agent = tools.agent(cfg.tools, cfg.max_new_tokens, cfg.max_turns, cfg.max_tool_tokens, cfg.tool_timeout,
                                 tokenizer=self.tok)
        prompt_ids = D.encode_prompts(self.tok, [r["prompt"] for r in rows], self.agent and self.agent.schemas)
        keep = [i for i, p in enumerate(prompt_ids) if len(p) <= cfg.max_prompt_length]
        if not keep:
            raise UserError(f"{cfg.data}: every prompt is longer than --max-prompt-length {cfg.max_prompt_length} tokens "
                            f"(shortest {min(map(len, prompt_ids))}); raise --max-prompt-length or shorten the prompts.")
        self.dropped = len(rows) - len(keep)
        self.rows, self.prompt_ids = fitting([rows[i] for i in keep], [prompt_ids[i] for i in keep],
                                             context_length(policy), cfg.episode_tokens, cfg.data)
        if cfg.gold_reward_coef and self.gold_fn is None:
            raise UserError(f"{cfg.data}: --gold-reward-coef {cfg.gold_reward_coef} needs the verifier's `answer` "
                            "column in the prompts; add it (or --columns old=answer) or set --gold-reward-coef 0.")
        self.eval_rows = fitting_rows(D.load_rows(cfg.eval_data, "verifiable", cfg.columns, limit=cfg.eval_samples,
                                                  held_out=True) if cfg.eval_data and cfg.eval_samples else
                                      D.verifiable_rows(split[: cfg.eval_samples], cfg.data),
                                      self.tok, policy, cfg.episode_tokens, cfg.eval_data or cfg.data)
        self.verifier = held_out_verifier(cfg.verifier, self.eval_rows, self.tok, cfg.eval_data or cfg.data)
        self.ptx = ptx_examples(self.tok, cfg.ptx_data, cfg.ptx_max_length) if cfg.ptx_coef else []
        return sources

    def describe(self, sources: dict) -> dict:
        cfg = self.cfg
        inputs = describe_inputs(sources["policy"], cfg.data, cfg.eval_data if self.eval_rows else "",
                                 cfg.ptx_data if self.ptx else "")
        for key, role in (("ref_model", "reference"), ("reward_model", "reward_model"), ("value_model", "value"),
                          ("judge", "judge")):
            if sources[role]:
                inputs[key] = describe_inputs(sources[role])["model"]
        return inputs

    def load(self, loader, source, tok):
        return lambda dtype: disable_dropout(loader(source, tok, dtype, self.cfg.seed, self.cfg.trust_remote_code))

    # ---- 2. scores

    def rm_scores(self, r: Rollout) -> torch.Tensor:
        """Normalised RM scores of prompt + response (up to EOS): the rollout tokens themselves when the RM
        shares the policy's tokenizer, else the texts re-tokenised with the RM's."""
        if self.rm_same_tok:
            return score_ids(self.rm, self.tok, [(c.prompt_ids, c.ids) for c in r.completions], self.micro)
        return score(self.rm, self.rm_tok, r.prompts, [c.text for c in r.completions], self.micro)

    def scores(self, r: Rollout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(proxy: the RM's normalised score + --judge-coef · the judge's, s: the score trained on, gold: the
        verifier's), each [N]; the judge's scores in r.parts["judge"]."""
        cfg, device = self.cfg, self.run.dist.device
        proxy = self.rm_scores(r).to(device) if self.rm is not None else torch.zeros(len(r.completions), device=device)
        if self.judge is not None:  # RLAIF: + c · the judge's expected score
            r.parts["judge"] = judge_scores(self.judge, r)
            proxy = proxy + cfg.judge_coef * torch.tensor(r.parts["judge"], device=device)
        gold = torch.zeros_like(proxy)
        if self.gold_fn is not None:
            try:
                texts = [c.text if self.gold_fn.path else c.answer for c in r.completions]  # built-in: last turn
                gold = torch.tensor(every_number(self.gold_fn, call_rewards(
                    self.gold_fn, r.sample_rows, texts, [c.ids for c in r.completions])), device=device)
            except RewardError as e:
                raise UserError(f"--gold-reward: {e}") from None
        baseline = 0.0
        if cfg.gold_reward_coef:  # the other episodes' mean gold, over the whole batch (every process)
            sums = torch.stack([gold.sum(), gold.new_tensor(float(len(gold)))]).double()
            total, n = runtime.all_reduce_sum(sums).tolist()
            baseline = leave_one_out_mean(gold, total, n)
        s = episode_score(proxy, gold, r.finished.flatten().to(device), cfg.gold_reward_coef, baseline,
                             cfg.missing_eos_penalty, cfg.reward_clip)
        return proxy, s, gold

    # ---- 3-4. π_old, π_ref, V_old on the rollout; per-token rewards; GAE; whitened advantages

    def advantages(self, batch: dict, s: torch.Tensor, beta: float) -> dict:
        cfg, mask = self.cfg, batch["response_mask"]
        old_logp = batched_logprobs(self.policy, batch, self.micro, cfg.temperature, pack=cfg.packing)
        ref_logp = batched_logprobs(self.reference, batch, self.micro, cfg.temperature, pack=cfg.packing)
        old_values = batched_values(self.value, batch, self.micro) * mask
        kl = objectives.get("kl", cfg.kl_estimator).fn(old_logp, ref_logp) * mask
        adv, returns = gae(token_rewards(s, kl, mask, beta), old_values, mask, cfg.gamma, cfg.lam)
        adv = whiten(adv, mask, reduce=runtime.all_reduce_sum)
        return {"old_logp": old_logp, "ref_logp": ref_logp, "old_values": old_values, "kl": kl, "adv": adv,
                "returns": returns}

    # ---- 5. PPO epochs over shuffled minibatches: one optimiser step of each network per minibatch

    def update(self, step: int, batch: dict, stats: Stats) -> int:
        """Returns the epochs run (fewer than --ppo-epochs when --max-approx-kl stops the loop)."""
        cfg, dist = self.cfg, self.run.dist
        for epoch in range(cfg.ppo_epochs):
            epoch_kl = torch.zeros(2, dtype=torch.float64, device=dist.device)  # Σ approx-KL, Σ tokens
            for u, idx in enumerate(self.minibatches(step, epoch)):
                epoch_kl += self.minibatch(select(batch, idx.to(dist.device)), stats)
                if self.ptx:
                    self.ptx_step(step * self.updates_per_step + epoch * (self.n_local // self.mb_local) + u, stats)
            if cfg.max_approx_kl:
                total, tokens = runtime.all_reduce_sum(epoch_kl).tolist()
                if total / max(tokens, 1.0) > cfg.max_approx_kl:
                    return epoch + 1
        return cfg.ppo_epochs

    def minibatches(self, step: int, epoch: int) -> list[torch.Tensor]:
        """This rank's episodes of each of the epoch's K = prompts-per-step / minibatch-size minibatches: every run
        of K consecutive episodes of the global batch gives one episode to each minibatch, in an order drawn from
        the seed, step, epoch and the run's place. A rank holds whole runs (minibatch-size / world of them), so
        each rank has its equal share of every minibatch, and the minibatches are the same for any number of
        processes."""
        k = self.n_local // self.mb_local
        first = self.run.dist.rank * self.mb_local  # this rank's first run
        owner = torch.stack([torch.randperm(k, generator=torch.Generator().manual_seed(
            derive(self.cfg.seed, step, epoch, first + j) >> 1)) for j in range(self.mb_local)]).flatten()
        return [(owner == u).nonzero().flatten() for u in range(k)]

    def minibatch(self, mb: dict, stats: Stats) -> torch.Tensor:
        """The policy's and the value network's losses on one minibatch (token means over every rank's share)."""
        cfg = self.cfg
        n_tok = runtime.all_reduce_sum(mb["response_mask"].sum().double()).item()
        kl_sums = torch.zeros(2, dtype=torch.float64, device=mb["response_mask"].device)
        for i in range(0, self.mb_local, self.micro):
            mm = select(mb, slice(i, i + self.micro))
            mask = mm["response_mask"]
            logp, ent = logprobs(self.policy, mm, temperature=cfg.temperature, with_entropy=True,
                                 entropy_grad=bool(cfg.ent_coef), pack=cfg.packing)
            loss, metrics = ppo_policy_loss(PPOPolicyBatch(logp, mm["old_logp"], mm["adv"], ent, mask,
                                                           mm.get("sampler_logp")),
                                            cliprange=cfg.cliprange, ent_coef=cfg.ent_coef, tis_cap=cfg.tis_cap,
                                            n_tokens=n_tok)
            self.policy.backward(loss)
            v_loss, v_metrics = ppo_value_loss(token_values(self.value, mm), mm["old_values"], mm["returns"], mask,
                                               cliprange_value=cfg.cliprange_value, vf_coef=cfg.vf_coef, n_tokens=n_tok)
            self.value.backward(v_loss)
            for name, x in {**metrics, **v_metrics}.items():
                stats.mean(name, (x.double() * mask).sum(), mask.sum())
            approx_kl = metrics["policy/approxkl"]
            kl_sums += torch.stack([(approx_kl * mask).sum(), mask.sum()]).double()
        return kl_sums

    def ptx_step(self, update: int, stats: Stats) -> None:
        """PPO-ptx: + γ · LM loss on a batch of pretraining text (token mean over all ranks), the last micro-batch
        of the policy's optimiser step `update`."""
        device = self.run.dist.device
        idx = self.run.indices(len(self.ptx), self.cfg.ptx_batch_size, update, seed=self.cfg.seed + 1)
        b = D.to_device(D.collate_sft([self.ptx[i] for i in idx], self.tok.pad_token_id), device)
        n_local = (b["labels"][:, 1:] != -100).sum()
        n_ptx = runtime.all_reduce_sum(n_local.double()).item()
        nll, _ = completion_nll(self.policy(**D.model_inputs(b)).logits, b["labels"])
        self.policy.backward(self.cfg.ptx_coef * (nll / max(n_ptx, 1.0)))
        stats.mean("loss/ptx", nll, n_local)

    # ---- the step

    def step(self, step: int) -> Stats:
        cfg, dist, stats, times, beta = self.cfg, self.run.dist, Stats(), {}, self.kl_ctl.value
        with timed(times, "time/generate"):
            idx = self.run.indices(len(self.rows), cfg.prompts_per_step, step)
            r = sample(self.policy.eng, self.tok, [self.rows[i] for i in idx], [self.prompt_ids[i] for i in idx], 1,
                       replace(self.sampling, seed=derive(cfg.seed, step)), dist, cfg.gather, self.agent)
        with timed(times, "time/reward"):
            proxy, s, gold = self.scores(r)
        with timed(times, "time/score"), routing_replay(self.policy.eng, cfg.routing_replay, stats):
            batch = r.batch(self.tok.pad_token_id, dist.device)
            ro = self.advantages(batch, s, beta)
        with timed(times, "time/update"), routing_replay(self.policy.eng, cfg.routing_replay, stats):
            epochs = self.update(step, {**batch, **ro}, stats)
        # 6. the KL controller, on the batch's mean per-episode KL (of the sampling policy)
        kl_sum, scores_sum, n = runtime.all_reduce_sum(torch.stack([ro["kl"].sum(), s.sum(), proxy.new_tensor(
            float(len(proxy)))]).double()).tolist()
        self.kl_ctl.update(kl_sum / n, int(n))
        self.record(r, proxy, gold, batch, ro, stats)
        for k, v in {"objective/kl": kl_sum / n, "objective/scores": scores_sum / n, "kl_coef": beta,
                     "objective/rlhf_reward": scores_sum / n - beta * kl_sum / n, "ppo/epochs": epochs, **times}.items():
            stats.value(k, v)
        return stats

    def record(self, r: Rollout, proxy, gold, batch: dict, ro: dict, stats: Stats) -> None:
        mask, n = batch["response_mask"], len(proxy)
        record_mismatch(stats, batch, ro["old_logp"])
        stats.mean("reward", proxy.sum(), n)
        for k, v in r.parts.items():  # rewards/judge: the judge's part of the reward
            stats.mean(f"rewards/{k}", sum(v), len(v))
        if self.gold_fn is not None:
            stats.mean("gold_reward", gold.sum(), n)
        stats.mean("kl", ro["kl"].sum(), mask.sum())
        record_completions(stats, r)
        record_episodes(stats, r)
        stats.value("val/explained_variance", explained_variance(ro["old_values"], ro["returns"], mask,
                                                                    reduce=runtime.all_reduce_sum))

    # ---- evaluation, state and the end

    def evaluate(self, step: int) -> dict:
        if not self.eval_rows:
            return {}
        m, recs = evaluate_policy(self.policy.eng, self.tok, self.eval_rows, self.run.dist,
                                  sampling=Sampling(self.cfg.max_new_tokens, 0.0), gather=self.cfg.gather,
                                  verifier=self.verifier, agent=self.agent)
        recs, proxy = heldout_proxy(self, recs)
        save_eval_samples(self.run.out, step, recs, self.run.dist)
        # held-out gold (verified greedy answers) and proxy (the RM's score of the same answers), watched by
        # RLMonitor's reward_hacking_heldout with the KL per episode of the latest batch (0 before training)
        kl = self.run.monitor.history.get("objective/kl", [0.0])[-1] if step else 0.0
        return {"eval/pass@1/greedy": m["pass@1/greedy"], "eval/pass@1/greedy_stderr": m["pass@1/greedy_stderr"],
                "eval/reward": proxy,
                "eval/problems": float(len(recs)), "eval/kl": kl}

    def raise_kl(self, factor: float) -> str:
        """β ×factor (from 0: the stage's default initial β, 0.1); the adaptive controller goes on from there."""
        old = self.kl_ctl.value
        self.kl_ctl.value = old * factor if old > 0 else 0.1
        return f"kl_coef {old:.4g} -> {self.kl_ctl.value:.4g}"

    def state_dict(self) -> dict:
        return {"kl_coef": self.kl_ctl.value}

    def load_state_dict(self, state: dict) -> None:
        self.kl_ctl.value = state["kl_coef"]
        info(f"β restored: {self.kl_ctl.value:.4g}")

    def final_metrics(self, last: dict, start: dict) -> dict:
        history = self.run.monitor.history
        w = max(1, min(5, len(history["reward"]) // 2))
        final = {**{f"start/{k[5:]}": v for k, v in start.items()},
                 **{k: v for k, v in last.items() if k.startswith("eval/")}}
        for key, windows in (("reward", ("first", "last")), ("gold_reward", ("first", "last")), ("objective/kl", ("last",))):
            series = history.get(key, [])
            for name in windows if series else ():
                part = series[:w] if name == "first" else series[-w:]
                final[f"{key}/{name}{w}"] = sum(part) / len(part)
        return {**final, "kl_coef/final": self.kl_ctl.value}

    def output(self) -> Output:
        return Output(self.policy.eng, self.tok)

    def close(self, failed: bool = False) -> None:
        """Your tools' sandbox stops (--tools FILE.py:fn)."""
        if self.agent:
            self.agent.close()


def run(cfg: PPOConfig) -> dict:
    vision.refuse(cfg.model, "ppo")
    return train(cfg, "ppo", PPO)
