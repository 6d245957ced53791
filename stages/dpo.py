"""Direct Preference Optimization: `align dpo`.

Per pair, from summed response-token log-probs (never averaged) of the policy π and the frozen reference π_ref,
the preference loss registered as --loss (align.objectives.preference, each with its formula and paper: sigmoid
(DPO), ipo, ipo-mean, hinge; without a reference model simpo and orpo; kto on unpaired rows {prompt, completion,
label}, or pairs unpaired), + α · (−log π(y_w|x) / |y_w|) with --nll-coef α (RPO, Pang et al. 2024: keeps the
chosen answer likely), averaged over the pairs of the GLOBAL batch. Chosen and rejected go through each model in
one forward. The reference (for a loss that needs one) is a second, inference-only engine of the input model (or
--ref-model); with --precompute-ref its log-probs are computed once before training (for exactly the pairs
training will use) and the reference is freed. Implicit rewards: the loss's own (β(log π − log π_ref) of chosen /
rejected for DPO; simpo, orpo: β·ℓ(y), ℓ the per-token mean log-prob). Greedy pass@1 of the input model and of
the policy on --pass-data.

--online (online DPO: Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback"; Xiong et al.
2024, iterative DPO): the pairs come from the CURRENT policy. Every --online-every steps, each slot of the next
steps' batches gets one prompt of --data, --online-samples samples of it at --temperature, and a judge — the
--verifier on the row, the score of an `align rm train` artifact (--reward-model), or an LLM judge (--judge,
align.judge: with 2 samples pairwise, P(a ≻ b) asked in both orders so a position bias cancels; with more
pointwise, each sample's expected score) — ranks them: chosen = the best sample, rejected = the worst. A prompt
whose samples all score the same (an LLM judge's within judge_pairs.TIE) gives no pair; its slot keeps a weight
of 0, and the loss is the mean over the pairs that exist in the global batch.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import ClassVar

import torch

from align import data as D
from align import runtime
from align.artifacts import describe_inputs
from align.console import info
from align.data import load_pairs
from align.engine.build import Optim
from align.engine.plan import (Data, Model, Plan, Setup, SupervisedPlan, chunked_logit_bytes, inference_bytes,
                               judge_terms, judge_tokens, model_state, reference_model, rollout_terms, trained_model,
                               update_terms)
from align.engine.run import Output, chunks, step_indices, train
from align.engine.stats import Stats
from align.errors import UserError
from align.judge import PAIR_RUBRIC, RUBRIC, as_text, judged_records, rank_samples
from align.judge import load as load_judge
from align.judge_pairs import TIE
from align.logprobs import logprobs
from align.vision import batch_images
from align.models import check_length, count_parameters, disable_dropout, load_causal_lm, load_tokenizer, resolve
from align.objectives.preference import Pairs, dpo_loss, kto_loss
from align.objectives.tokens import IGNORE
from align.reward_model import load_reward_model, require_trained, score
from align.rewards import choose_verifier, row_fields
from align.rollout.evaluation import (evaluate_policy, fitting, fitting_rows, held_out_verifier, save_eval_samples,
                                      verifier_note)
from align.rollout.generation import Sampling, generate_on_rank
from stages.dpo_config import DPOConfig  # the options (light: no torch), re-exported

DPO_REF_TOKENS = 16384  # tokens per forward of the live reference (DPO.reference_logps)
KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
        "logps/rejected")


@dataclass(frozen=True)
class DPOPlan(SupervisedPlan):
    """DPO in the memory plan: the policy's update on 2 rows a pair; a live reference's forwards of a step's pairs
    in a phase of their own before it (--precompute-ref: 32 pairs at a time, then the reference is freed); with
    --online, a rollout of the policy and the judging reward model."""

    cfg: DPOConfig
    name: ClassVar[str] = "dpo"

    @property
    def auto_micro(self) -> bool:
        return not self.cfg.online

    def models(self) -> dict[str, str]:
        cfg = self.cfg
        return {"policy": cfg.model, **({"reference": cfg.ref_model} if cfg.ref_model else {}),
                **({"reward model": cfg.reward_model} if cfg.reward_model and cfg.online else {}),
                **({"judge": cfg.judge} if cfg.judge and cfg.online else {})}

    def phases(self) -> tuple[str, ...]:
        return (("rollout",) if self.cfg.online else ()) + (() if self.cfg.reference_free else ("reference pass",)) + (
            "update",)

    def terms(self, plan: Plan, models: dict[str, Model], s: Setup, data: Data) -> None:
        cfg, a = self.cfg, models["policy"].arch
        length, rows = data.sequence(cfg.max_length), 2 * self.micro_rows(s.world, data)[0]
        policy = trained_model(cfg, "policy", a)
        plan.add_state(policy, s)
        ref = None if cfg.reference_free else reference_model(plan, models, cfg.lora_r, cfg.ref_model)
        if ref is not None:
            phases = ("reference pass",) if cfg.precompute_ref else plan.phases
            plan.add("reference: weights", model_state(ref, s)["weights"], *phases)
        if not cfg.reference_free:  # (a LoRA policy's reference: the policy itself, its adapters off)
            # --precompute-ref: 32 pairs at a time; live: a step's pairs in forwards of up to DPO_REF_TOKENS tokens
            # (at least a micro-batch), before the policy's micro-batches
            ref_rows = 64 if cfg.precompute_ref else max(rows, 2 * (DPO_REF_TOKENS // (2 * max(length, 1))))
            arch = ref.arch if ref is not None else a
            plan.add("reference pass: forward", inference_bytes(arch, ref_rows, length, s) +
                     chunked_logit_bytes(ref_rows * length, arch.vocab), "reference pass")
        if "reward model" in models:
            plan.add("reward model: weights", model_state(models["reward model"], s)["weights"])
        if cfg.online:
            rollout_terms(plan, policy, 64, data.prompt(), cfg.max_new_tokens, s)
            judge_terms(plan, models, cfg.batch_size // s.world * cfg.online_every * cfg.online_samples,
                        judge_tokens(cfg.rubric() or (PAIR_RUBRIC if cfg.pairwise else RUBRIC), data.prompt(),
                                     (1 + cfg.pairwise) * cfg.max_new_tokens), s, "rollout")
        update_terms(plan, a, rows, length, s)


def row_logps(model, batch: dict, pack: bool = False) -> torch.Tensor:
    """[N]: log π(y|x) summed over each row's response tokens (never averaged). The rows are right-padded, so no
    attention mask is passed (causal attention never looks right) and attention runs its fused causal kernel;
    `pack` (--packing): padding-free, the rows packed into fewer (align.logprobs.packing)."""
    rows = {"input_ids": batch["input_ids"], "response_mask": batch["labels"][:, 1:] != IGNORE}
    lp, _ = logprobs(model, {**rows, **batch_images(batch)}, pack=pack)  # a VLM's rows: their images too
    return lp.sum(-1)


def pair_logps(model, batch: dict, pack: bool = False) -> torch.Tensor:
    """[2, B]: log π(y_w|x) and log π(y_l|x) from ONE forward of the 2B-row pair batch."""
    return row_logps(model, batch, pack).view(2, -1)


class DPO:
    progress = ("loss", "rewards/accuracies", "eval/rewards/accuracies")
    heldout_key = "eval/rewards/accuracies"  # --on-alarm stop keeps the best held-out pair accuracy's weights
    train_keys = KEYS
    eval_at_start = True  # greedy pass@1 of the input model, measured exactly as the policy's at the end
    prompt_ids: tuple = ()  # --online: the prompts' tokens (their longest sizes the memory plan's rollout)
    judging = None  # --online without --reward-model: the verifier that ranks the samples (rewards.Verifier)
    formats: str | tuple[str, ...] = "preference"  # what load_rows reads --data as
    split_examples: list = []  # the --eval-split part of --data (load_train)

    def __init__(self, cfg: DPOConfig, run):
        cfg = run.cfg  # as the run resolved it: --lr, --warmup-steps left to it made concrete
        self.cfg, self.run = cfg, run
        source = resolve(cfg.model, expect="policy")
        ref_source = resolve(cfg.ref_model, expect="policy") if cfg.ref_model else source
        check_length(source, cfg.max_length)
        self.tok = load_tokenizer(source, cfg.trust_remote_code, cfg.chat_template)
        self.examples = self.load_train()
        self.eval_examples = self.load_examples(cfg.eval_data) if cfg.eval_data else self.split_examples
        if cfg.eval_pairs:
            self.eval_examples = self.eval_examples[: cfg.eval_pairs]
        self.verifiable = fitting_rows(D.load_rows(cfg.pass_data, "verifiable", cfg.columns, limit=cfg.eval_samples,
                                                   held_out=True) if cfg.pass_data and cfg.eval_samples else [],
                                       self.tok, source, cfg.max_new_tokens, cfg.pass_data)
        self.verifier = held_out_verifier(cfg.verifier, self.verifiable, self.tok, cfg.pass_data)

        inputs = describe_inputs(source, cfg.data, cfg.eval_data, cfg.pass_data if self.verifiable else "")
        if cfg.ref_model:
            inputs["ref_model"] = describe_inputs(ref_source)["model"]
        rm_source = require_trained(resolve(cfg.reward_model, expect="reward"), cfg.reward_model) if cfg.reward_model else None
        if rm_source:
            inputs["reward_model"] = describe_inputs(rm_source)["model"]
        if cfg.judge and cfg.online:
            inputs["judge"] = describe_inputs(resolve(cfg.judge, expect=None))["model"]
        run.choose_verifier(self.verifier)
        dist = run.open(inputs, DPOPlan(cfg), lora=(source,), sequence_tokens=D.longest_row(self.examples),
                        prompt_tokens=max(map(len, self.prompt_ids), default=None),
                        notes={**verifier_note(self.verifier),
                               **({"judge": self.judging.record()} if self.judging else {}),
                               **({"judge": {"model": cfg.judge, "form": "pairwise" if cfg.pairwise else "pointwise"}}
                                  if cfg.judge and cfg.online else {})})
        self.micro, accum = run.layout.micro, run.layout.accum

        def load(src):
            return lambda dtype: disable_dropout(load_causal_lm(src, self.tok, dtype, cfg.seed, cfg.trust_remote_code))

        self.policy = run.train("policy", load(source), Optim(cfg.lr, cfg.max_steps, cfg.warmup_steps, cfg.schedule,
                                                              cfg.weight_decay), micro=self.micro, accum=accum)
        if cfg.reference_free:
            self.reference = None
        else:
            self.reference = run.reference(self.policy, load(ref_source), ref_model=cfg.ref_model)
        self.rm_tok = load_tokenizer(rm_source, cfg.trust_remote_code) if rm_source else None
        self.rm = (run.frozen(lambda dtype: load_reward_model(rm_source, self.rm_tok, dtype, cfg.seed,
                                                              cfg.trust_remote_code)) if rm_source else None)
        self.lm_judge = online_judge(cfg) if cfg.judge and cfg.online else None
        self.ref_train: dict[int, torch.Tensor] | None = None  # --precompute-ref: pair index -> [2] log-probs
        self.ref_eval = None
        self.n_params = count_parameters(self.policy.module)
        info(f"dpo: {self.n_params / 1e6:.2f}M parameters, {f'{len(self.examples)} pairs' if not cfg.online else 'online pairs'}, "
             f"β {cfg.beta}, loss {cfg.loss}"
             f"{f' (ε {cfg.label_smoothing})' if cfg.label_smoothing else ''}"
             f"{f' + RPO NLL α {cfg.nll_coef}' if cfg.nll_coef else ''}, reference "
             f"{'none' if cfg.reference_free else 'precomputed' if cfg.precompute_ref else 'live'}, "
             f"{dist.world_size} process(es), ZeRO-{run.layout.zero_stage}, {run.layout.precision}, micro batch "
             f"{self.micro} "
             f"pairs x accum {accum}")

    def load_train(self) -> list[dict]:
        """--data's examples; with --eval-split, less the part held out (self.split_examples)."""
        cfg = self.cfg
        if not cfg.eval_split:
            return self.load_examples(cfg.data)
        rows, split = D.split_off(D.load_rows(cfg.data, self.formats, cfg.columns), cfg.eval_split, cfg.data)
        self.split_examples = self.load_examples(f"{cfg.data} (--eval-split)", split)
        return self.load_examples(cfg.data, rows)

    def load_examples(self, path: str, rows: list[dict] | None = None) -> list[dict]:
        """The tokenised pairs of `path` (or of `rows` already read from it)."""
        return load_pairs(path, self.cfg.columns, self.tok, self.cfg.max_length, held_out=path != self.cfg.data,
                          rows=rows)

    @torch.no_grad()
    def chunked_logps(self, model, examples: list[dict], batch_size: int) -> torch.Tensor:
        """[2, len(examples)] (chosen, rejected) log-probs of this rank's `examples`, `batch_size` pairs a forward."""
        device = self.run.dist.device
        return torch.cat([pair_logps(model, D.to_device(D.collate_pairs(mb, self.tok.pad_token_id), device),
                                     self.cfg.packing) for mb in chunks(examples, batch_size)], dim=1)

    def logps_of(self, model, examples: list[dict], batch_size: int = 32) -> torch.Tensor:
        """[len(examples), 2] (chosen, rejected) log-probs, split over the ranks, in order on every rank."""
        mine = self.chunked_logps(model, runtime.shard(examples, self.run.dist, pad=True), batch_size)
        return runtime.gather(mine.t().float().cpu(), len(examples))

    def precompute_reference(self) -> None:
        """--precompute-ref: the reference's log-probs of every pair any step uses (the same set on a resumed run,
        so the numbers are the same) and of the held-out pairs, then the reference engine is freed."""
        t, cfg = time.time(), self.cfg
        used = sorted({i for s in range(cfg.max_steps)
                       for i in step_indices(len(self.examples), cfg.batch_size, s, cfg.seed)})
        self.ref_train = dict(zip(used, self.logps_of(self.reference, [self.examples[i] for i in used])))
        self.ref_eval = self.logps_of(self.reference, self.eval_examples) if self.eval_examples else None
        self.reference = None
        gc.collect()
        info(f"reference log-probs precomputed for {len(used)} training + {len(self.eval_examples)} held-out pairs "
             f"in {time.time() - t:.1f} s; reference model freed")

    @torch.no_grad()
    def reference_logps(self, pairs: list[dict], idx: list) -> torch.Tensor | None:
        """[2, len(pairs)]: the reference's (chosen, rejected) log-probs of this rank's pairs of a step (None
        without a reference): precomputed (--precompute-ref), else forwards of up to DPO_REF_TOKENS tokens each,
        however small the policy's micro-batches are — a frozen forward keeps no activations, and at short pairs
        the step's reference is then one forward of large matmuls instead of one of small ones per micro-batch."""
        if self.cfg.reference_free:
            return None
        if self.ref_train is not None:
            return torch.stack([self.ref_train[i] for i in idx]).t().to(self.run.dist.device)
        return self.chunked_logps(self.reference, pairs, max(self.micro, DPO_REF_TOKENS // (2 * D.longest_row(pairs))))

    def pair_loss(self, pairs: Pairs) -> tuple[torch.Tensor, dict]:
        """(loss per pair, metrics per pair) of --loss (+ RPO's NLL with --nll-coef): objectives.dpo_loss."""
        cfg = self.cfg
        return dpo_loss(pairs, cfg.loss, cfg.beta, label_smoothing=cfg.label_smoothing, gamma=cfg.simpo_gamma,
                        nll_coef=cfg.nll_coef)

    def step(self, step: int) -> Stats:
        cfg, stats = self.cfg, Stats()
        if cfg.precompute_ref and self.ref_train is None:
            self.precompute_reference()
        idx = self.run.indices(len(self.examples), cfg.batch_size, step)
        self.train_on([self.examples[i] for i in idx], idx, torch.ones(len(idx)), cfg.batch_size, stats)
        return stats

    def train_on(self, pairs: list[dict], idx: list, weights: torch.Tensor, n_pairs: float, stats: Stats) -> None:
        """One optimiser step on this rank's `pairs` (`idx`: their keys for precomputed reference log-probs), each
        weighing `weights` (online DPO: 0 for a slot without a pair): the loss is the weighted sum over the pairs
        of the global batch divided by its `n_pairs`."""
        cfg, device = self.cfg, self.run.dist.device
        ref = self.reference_logps(pairs, idx) if pairs else None
        for sl in chunks(list(range(len(pairs))), self.micro):
            b = D.to_device(D.collate_pairs([pairs[i] for i in sl], self.tok.pad_token_id), device)
            w = weights[sl].to(device)
            pc, pr = pair_logps(self.policy, b, self.cfg.packing)
            lengths = (b["labels"][:, 1:] != IGNORE).sum(-1).view(2, -1)
            rc, rr = (None, None) if ref is None else ref[:, sl].to(pc.dtype)
            loss, metrics = self.pair_loss(Pairs(pc, pr, rc, rr, *lengths))
            self.policy.backward((loss * w).sum() / max(n_pairs, 1.0))  # the mean over the global batch's pairs
            for name, x in metrics.items():
                stats.mean(name, (x.float() * w).sum(), w.sum())
            stats.sum("pairs", w.sum())

    def evaluate(self, step: int) -> dict:
        cfg = self.cfg
        metrics = self.held_out() if step > 0 and self.eval_examples else {}
        if self.verifiable and step in (0, cfg.max_steps):
            m, recs = evaluate_policy(self.policy.eng, self.tok, self.verifiable, self.run.dist, verifier=self.verifier,
                                      sampling=Sampling(max_new_tokens=cfg.max_new_tokens, temperature=0.0))
            if self.lm_judge is not None and not cfg.pairwise:  # a pointwise judge's score of each greedy answer
                recs, metrics["eval/reward"] = judged_records(self.lm_judge, recs)
            save_eval_samples(self.run.out, step, recs, self.run.dist)
            metrics["eval/pass@1/greedy"] = m["pass@1/greedy"]
            metrics["eval/pass@1/greedy_stderr"] = m["pass@1/greedy_stderr"]
            metrics["eval/problems"] = float(m["problems"])
            if step == 0:
                info(f"input model greedy pass@1 on {len(self.verifiable)} problems of {cfg.pass_data}: "
                     f"{m['pass@1/greedy']:.3f}")
        return metrics

    def held_out(self) -> dict:
        """Implicit-reward accuracy and margin on the held-out pairs: the loss's own rewards, as in training
        (β(log π − log π_ref) for DPO; per-token means for ipo-mean; β · the per-token mean log-prob for simpo and
        orpo)."""
        cfg, pol = self.cfg, self.logps_of(self.policy.eng, self.eval_examples)
        n = torch.tensor([[len(e["chosen_ids"]), len(e["rejected_ids"])] for e in self.eval_examples])
        ref = None
        if not cfg.reference_free:
            ref = self.ref_eval if self.ref_eval is not None else self.logps_of(self.reference, self.eval_examples)
        _, m = self.pair_loss(Pairs(pol[:, 0], pol[:, 1], None if ref is None else ref[:, 0],
                               None if ref is None else ref[:, 1], n[:, 0], n[:, 1]))
        return {"eval/rewards/accuracies": m["rewards/accuracies"].mean().item(),
                "eval/rewards/margins": m["rewards/margins"].mean().item(), "eval/logps/chosen": pol[:, 0].mean().item()}

    def final_metrics(self, last: dict, start: dict) -> dict:
        final = {**{f"train/{k}": last[k] for k in self.train_keys}, **{k: v for k, v in last.items() if k.startswith("eval/")}}
        if "eval/pass@1/greedy" in last:
            final["pass@1/policy"] = final.pop("eval/pass@1/greedy")
        if "eval/pass@1/greedy" in start:
            final["pass@1/reference"] = start["eval/pass@1/greedy"]
        return {**final, "parameters": self.n_params}

    def output(self) -> Output:
        return Output(self.policy.eng, self.tok)


class KTO(DPO):
    """--loss kto: the policy against the live reference on unpaired rows. Per step, first the reference point z0
    from every mismatched row of the GLOBAL batch (no gradient), then the loss of each micro-batch's rows."""

    progress = ("loss", "kl", "eval/rewards/accuracies")
    train_keys = ("loss", "kl", "rewards/desirable", "rewards/undesirable")
    formats = ("unpaired", "preference")

    def load_examples(self, path: str, rows: list[dict] | None = None) -> list[dict]:
        cfg = self.cfg
        if rows is None:
            rows = D.load_rows(path, self.formats, cfg.columns, held_out=path != cfg.data)  # read once
        paired = "label" not in rows[0]
        examples = D.unpaired_examples(self.tok, rows, cfg.max_length, source=str(path))
        n_good = sum(e["label"] for e in examples)
        info(f"{path}: {len(examples)} rows for KTO ({n_good} desirable, {len(examples) - n_good} undesirable"
             f"{', from preference pairs' if paired else ''})")
        return examples

    def batches(self, step: int) -> list[tuple[dict, dict]]:
        """(matched rows, mismatched rows) of each micro-batch of global batch `step`, on the device. The row at
        place k of the global batch of N is mismatched with the prompt at place k + 1 mod N: the reference point's
        pairs are the global batch's, the same for any micro-batch size and number of processes."""
        cfg = self.cfg
        glob = step_indices(len(self.examples), cfg.batch_size, step, cfg.seed)  # this rank's share: runtime.shard
        out = []
        for places in chunks(runtime.shard(list(range(len(glob))), self.run.dist), self.micro):
            rows = [self.examples[glob[k]] for k in places]
            others = [self.examples[glob[(k + 1) % len(glob)]]["prompt_ids"] for k in places]
            b = D.to_device(D.collate_kto(rows, self.tok.pad_token_id, others), self.run.dist.device)
            n = len(places)
            out.append(({"input_ids": b["input_ids"][:n], "labels": b["labels"][:n], "desirable": b["desirable"]},
                        {"input_ids": b["input_ids"][n:], "labels": b["labels"][n:]}))
        return out

    def step(self, step: int) -> Stats:
        cfg, stats = self.cfg, Stats()
        batches = self.batches(step)
        with torch.no_grad():  # the reference point: the global batch's mean log-ratio on mismatched rows
            kl = sum((row_logps(self.policy, m, cfg.packing) - row_logps(self.reference, m, cfg.packing)).sum()
                     for _, m in batches)
            kl_sums = runtime.all_reduce_sum(torch.stack([kl.float(), torch.tensor(float(cfg.batch_size), device=kl.device)]))
        for matched, _ in batches:
            pol = row_logps(self.policy, matched, cfg.packing)
            with torch.no_grad():
                ref = row_logps(self.reference, matched, cfg.packing)
            loss, reward, z0 = kto_loss(pol, ref.to(pol.dtype), kl_sums, matched["desirable"], cfg.beta,
                                        cfg.desirable_weight, cfg.undesirable_weight)
            self.policy.backward(loss.sum() / cfg.batch_size)
            good = matched["desirable"].float()
            stats.mean("loss", loss.sum(), len(loss))
            stats.mean("rewards/desirable", (reward * good).sum(), good.sum())
            stats.mean("rewards/undesirable", (reward * (1 - good)).sum(), (1 - good).sum())
            stats.mean("kl", z0 * len(loss), len(loss))
            stats.sum("pairs", len(loss))
        return stats

    @torch.no_grad()
    def logps_of(self, model, examples: list[dict], batch_size: int = 32) -> torch.Tensor:
        """[len(examples), 1] summed log-probs of each row's own completion, in order on every rank."""
        dist = self.run.dist
        parts = [row_logps(model, {k: v[: len(mb)] for k, v in D.to_device(D.collate_kto(mb, self.tok.pad_token_id),
                                                                            dist.device).items()},
                           self.cfg.packing)[:, None].float().cpu()
                 for mb in chunks(runtime.shard(examples, dist, pad=True), batch_size)]
        return runtime.gather(torch.cat(parts), len(examples))

    def held_out(self) -> dict:
        """The share of held-out rows whose implicit reward β(log π − log π_ref) sits on their label's side of 0
        (desirable above the reference, undesirable below), and the mean reward gap between the two kinds."""
        examples = self.eval_examples
        r = self.cfg.beta * (self.logps_of(self.policy.eng, examples) - self.logps_of(self.reference, examples))[:, 0]
        label = torch.tensor([e["label"] for e in examples])
        both = bool(label.any() and (~label).any())
        return {"eval/rewards/accuracies": ((r > 0) == label).float().mean().item(),
                "eval/rewards/margins": (r[label].mean() - r[~label].mean()).item() if both else 0.0}


def online_judge(cfg: DPOConfig):
    """--judge loaded (align.judge.load), --judge-rubric the rubric of its form (`DPOConfig.pairwise`)."""
    rubric = cfg.rubric()
    pointwise, pairwise = (RUBRIC, rubric or PAIR_RUBRIC) if cfg.pairwise else (rubric or RUBRIC, PAIR_RUBRIC)
    return load_judge(cfg.judge, pointwise, pairwise, where=f"--judge {cfg.judge}")


def ranker(cfg: DPOConfig) -> str:
    """What ranks online DPO's samples, for the run's first lines ('' : the verifier)."""
    if cfg.judge:
        form = "pairwise, both orders" if cfg.pairwise else "pointwise, its expected score"
        return f"the judge {cfg.judge} ({form})"
    return f"--reward-model {cfg.reward_model}" if cfg.reward_model else ""


def best_worst(scores: torch.Tensor, tie: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online DPO's pairs from a judge's scores [P, K] of K samples of each of P prompts: (index of the best
    sample [P], of the worst [P], weight [P]): weight 1 where the best scores above the worst by more than `tie`,
    0 where all K tie (no preference: no pair). Ties at the top or the bottom go to the first such sample."""
    best, worst = scores.argmax(1), scores.argmin(1)
    rows = torch.arange(len(scores))
    return best, worst, (scores[rows, best] - scores[rows, worst] > tie).float()


class OnlineDPO(DPO):
    """--online: each step's pairs are sampled from the current policy and ranked by the judge (see the module
    docstring). The pairs of --online-every steps are sampled at once, at the first of them; a run resumed inside
    such a window samples the rest of it anew."""

    progress = ("loss", "online/reward", "rewards/accuracies")
    train_keys = (*KEYS, "online/reward", "online/pair_frac")

    def load_train(self) -> list[dict]:
        cfg = self.cfg
        rows = D.load_rows(cfg.data, "prompts", cfg.columns)
        if not cfg.reward_model and not cfg.judge and "answer" not in rows[0] and cfg.verifier == "auto":
            raise UserError(f"{cfg.data}: --online ranks samples with the verifier, which needs an 'answer' column "
                            "(or pass --reward-model RM_ARTIFACT, --judge MODEL, or --verifier file.py:FUNCTION).")
        # a pair is prompt + one sample: it fits --max-length (already checked against the model's context)
        self.rows, self.prompt_ids = fitting(rows, D.encode_prompts(self.tok, [r["prompt"] for r in rows]),
                                             cfg.max_length, cfg.max_new_tokens, cfg.data)
        self.judging = None if cfg.reward_model or cfg.judge else choose_verifier(cfg.verifier, self.rows, self.tok,
                                                                                   cfg.data)
        self.judge = self.judging and self.judging.fn
        self.buffer: dict[int, tuple[list[dict], torch.Tensor, float]] = {}  # step -> (pairs, weights, mean score)
        info(f"dpo --online: {len(self.rows)} prompts of {cfg.data}, {cfg.online_samples} samples each at T "
             f"{cfg.temperature}, new pairs every {cfg.online_every} step(s), ranked by "
             f"{ranker(cfg) or 'the ' + self.judging.line}")
        return []

    def rank(self, rows: list[dict], completions) -> torch.Tensor:
        """[n] the judge's score of each completion (verifier: its reward; RM: its normalised score; --judge:
        judge.rank_samples', a pair's two P(this ≻ the other) with 2 samples, else its expected score)."""
        if self.lm_judge is not None:
            prompts = [as_text(r["prompt"]) for r in rows]
            return rank_samples(self.lm_judge, prompts, [c.text for c in completions], self.cfg.online_samples)
        if self.rm is not None:
            texts = [r["prompt"] for r in rows]
            return score(self.rm, self.rm_tok, texts, [c.text for c in completions], self.micro).float().cpu()
        return torch.tensor([float(self.judge(r["prompt"], c.text, **row_fields(r))) for r, c in zip(rows, completions)])

    def sample_window(self, step: int) -> None:
        """Fill self.buffer for the steps from `step` to the end of its --online-every window: this rank's
        slots (micro x accum per step), one prompt each, ONE generation call for the whole window."""
        cfg, dist = self.cfg, self.run.dist
        steps = range(step, min(cfg.max_steps, step - step % cfg.online_every + cfg.online_every))
        idx = [i for s in steps for i in self.run.indices(len(self.rows), cfg.batch_size, s)]
        K = cfg.online_samples
        prompts = [self.prompt_ids[i] for i in idx for _ in range(K)]
        # each sample's place in (step, slot of the step's global batch, sample), for its sampling key: the same
        # samples for any number of processes and any grouping of the steps into windows
        share = cfg.batch_size // dist.world_size  # this rank's slots of each step (runtime.shard)
        places = [(s * cfg.batch_size + dist.rank * share + j) * K + k for s in steps for j in range(share)
                  for k in range(K)]
        done = generate_on_rank(self.policy.eng, self.tok, prompts,
                                Sampling(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed),
                                dist, batch_size=64, indices=places)
        rows = [self.rows[i] for i in idx for _ in range(K)]
        scores = self.rank(rows, done).view(len(idx), K)
        best, worst, weights = best_worst(scores, TIE if self.lm_judge is not None else 0.0)
        pairs = [{"prompt_ids": self.prompt_ids[i], "chosen_ids": done[j * K + best[j]].ids,
                  "rejected_ids": done[j * K + worst[j]].ids, "margin": 0.0} for j, i in enumerate(idx)]
        per = len(idx) // len(steps)
        for n, s in enumerate(steps):
            sl = slice(n * per, (n + 1) * per)
            self.buffer[s] = (pairs[sl], weights[sl], scores[sl].mean().item())

    def step(self, step: int) -> Stats:
        stats, device = Stats(), self.run.dist.device
        if step not in self.buffer:
            self.buffer = {}
            self.sample_window(step)
        pairs, weights, reward = self.buffer.pop(step)
        n_pairs = runtime.all_reduce_sum(weights.sum().to(device)).item()  # pairs in the global batch
        stats.mean("online/reward", reward * len(weights), len(weights))
        stats.mean("online/pair_frac", weights.sum(), len(weights))
        self.train_on(pairs, list(range(len(pairs))), weights, n_pairs, stats)
        return stats


def run(cfg: DPOConfig) -> dict:
    return train(cfg, "dpo", KTO if cfg.unpaired else OnlineDPO if cfg.online else DPO)
