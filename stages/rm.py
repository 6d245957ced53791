"""Bradley–Terry reward model: `align rm train | eval | score`.

train: a reward head on the SFT model (--head): `scalar`, a new value head (AutoModelForSequenceClassification,
num_labels=1) read at the last non-padding token of prompt + response (+ EOS); or `likelihood`, the LM itself,
r = β · mean log π_φ(y_t | x, y_<t) over the response tokens (align.reward_model). Chosen and rejected go through
the model in ONE forward (concatenated along the batch); per pair

    loss = −log σ(r(x, y_w) − r(x, y_l) − m) + c · (r_w + r_l)²

averaged over the pairs of the GLOBAL batch (all ranks, all micro-batches), so 1 and N processes compute the same
gradient.
After training the reward is normalised (InstructGPT): offset (and with --normalize-scale, scale) such that the
reference responses score 0 on average (std 1): the chosen responses of the first --normalize-samples training
pairs, or samples of --normalize-on-policy MODEL. Offset and scale are written to artifact.json and to the saved
model's config (align_reward_offset / align_reward_scale); `align.reward_model.normalized_reward` applies them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from align import data as D
from align import runtime, vision
from align.artifacts import describe_inputs
from align.console import info
from align.data import load_pairs
from align.engine.build import Optim
from align.engine.plan import Data, Model, Plan, Setup, SupervisedPlan, trained_model, update_terms
from align.engine.run import Output, StageRun, chunks, train
from align.engine.stats import Stats
from align.errors import UserError
from align.models import check_length, count_parameters, load_causal_lm, load_tokenizer, resolve
from align.objectives.reward import rm_loss
from align.rollout.generation import Sampling, generate
from align.reward_model import (BETA_KEY, HEAD_KEY, OFFSET_KEY, SCALE_KEY, encode_scored, load_reward_model,
                                normalized_reward, raw_rewards, score_ids)
from stages.rm_config import RMConfig, RMEvalConfig, RMScoreConfig  # the options (light: no torch), re-exported

CALIBRATION_EDGES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0001)  # buckets of the BT confidence σ(|r_w − r_l|)


# ---------------------------------------------------------------------------------------------- scoring


@torch.no_grad()
def pair_rewards(eng, tok, examples: list[dict], dist, batch_size: int = 64):
    """Raw (r_chosen, r_rejected) of every pair, in order, on every rank (the work is split over the ranks)."""
    out = []
    for mb in chunks(runtime.shard(examples, dist, pad=True), batch_size):
        b = D.to_device(D.collate_pairs(mb, tok.pad_token_id), dist.device)
        out.append(raw_rewards(eng, b).view(2, -1).t().cpu())
    both = runtime.gather(torch.cat(out), len(examples))
    return both[:, 0], both[:, 1]


def sequence_rewards(eng, tok, seqs: list[tuple[list, list]], dist, batch_size: int = 64):
    """Raw rewards of (prompt ids, response ids) pairs, in order, on every rank."""
    return runtime.gather(score_ids(eng, tok, runtime.shard(seqs, dist, pad=True), batch_size, normalize=False),
                          len(seqs))


def pair_metrics(rc, rr, config) -> dict:
    """Pairwise accuracy, mean normalised margin, and calibration: accuracy vs BT confidence σ(|Δraw|) per bucket."""
    diff = rc - rr
    metrics = {"accuracy": (diff > 0).float().mean().item(),
               "margin/mean": (normalized_reward(rc, config) - normalized_reward(rr, config)).mean().item(),
               "rewards/chosen": normalized_reward(rc, config).mean().item(),
               "rewards/rejected": normalized_reward(rr, config).mean().item(), "pairs": len(rc)}
    conf = torch.sigmoid(diff.abs())
    lo = 0.5
    for hi in CALIBRATION_EDGES[1:]:
        sel = (conf >= lo) & (conf < hi)
        key = f"calibration/{lo:.1f}-{min(hi, 1.0):.1f}"
        if sel.any():
            metrics[f"{key}/n"] = int(sel.sum())
            metrics[f"{key}/accuracy"] = round((diff[sel] > 0).float().mean().item(), 4)
            metrics[f"{key}/confidence"] = round(conf[sel].mean().item(), 4)
        lo = hi
    return metrics


# ------------------------------------------------------------------------------------------------ train


@dataclass(frozen=True)
class RMPlan(SupervisedPlan):
    """Reward-model training in the memory plan: chosen and rejected in one forward (2 rows a pair), a score head
    (no logits) or the likelihood head's full logits."""

    cfg: RMConfig
    name: ClassVar[str] = "rm"

    def terms(self, plan: Plan, models: dict[str, Model], s: Setup, data: Data) -> None:
        cfg, a = self.cfg, models["policy"].arch
        head = "lm" if cfg.head == "likelihood" else "score"
        plan.add_state(trained_model(cfg, "reward model", a, head), s)
        update_terms(plan, a, 2 * self.micro_rows(s.world, data)[0], data.sequence(cfg.max_length), s,
               "full" if head == "lm" else "none")


class RewardModel:
    progress = ("loss", "accuracy", "eval/accuracy")

    def __init__(self, cfg: RMConfig, run):
        cfg = run.cfg  # as the run resolved it: --lr, --warmup-steps left to it made concrete
        self.cfg, self.run = cfg, run
        source = resolve(cfg.model, expect="policy")  # an RM starts from a causal LM (the SFT model); its head is new
        check_length(source, cfg.max_length)
        self.policy_source = resolve(cfg.normalize_on_policy, expect="policy") if cfg.normalize_on_policy else None
        self.tok = load_tokenizer(source, cfg.trust_remote_code, cfg.chat_template)
        rows, split = D.split_off(D.load_rows(cfg.data, "preference", cfg.columns), cfg.eval_split, cfg.data)
        self.examples = load_pairs(cfg.data, cfg.columns, self.tok, cfg.max_length, rows=rows)
        self.eval_examples = (load_pairs(cfg.eval_data, cfg.columns, self.tok, cfg.max_length, held_out=True)
                              if cfg.eval_data else
                              load_pairs(f"{cfg.data} (--eval-split)", "", self.tok, cfg.max_length, rows=split)
                              if split else [])

        extra = (cfg.normalize_on_policy,) if cfg.normalize_on_policy and Path(cfg.normalize_on_policy).is_file() else ()
        inputs = describe_inputs(source, cfg.data, cfg.eval_data, *extra)
        if self.policy_source is not None:
            inputs["normalize_on_policy"] = describe_inputs(self.policy_source)["model"]
        dist = run.open(inputs, RMPlan(cfg), lora=(source,), sequence_tokens=D.longest_row(self.examples))
        self.micro, accum = run.layout.micro, run.layout.accum
        self.rm = run.train("rm", lambda dtype: load_reward_model(source, self.tok, dtype, cfg.seed, cfg.trust_remote_code,
                                                                  cfg.head, cfg.likelihood_beta),
                            Optim(cfg.lr, cfg.max_steps, cfg.warmup_steps, cfg.schedule, cfg.weight_decay),
                            micro=self.micro, accum=accum)
        self.n_params = count_parameters(self.rm.module)
        info(f"rm: {cfg.head} head, {self.n_params / 1e6:.2f}M parameters, {len(self.examples)} pairs, {dist.world_size} process(es), "
             f"ZeRO-{run.layout.zero_stage}, {run.layout.precision}, micro batch {self.micro} pairs x accum "
             f"{accum}, "
             f"device {dist.device.type}")

    def step(self, step: int) -> Stats:
        cfg, stats = self.cfg, Stats()
        batch = [self.examples[i] for i in self.run.indices(len(self.examples), cfg.batch_size, step)]
        for mb in chunks(batch, self.micro):
            b = D.to_device(D.collate_pairs(mb, self.tok.pad_token_id), self.run.dist.device)
            rc, rr = raw_rewards(self.rm, b).view(2, -1)  # one forward: chosen rows, then rejected rows
            per_pair, metrics = rm_loss(rc, rr, b["margin"].to(rc.dtype), cfg.center_coef)
            self.rm.backward(per_pair.sum() / cfg.batch_size)  # the mean over the pairs of the global batch
            for name, x in metrics.items():
                stats.mean(name, x.sum(), len(mb))
            stats.sum("pairs", len(mb))
        return stats

    def evaluate(self, step: int) -> dict:
        if not self.eval_examples:
            return {}
        m = pair_metrics(*pair_rewards(self.rm.eng, self.tok, self.eval_examples, self.run.dist), {})
        return {"eval/accuracy": m["accuracy"], "eval/margin": m["margin/mean"]}

    def normalisation(self) -> tuple[float, float, str]:
        """(offset, scale, what they were fitted on): the reference responses score 0 on average (and std 1 with
        --normalize-scale). The reference set is written to normalization.jsonl so it can be audited."""
        cfg, dist = self.cfg, self.run.dist
        ref = self.examples[: cfg.normalize_samples]
        if self.policy_source is None:
            seqs = [(e["prompt_ids"], e["chosen_ids"]) for e in ref]
            fitted_on = f"chosen responses of the first {len(seqs)} training pairs"
        else:
            policy = self.run.frozen(lambda dtype: load_causal_lm(self.policy_source, self.tok, dtype, cfg.seed,
                                                                  cfg.trust_remote_code))
            torch.manual_seed(cfg.seed * 1000 + dist.rank)
            outs = generate(policy, self.tok, [e["prompt_ids"] for e in ref],
                            Sampling(max_new_tokens=cfg.max_new_tokens, temperature=1.0, seed=cfg.seed), dist)
            seqs = [(e["prompt_ids"], o.ids + ([] if o.finished else [self.tok.eos_token_id])) for e, o in zip(ref, outs)]
            del policy
            fitted_on = f"{len(seqs)} samples (T=1) of {cfg.normalize_on_policy} on the first training prompts"
        raw = sequence_rewards(self.rm.eng, self.tok, seqs, dist)
        offset = raw.mean().item()
        scale = raw.std().item() if cfg.normalize_scale and len(raw) > 1 else 1.0
        if not scale > 1e-8:
            raise UserError("the reference rewards have zero spread; cannot --normalize-scale.")
        info(f"normalisation on {fitted_on}: offset {offset:.4f}, scale {scale:.4f}")
        if dist.is_main:
            with open(self.run.out / "normalization.jsonl", "w") as f:
                for (prompt, response), r in zip(seqs, raw.tolist()):
                    f.write(json.dumps({"prompt_ids": prompt, "response_ids": response,
                                        "raw": r, "reward": (r - offset) / scale}) + "\n")
        return offset, scale, fitted_on

    def output(self) -> Output:
        self.rm.eng.eval()
        self.offset, self.scale, fitted_on = self.normalisation()
        return Output(self.rm.eng, self.tok, kind="reward",
                      config={OFFSET_KEY: self.offset, SCALE_KEY: self.scale, "pad_token_id": self.tok.pad_token_id,
                              HEAD_KEY: self.cfg.head,
                              **({BETA_KEY: self.cfg.likelihood_beta} if self.cfg.head == "likelihood" else {})},
                      extra={"reward_offset": self.offset, "reward_scale": self.scale, "normalized_on": fitted_on,
                             "reward_head": self.cfg.head})

    def final_metrics(self, last: dict, start: dict) -> dict:
        return {"train/loss": last["loss"], "train/accuracy": last["accuracy"],
                **{k: v for k, v in last.items() if k.startswith("eval/")},
                "reward_offset": self.offset, "reward_scale": self.scale, "parameters": self.n_params}


def run(cfg: RMConfig) -> dict:
    vision.refuse(cfg.model, "rm")
    return train(cfg, "rm", RewardModel)


# ------------------------------------------------------------------------------------------- eval, score


def run_eval(cfg: RMEvalConfig) -> dict:
    source = resolve(cfg.model, expect="reward")
    tok = load_tokenizer(source, cfg.trust_remote_code, cfg.chat_template)
    examples = load_pairs(cfg.data, cfg.columns, tok, cfg.max_length)
    with StageRun(cfg, "rm-eval") as run:
        dist = run.open(describe_inputs(source, cfg.data))
        eng = run.frozen(lambda dtype: load_reward_model(source, tok, dtype, trust_remote_code=cfg.trust_remote_code))
        rc, rr = pair_rewards(eng, tok, examples, dist, cfg.batch_size)
        config = eng.module.config
        if dist.is_main:
            nc, nr = normalized_reward(rc, config), normalized_reward(rr, config)
            with open(run.out / "pairs.jsonl", "w") as f:
                for a, b in zip(nc.tolist(), nr.tolist()):
                    f.write(json.dumps({"reward_chosen": a, "reward_rejected": b, "correct": a > b}) + "\n")
        return run.complete(pair_metrics(rc, rr, config), f"rm eval of {cfg.model} on {cfg.data}")


def run_score(cfg: RMScoreConfig) -> dict:
    source = resolve(cfg.model, expect="reward")
    rows = D.load_rows(cfg.data, "responses", cfg.columns)
    tok = load_tokenizer(source, cfg.trust_remote_code, cfg.chat_template)
    seqs = encode_scored(tok, [r["prompt"] for r in rows], [r["response"] for r in rows], cfg.max_length)
    with StageRun(cfg, "rm-score") as run:
        dist = run.open(describe_inputs(source, cfg.data))
        eng = run.frozen(lambda dtype: load_reward_model(source, tok, dtype, trust_remote_code=cfg.trust_remote_code))
        rewards = normalized_reward(sequence_rewards(eng, tok, seqs, dist, cfg.batch_size), eng.module.config)
        scores = run.out / "scores.jsonl"
        if dist.is_main:
            with open(scores, "w") as f:
                for row, r in zip(rows, rewards.tolist()):
                    f.write(json.dumps({**row, "reward": r}) + "\n")
        metrics = {"rows": len(rows), "reward/mean": rewards.mean().item(),
                   "reward/std": rewards.std().item() if len(rows) > 1 else 0.0, "scores": str(scores)}
        return run.complete(metrics, f"rm score of {cfg.data}")
