"""Training plumbing every stage shares: optimiser + schedule, deterministic global batches, checkpoints,
and the step-end bookkeeping (log, monitor, progress)."""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from align import runtime
from align.errors import UserError


def batch_layout(global_batch: int, micro_batch: int, world: int) -> tuple[int, int]:
    """(micro batch per rank, gradient accumulation steps) for a global batch; must divide evenly."""
    if micro_batch <= 0:
        micro_batch = max(1, global_batch // world)
    if global_batch % (micro_batch * world):
        raise UserError(
            f"--batch-size {global_batch} is not a multiple of micro batch {micro_batch} x {world} processes; "
            "change --batch-size or --micro-batch-size."
        )
    return micro_batch, global_batch // (micro_batch * world)


def step_indices(n: int, global_batch: int, step: int, seed: int) -> list[int]:
    """The example indices of optimiser step `step` (0-based): epochs of seeded permutations, identical on every
    rank and for any number of ranks, so a 2-process run sees exactly the examples a 1-process run sees."""
    out = []
    pos = step * global_batch
    while len(out) < global_batch:
        epoch, offset = divmod(pos, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
        take = perm[offset : offset + global_batch - len(out)]
        out += take
        pos += len(take)
    return out


def rank_share(items: list, dist: runtime.Dist) -> list:
    per = len(items) // dist.world_size
    return items[dist.rank * per : (dist.rank + 1) * per]


def lr_lambda(schedule: str, warmup: int, total: int):
    """Linear warmup, then cosine or linear decay to 10% (or constant)."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "cosine":
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        if schedule == "linear":
            return 1.0 - 0.9 * progress
        return 1.0

    return f


def adamw(model, lr: float, weight_decay: float, betas=(0.9, 0.95), offload: bool = False):
    """AdamW, weight decay on matrices only (the fused kernel on GPU machines). With --offload-optimizer on a GPU
    machine the step runs on the CPU: DeepSpeed's vectorised CPUAdam (built once per machine, ~1 min; several
    times faster than torch's CPU AdamW), or torch's AdamW where the build fails."""
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if offload and torch.cuda.is_available():
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(groups, lr=lr, betas=betas, adamw_mode=True)
        except Exception as e:  # no compiler / build error: still correct, just a slower optimiser step
            from align.console import warn

            warn(f"DeepSpeedCPUAdam unavailable ({type(e).__name__}: {str(e)[:200]}); the offloaded optimiser "
                 "step uses torch's AdamW on the CPU")
    # GPU machines: the fused kernel (a few launches per step, no parameter-sized temporaries as the default
    # foreach AdamW allocates); on CPU-only machines torch's default, which the CPU tests pin down.
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=torch.cuda.is_available() or None)


def save_checkpoint(eng, out: Path, step: int, client_state: dict | None = None) -> None:
    """Keep one DeepSpeed checkpoint (model, optimiser, scheduler, client state) under out/checkpoints."""
    ckpt = out / "checkpoints"
    tag = f"step{step}"
    eng.save_checkpoint(str(ckpt), tag=tag, client_state={"step": step, **(client_state or {})})
    runtime.barrier()
    if runtime.init().is_main:
        for old in ckpt.iterdir():
            if old.is_dir() and old.name != tag:
                shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(eng, out: Path) -> dict:
    ckpt = out / "checkpoints"
    if not (ckpt / "latest").is_file():
        raise UserError(f"{ckpt}: no checkpoint to resume from; run without --resume.")
    path, state = eng.load_checkpoint(str(ckpt))
    if path is None:
        raise UserError(f"{ckpt}: checkpoint could not be loaded; run without --resume.")
    return state or {}


def end_step(step: int, metrics: dict, *, writer, monitor, bar, eng, out: Path, shown: dict | None = None,
             save_every: int = 0, max_steps: int = 0) -> None:
    """Everything a stage does after an optimiser step: log the step's metrics (eval lines are logged where they
    are computed), feed RLMonitor and print its events, move the progress bar, and on a `stop` event
    checkpoint, mark the artifact failed and exit 1; else checkpoint every `save_every` steps."""
    writer.log(step, {k: v for k, v in metrics.items() if not k.startswith("eval/")})
    events = monitor.update(step, metrics)
    writer.log_events(events)
    for e in events:
        colour = "red" if e.severity == "stop" else "yellow"
        bar.print(f"[{colour}]health {e.severity}: {e.rule} at step {step}: {e.message}[/]")
    bar.update(step, {**(shown or {}), **metrics})
    if monitor.should_stop(events):
        stop = next(e for e in events if e.severity == "stop")
        reason = f"RLMonitor stop at step {step}: {stop.rule}: {stop.message}"
        save_checkpoint(eng, out, step)
        writer.fail(reason, metrics, monitor.summary())
        bar.print(f"[bold red]{reason} (checkpoint saved; fix and rerun, or --resume)[/]")
        raise SystemExit(1)
    if save_every and step % save_every == 0 and step < max_steps:
        save_checkpoint(eng, out, step)


@dataclass
class Setup:
    """A trainable engine and what it was built with. Keep it alive for the stage: `loader` keeps ZeRO-3
    partitioned loading on for any further model (a reference) loaded with `ds`."""

    eng: object
    ds: dict
    dtype: torch.dtype
    micro: int
    accum: int
    loader: object


def trainable_engine(cfg, dist: runtime.Dist, load_model) -> Setup:
    """DeepSpeed config from a TrainConfig's batch/clip/zero options, the model from `load_model(dtype)` (loaded
    straight into ZeRO-3 shards), AdamW and warmup + decay schedule, all wrapped in one engine."""
    micro, accum = batch_layout(cfg.batch_size, cfg.micro_batch_size, dist.world_size)
    dtype = runtime.compute_dtype(dist, cfg.precision)
    ds = runtime.ds_config(zero_stage=cfg.zero_stage, micro_batch=micro, grad_accum=accum, world_size=dist.world_size,
                           dtype=dtype, grad_clip=cfg.grad_clip, user_config=cfg.deepspeed,
                           precision=cfg.precision, offload_optimizer=cfg.offload_optimizer)
    loader = runtime.ZeroLoader(ds)
    model = load_model(dtype)
    optimizer = adamw(model, cfg.lr, cfg.weight_decay, offload=cfg.offload_optimizer)
    schedule = lr_lambda(cfg.schedule, cfg.warmup_steps, cfg.max_steps)
    eng = runtime.engine(model, ds, optimizer, lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
    return Setup(eng, ds, dtype, micro, accum, loader)
