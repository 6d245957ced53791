"""Direct Preference Optimization: `align dpo`.

Per pair, with summed response-token log-probs (never averaged) of the policy π and the frozen reference π_ref,
    Δ = (log π(y_w|x) − log π_ref(y_w|x)) − (log π(y_l|x) − log π_ref(y_l|x))
    sigmoid  −(1−ε) log σ(βΔ) − ε log σ(−βΔ)   (DPO, Rafailov et al. 2023; ε > 0: conservative DPO)
    ipo      (Δ − 1/(2β))²                      (Azar et al. 2023)
    hinge    max(0, 1 − βΔ)                      (SLiC)
averaged over the pairs of the GLOBAL batch. Chosen and rejected go through each model in one forward.
The reference is a second, inference-only DeepSpeed engine of the same input model (or --ref-model); with
--precompute-ref its log-probs are computed once before training (for exactly the pairs training will use) and
the reference engine is freed. Implicit rewards: β(log π − log π_ref) of chosen / rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

from align.config import TrainConfig, opt
from align.errors import UserError
from align.paths import DATA_DIR


@dataclass
class DPOConfig(TrainConfig):
    out: str = opt("runs/dpo", "Output artifact directory.", path=True)
    ref_model: str = opt("", "Frozen reference model (default: the input --model).", path=True)
    data: str = opt(str(DATA_DIR / "prefs/train.jsonl"), "Preference pairs: {prompt, chosen, rejected}.", path=True)
    eval_data: str = opt(str(DATA_DIR / "prefs/test.jsonl"), "Held-out pairs for implicit-reward accuracy ('' : none).", path=True)
    pass_data: str = opt(str(DATA_DIR / "arithmetic/test.jsonl"), "Verifiable data for greedy pass@1 of policy and input model ('' : skip).", path=True)
    beta: float = opt(0.1, "β: strength of the implicit KL to the reference.")
    loss: str = opt("sigmoid", "sigmoid (DPO), ipo or hinge (SLiC).")
    label_smoothing: float = opt(0.0, "ε of conservative DPO (sigmoid loss only), 0 <= ε < 0.5.")
    precompute_ref: bool = opt(False, "Compute reference log-probs once before training and free the reference model.")
    max_steps: int = opt(300, "Optimiser steps.")
    batch_size: int = opt(32, "Global batch size in pairs (all processes).")
    lr: float = opt(1e-4, "Peak learning rate (AdamW).")
    warmup_steps: int = opt(20, "Linear warmup steps.")
    max_length: int = opt(256, "Max tokens of prompt + the longer response; the prompt is cut from the left.")
    eval_every: int = opt(100, "Held-out implicit-reward accuracy every N steps; 0: only at the end.")
    eval_pairs: int = opt(0, "Held-out pairs to evaluate (0: all).")
    eval_samples: int = opt(200, "Problems of --pass-data for greedy pass@1 (0: skip).")
    max_new_tokens: int = opt(48, "Generation budget for pass@1.")

    def validate(self):
        from align.losses import DPO_LOSSES

        super().validate()
        if self.loss not in DPO_LOSSES:
            raise UserError(f"--loss must be one of {', '.join(DPO_LOSSES)}, not {self.loss!r}.")
        if not 0 <= self.label_smoothing < 0.5:
            raise UserError(f"--label-smoothing must be in [0, 0.5), not {self.label_smoothing}.")
        if self.label_smoothing and self.loss != "sigmoid":
            raise UserError("--label-smoothing applies to --loss sigmoid only.")
        if self.beta <= 0:
            raise UserError(f"--beta must be positive, not {self.beta}.")


def pair_logps(eng, batch: dict):
    """(log π(y_w|x), log π(y_l|x)) summed over response tokens, from ONE forward of the 2B-row pair batch."""
    from align import data as D
    from align.fast_logprobs import fused_logprobs, supports
    from align.losses import IGNORE, sequence_logps

    if supports(getattr(eng, "module", eng)):  # chunked LM head: no [2B, T, V] logits
        sel = batch["labels"][:, 1:] != IGNORE
        lp, _ = fused_logprobs(eng, {**D.right_padded_inputs(batch), "response_mask": sel})
        return lp.sum(-1).view(2, -1)
    logps = sequence_logps(eng(**D.right_padded_inputs(batch)).logits, batch["labels"])
    return logps.view(2, -1)


def run(cfg: DPOConfig) -> dict:
    import gc
    import random
    import time
    from pathlib import Path

    import torch

    from align import data as D
    from align import monitor as M
    from align import runtime, training
    from align.artifacts import ArtifactWriter
    from align.config import as_dict
    from align.console import TrainProgress, info, summary_table
    from align.evaluation import evaluate_policy
    from align.generation import Sampling
    from align.losses import dpo_loss
    from align.models import count_parameters, load_causal_lm, load_tokenizer, resolve
    from align.report import plot_report
    from align.stage_io import describe_inputs, monitor_overrides
    from stages.rm import _gather, _load_pairs, _sharded

    # ---- inputs: checked before anything heavy starts, so bad input fails fast
    ref = resolve(cfg.model, expect="policy")
    ref_ref = resolve(cfg.ref_model, expect="policy") if cfg.ref_model else ref
    tok = load_tokenizer(ref, cfg.trust_remote_code)
    examples = _load_pairs(cfg.data, cfg.columns, tok, cfg.max_length)
    eval_examples = _load_pairs(cfg.eval_data, cfg.columns, tok, cfg.max_length) if cfg.eval_data else []
    if cfg.eval_pairs:
        eval_examples = eval_examples[: cfg.eval_pairs]
    verifiable = (D.load_rows(cfg.pass_data, "verifiable", limit=cfg.eval_samples)
                  if cfg.pass_data and cfg.eval_samples else [])
    dist = runtime.init()
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    inputs = describe_inputs(ref, cfg.data, cfg.eval_data, cfg.pass_data if verifiable else "")
    if cfg.ref_model:
        inputs["ref_model"] = describe_inputs(ref_ref)["model"]
    writer = ArtifactWriter(out, "dpo", as_dict(cfg), inputs, dist.is_main)

    # ---- policy (trained) and reference (frozen, inference-only) engines
    setup = training.trainable_engine(
        cfg, dist, lambda dtype: load_causal_lm(ref, tok, dtype, cfg.seed, cfg.trust_remote_code))
    eng, ds, dtype, micro, accum = setup.eng, setup.ds, setup.dtype, setup.micro, setup.accum
    ref_eng = runtime.engine(load_causal_lm(ref_ref, tok, dtype, cfg.seed, cfg.trust_remote_code), ds)
    n_params = count_parameters(eng.module)
    info(f"dpo: {n_params / 1e6:.2f}M parameters, {len(examples)} pairs, β {cfg.beta}, loss {cfg.loss}"
         f"{f' (ε {cfg.label_smoothing})' if cfg.label_smoothing else ''}, reference "
         f"{'precomputed' if cfg.precompute_ref else 'live'}, {dist.world_size} process(es), ZeRO-{cfg.zero_stage}, "
         f"{dtype}, micro batch {micro} pairs x accum {accum}")
    start = 0
    if cfg.resume:
        start = training.load_checkpoint(eng, out)["step"]
        writer.rewind(start)
        info(f"resumed from the checkpoint at step {start}")

    def logps_of(engine, exs: list[dict], batch_size: int = 32):
        """[len(exs), 2] (chosen, rejected) log-probs of `engine`, split over the ranks, in order on every rank."""
        mine, parts = _sharded(exs, dist), []
        with torch.no_grad():
            for i in range(0, len(mine), batch_size):
                b = {k: v.to(dist.device) for k, v in D.collate_pairs(mine[i : i + batch_size], tok.pad_token_id).items()}
                parts.append(pair_logps(engine, b).t().float().cpu())
        return _gather(torch.cat(parts), len(exs))

    # ---- reference log-probs: precomputed once (exactly the pairs training uses) or live each step
    pre_train: dict[int, torch.Tensor] = {}
    pre_eval = None
    if cfg.precompute_ref:
        t_pre = time.time()
        used = sorted({i for s in range(start, cfg.max_steps)
                       for i in training.step_indices(len(examples), cfg.batch_size, s, cfg.seed)})
        lp = logps_of(ref_eng, [examples[i] for i in used])
        pre_train = dict(zip(used, lp))
        pre_eval = logps_of(ref_eng, eval_examples) if eval_examples else None
        del ref_eng
        ref_eng = None
        gc.collect()
        info(f"reference log-probs precomputed for {len(used)} training + {len(eval_examples)} held-out pairs "
             f"in {time.time() - t_pre:.1f} s; reference model freed")

    monitor = M.RLMonitor(overrides=monitor_overrides(cfg.monitor))
    greedy = Sampling(max_new_tokens=cfg.max_new_tokens, temperature=0.0)

    def evaluate(step: int) -> dict:
        if not eval_examples:
            return {}
        eng.eval()
        pol = logps_of(eng, eval_examples)
        eng.train()
        rf = pre_eval if pre_eval is not None else logps_of(ref_eng, eval_examples)
        rc, rr = cfg.beta * (pol[:, 0] - rf[:, 0]), cfg.beta * (pol[:, 1] - rf[:, 1])
        metrics = {"eval/rewards/accuracies": (rc > rr).float().mean().item(), "eval/rewards/margins": (rc - rr).mean().item(),
                   "eval/logps/chosen": pol[:, 0].mean().item()}
        writer.log(step, metrics)
        return metrics

    pass_ref = {}
    if verifiable and start == 0:  # the input model, measured exactly as the policy is at the end
        m, _ = evaluate_policy(eng, tok, verifiable, dist, sampling=greedy)
        pass_ref = {"pass@1/reference": m["pass@1/greedy"]}
        info(f"input model greedy pass@1 on {len(verifiable)} problems of {cfg.pass_data}: {pass_ref['pass@1/reference']:.3f}")

    # ---- train
    keys = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")
    t0, train_time, last_eval = time.time(), 0.0, {}
    eng.train()
    with TrainProgress("dpo", cfg.max_steps, start, keys=("loss", "rewards/accuracies", "eval/rewards/accuracies")) as bar:
        for step in range(start, cfg.max_steps):
            t_step = time.time()
            idx = training.rank_share(training.step_indices(len(examples), cfg.batch_size, step, cfg.seed), dist)
            sums = torch.zeros(len(keys), device=dist.device)
            for m in range(accum):
                mb = idx[m * micro : (m + 1) * micro]
                b = {k: v.to(dist.device) for k, v in D.collate_pairs([examples[i] for i in mb], tok.pad_token_id).items()}
                pc, pr = pair_logps(eng, b)
                if cfg.precompute_ref:
                    rl = torch.stack([pre_train[i] for i in mb]).to(dist.device, pc.dtype)
                    rc_ref, rr_ref = rl[:, 0], rl[:, 1]
                else:
                    with torch.no_grad():
                        rc_ref, rr_ref = pair_logps(ref_eng, b)
                loss, rw_c, rw_r = dpo_loss(pc, pr, rc_ref, rr_ref, cfg.beta, cfg.loss, cfg.label_smoothing)
                # mean over the GLOBAL batch: DeepSpeed divides by `accum` and averages over ranks, undo both.
                eng.backward(loss.sum() / cfg.batch_size * dist.world_size * accum)
                eng.step()
                sums += torch.stack([loss.detach().sum(), rw_c.sum(), rw_r.sum(), (rw_c > rw_r).float().sum(),
                                     (rw_c - rw_r).sum(), pc.detach().sum(), pr.detach().sum()]).float()
            runtime.all_reduce_sum(sums)
            step_time = time.time() - t_step
            train_time += step_time
            metrics = dict(zip(keys, (sums / cfg.batch_size).tolist()))
            metrics.update(grad_norm=float(eng.get_global_grad_norm() or 0.0), lr=eng.lr_scheduler.get_last_lr()[0])
            metrics["time/step"] = step_time
            done = step + 1
            if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.max_steps:
                last_eval = evaluate(done)
                metrics.update(last_eval)
            training.end_step(done, metrics, writer=writer, monitor=monitor, bar=bar, eng=eng, out=out,
                              shown=last_eval, save_every=cfg.save_every, max_steps=cfg.max_steps)

    pass_pol = {}
    if verifiable:
        m, _ = evaluate_policy(eng, tok, verifiable, dist, sampling=greedy)
        pass_pol = {"pass@1/policy": m["pass@1/greedy"]}

    # ---- save
    wall = time.time() - t0
    training.save_checkpoint(eng, out, cfg.max_steps)
    runtime.save_model(eng, tok, writer.begin_model(), dist)
    final = {
        **{f"train/{k}": metrics[k] for k in keys}, **last_eval, **pass_pol, **pass_ref,
        "parameters": n_params, "steps": cfg.max_steps, "wall_seconds": round(wall, 1),
        "train_seconds": round(train_time, 1),
        "pairs_per_s": round((cfg.max_steps - start) * cfg.batch_size / max(train_time, 1e-9), 1),
        "peak_memory_gib_per_rank": [round(m, 3) for m in runtime.all_gather_objects(runtime.peak_memory_gib(dist))],
    }
    if dist.is_main:
        plot_report(out / "metrics.jsonl", out / "report.png", f"dpo — {cfg.model}")
    writer.complete(final, monitor.summary(), extra={"model_kind": "policy", "world_size": dist.world_size})
    summary_table(f"dpo complete → {out}", final)
    return final
