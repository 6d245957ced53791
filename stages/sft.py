"""Supervised fine-tuning: next-token loss on completion tokens only, on a DeepSpeed (ZeRO-3) engine.

loss = (1/N) Σ_{examples} Σ_{t ∈ completion} −log p_θ(y_t | prompt, y_<t), N = completion tokens in the global
batch (all ranks, all micro-batches), so 1 process and N processes compute the same gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

from align.config import StageConfig, TrainConfig, opt
from align.errors import UserError
from align.paths import DATA_DIR


@dataclass
class SFTConfig(TrainConfig):
    out: str = opt("runs/sft", "Output artifact directory.", path=True)
    data: str = opt(str(DATA_DIR / "arithmetic/train.jsonl"), "Training data: {prompt, completion} or {messages}.", path=True)
    eval_data: str = opt(str(DATA_DIR / "arithmetic/test.jsonl"), "Held-out data; pass@1 too if it has 'answer'.", path=True)
    max_steps: int = opt(1500, "Optimiser steps.")
    batch_size: int = opt(32, "Global batch size (examples per optimiser step, all processes).")
    lr: float = opt(2e-3, "Peak learning rate (AdamW).")
    warmup_steps: int = opt(50, "Linear warmup steps.")
    max_length: int = opt(256, "Max tokens per example; the prompt is cut from the left, never the completion.")
    packing: bool = opt(False, "Pack examples into rows of --max-length (block-diagonal attention); "
                               "--batch-size then counts packed rows.")
    eval_every: int = opt(500, "Evaluate (loss, pass@1) every N steps; 0: only at the end.")
    eval_samples: int = opt(200, "Held-out problems for pass@1.")
    max_new_tokens: int = opt(48, "Generation budget for pass@1.")


def run(cfg: SFTConfig) -> dict:
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
    from align.losses import completion_nll
    from align.models import count_parameters, load_causal_lm, load_tokenizer, resolve
    from align.report import plot_report
    from align.stage_io import describe_inputs, monitor_overrides

    # ---- inputs: checked before anything heavy starts, so bad input fails fast
    ref = resolve(cfg.model)
    train_rows = D.load_rows(cfg.data, "sft", cfg.columns)
    eval_rows = D.load_rows(cfg.eval_data, "sft", cfg.columns) if cfg.eval_data else []
    if cfg.resume and not (Path(cfg.out) / "checkpoints" / "latest").is_file():
        raise UserError(f"{cfg.out}: no checkpoint to resume from (checkpoints/latest); run without --resume.")
    tok = load_tokenizer(ref, cfg.trust_remote_code)
    examples = D.sft_examples(tok, train_rows, cfg.max_length)
    if not examples:
        raise UserError(f"{cfg.data}: no example fits --max-length {cfg.max_length}; raise it.")
    n_examples = len(examples)
    if cfg.packing:
        examples = D.pack_examples(examples, cfg.max_length)
    eval_examples = D.sft_examples(tok, eval_rows, cfg.max_length)
    verifiable = [r for r in eval_rows if "answer" in r and "prompt" in r][: cfg.eval_samples]
    dist = runtime.init()
    if n_examples < len(train_rows):
        info(f"[yellow]dropped {len(train_rows) - n_examples} examples whose completion exceeds --max-length[/]")
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    writer = ArtifactWriter(out, "sft", as_dict(cfg), describe_inputs(ref, cfg.data, cfg.eval_data), dist.is_main)

    # ---- model and engine
    setup = training.trainable_engine(
        cfg, dist, lambda dtype: load_causal_lm(ref, tok, dtype, cfg.seed, cfg.trust_remote_code))
    eng, dtype, micro, accum = setup.eng, setup.dtype, setup.micro, setup.accum
    n_params = count_parameters(eng.module)
    packed = f" in {len(examples)} packed rows" if cfg.packing else ""
    info(f"sft: {n_params / 1e6:.2f}M parameters, {n_examples} examples{packed}, {dist.world_size} process(es), "
         f"ZeRO-{cfg.zero_stage}, {dtype}, micro batch {micro} x accum {accum}, device {dist.device.type}")
    start = 0
    if cfg.resume:
        start = training.load_checkpoint(eng, out)["step"]
        writer.rewind(start)
        info(f"resumed from the checkpoint at step {start}")

    monitor = M.RLMonitor(overrides=monitor_overrides(cfg.monitor))
    sampling = Sampling(max_new_tokens=cfg.max_new_tokens, temperature=0.0)

    def evaluate(step: int) -> dict:
        metrics = {}
        if eval_examples:
            mine = training.rank_share(eval_examples[: 64 * dist.world_size * 4], dist) or eval_examples[:1]
            with torch.no_grad():
                tot = torch.zeros(2, device=dist.device)
                for i in range(0, len(mine), 64):
                    b = {k: v.to(dist.device) for k, v in D.collate_sft(mine[i : i + 64], tok.pad_token_id).items()}
                    nll, n = completion_nll(eng(**D.model_inputs(b)).logits, b["labels"])
                    tot += torch.stack([nll.float(), n.float()])
                runtime.all_reduce_sum(tot)
            metrics["eval/loss"] = (tot[0] / tot[1]).item()
        if verifiable:
            m, _ = evaluate_policy(eng, tok, verifiable, dist, sampling=sampling)
            metrics["eval/pass@1"] = m["pass@1/greedy"]
        if metrics:
            writer.log(step, metrics)
        return metrics

    # ---- train
    t0, train_time, tokens_seen, last_eval = time.time(), 0.0, 0, {}
    eng.train()
    with TrainProgress("sft", cfg.max_steps, start, keys=("loss", "lr", "eval/loss", "eval/pass@1")) as bar:
        for step in range(start, cfg.max_steps):
            t_step = time.time()
            idx = training.rank_share(training.step_indices(len(examples), cfg.batch_size, step, cfg.seed), dist)
            batch = [examples[i] for i in idx]
            n_global = runtime.all_reduce_sum(torch.tensor(float(sum(e["n_labels"] for e in batch)), device=dist.device))
            sums = torch.zeros(2, device=dist.device)  # [summed NLL, tokens incl. prompt] on this rank
            for m in range(accum):
                b = {k: v.to(dist.device) for k, v in D.collate_sft(batch[m * micro : (m + 1) * micro], tok.pad_token_id).items()}
                nll, _ = completion_nll(eng(**D.model_inputs(b)).logits, b["labels"])
                # DeepSpeed divides by `accum` and averages over ranks: undo both to get sum / N_global.
                eng.backward(nll / n_global * dist.world_size * accum)
                eng.step()
                sums += torch.stack([nll.detach().float(), (b["input_ids"] != tok.pad_token_id).sum().float()])
            runtime.all_reduce_sum(sums)
            loss = (sums[0] / n_global).item()
            tokens_seen += int(sums[1])
            train_time += time.time() - t_step
            metrics = {"loss": loss, "grad_norm": float(eng.get_global_grad_norm() or 0.0), "lr": eng.lr_scheduler.get_last_lr()[0]}
            metrics["tokens_per_s"] = tokens_seen / train_time
            done = step + 1
            if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.max_steps:
                last_eval = evaluate(done)
                metrics.update(last_eval)
            training.end_step(done, metrics, writer=writer, monitor=monitor, bar=bar, eng=eng, out=out,
                              shown=last_eval, save_every=cfg.save_every, max_steps=cfg.max_steps)

    # ---- save
    wall = time.time() - t0
    training.save_checkpoint(eng, out, cfg.max_steps)
    runtime.save_model(eng, tok, writer.begin_model(), dist)
    final = {
        "train/loss": loss, **last_eval, "parameters": n_params, "steps": cfg.max_steps,
        "wall_seconds": round(wall, 1), "train_seconds": round(train_time, 1),
        "tokens_per_s": round(tokens_seen / train_time, 1),
        "peak_memory_gib_per_rank": [round(m, 3) for m in runtime.all_gather_objects(runtime.peak_memory_gib(dist))],
    }
    partition = runtime.partition_stats(eng)
    if dist.is_main:
        plot_report(out / "metrics.jsonl", out / "report.png", f"sft — {cfg.model}")
    writer.complete(final, monitor.summary(), extra={"model_kind": "policy", "world_size": dist.world_size,
                                                      "zero_partition": partition})
    summary_table(f"sft complete → {out}", final)
    return final
