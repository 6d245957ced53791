"""StageRun: the life of one stage run, written once for every stage.

    with StageRun(cfg, "sft") as run:
        algo = SFT(cfg, run)      # checks its inputs, then run.open(...) (from here --out is written) and
                                  # builds its engines with run.train(...) / run.frozen(...)
        run.fit(algo)             # the step loop: algo.step(step) -> Stats, reduced in one all-reduce; eval,
                                  # metrics.jsonl, RLMonitor, progress, checkpoints, --resume
        return run.finish(algo)   # final checkpoint, report, artifact "complete" (fit saved model/ first)

An algorithm (stages/*.py) provides `step(step) -> Stats`, `output() -> Output`, `final_metrics(last, start)`, and
optionally `evaluate(step) -> dict` (`eval/...` metrics; with `eval_at_start` also at step 0), `progress` (the
keys on the progress bar), `report_xy`, `state_dict()` / `load_state_dict()` (its own resumable state) and
`close()` (called once training ends, or fails: what it holds beside its engines).

Exact resume: a checkpoint holds every trained engine (model, optimiser, scheduler), every rank's RNG, the step,
the algorithm's state and RLMonitor's; each step re-seeds the RNGs from (seed, step, rank) and draws its data
from a pure function of (seed, step), so a resumed run takes the same path as an uninterrupted one.

Disk: before training, the run checks that its filesystem has room for what it will save (the model, the
checkpoints it keeps and the one it writes beside them) and refuses with exit 2, --out left as it was, if not;
each save is checked again before it is written. The model is saved first at the end of training, before the
last evaluation, the final checkpoint and the report.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from align import runtime, trackers
from align.artifacts import ArtifactWriter
from align.compile_cache import compile_seconds
from align.config import as_dict, load_toml
from align.console import TrainProgress, info, summary_table, warn
from align.engine import checkpoint, disk, outdir, plan
from align.engine.alarm import BEST_DIR, Alarms
from align.engine.build import (Optim, Trained, adamw, compiles, compute_dtype, ds_config, engine_stage, frozen_config,
                                load_partitioned, lr_lambda, own_clipping, resolve_precision, wrap)
from align.errors import Terminated, UserError
from align.lora import AdaptersOff, check_targets, is_peft, with_lora
from align.models import skeleton
from align.optim import AdamWSR

RATES = ("tokens", "pairs")  # Stats.sum counts a stage may log: the run adds <name>_per_s per step and overall


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


def chunks(items, size: int) -> list:
    """Consecutive micro-batches of `size` items (the last may be shorter)."""
    return [items[i : i + size] for i in range(0, len(items), size)]


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # every device


@dataclass
class Output:
    """What a finished stage saves: `engine`'s weights with `tokenizer` as model/, `config` added to the model's
    config.json, `kind` (policy | reward) and `extra` in artifact.json."""

    engine: object
    tokenizer: object
    kind: str = "policy"
    config: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)


class StageRun:
    def __init__(self, cfg, stage: str):
        self.cfg, self.stage, self.out = cfg, stage, Path(cfg.out)
        outdir.check(cfg, stage)  # at once: a refused --out is said before the inputs are read
        self.dist: runtime.Dist | None = None
        self.writer: ArtifactWriter | None = None
        self.engines: dict[str, Trained] = {}  # the trained engines, checkpointed by name
        self.start_eval: dict = {}  # the evaluation at step 0 (the "before" numbers)
        self.last_eval: dict = {}
        self.last: dict = {}  # the last step's metrics
        self.train_seconds = 0.0
        self.counted: dict[str, float] = {}  # RATES counted since this process started
        self._link = None  # transformers' ZeRO-3 loading link, alive while engines are built
        self.compile = False  # the engines' blocks are compiled (set by open)
        self.lock: Path | None = None
        self.stop_signal: int | None = None  # SIGINT / SIGTERM received during the step loop
        self.sigterm = False  # a SIGTERM has been received (any later one is the same request)
        self.in_loop = False
        self._handlers: dict = {}  # the signal handlers open() replaced, restored at the end
        self._untouched: disk.Untouched | None = None  # --out before open() wrote to it (rank 0)
        self.output: Output | None = None  # the saved model's Output, once model/ is written
        self.evaluated_at: int | None = None  # the step of a final evaluation a resumed checkpoint holds
        self.monitor = None
        self.resumed: list[dict] = []  # the resumes of this run: {step, max_steps of the checkpoint}
        self.alarms = Alarms(self)  # --on-alarm
        self._rollback_to: int | None = None  # set by an --on-alarm rollback: the step the loop continues from
        if getattr(cfg, "monitor", None) is not None:
            from align.monitor import RLMonitor

            path = cfg.monitor
            overrides = load_toml(path) if path else None
            self.monitor = RLMonitor(overrides=overrides.get("monitor", overrides) if overrides else None)

    # ---- lifecycle

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        try:
            self._fail_if_running(exc)
        finally:
            if self.lock is not None:
                self.lock.unlink(missing_ok=True)
            for sig, handler in self._handlers.items():  # a stop on SIGTERM ignores its repeats to the end
                signal.signal(sig, signal.SIG_IGN if sig == signal.SIGTERM and self.sigterm else handler)
        return False

    def _fail_if_running(self, exc) -> None:
        if exc is not None and self.writer is not None and self.writer.running:
            if isinstance(exc, KeyboardInterrupt):
                reason = "interrupted (SIGINT)"
            elif isinstance(exc, Terminated):
                reason = "terminated (SIGTERM)"
            elif isinstance(exc, SystemExit):
                reason = f"exited with code {exc.code}"
            elif isinstance(exc, UserError):
                reason = str(exc)
            else:
                reason = f"{type(exc).__name__}: {exc}"
            self.writer.fail(reason, self.last, self.monitor.summary() if self.monitor else None)

    def open(self, inputs: dict, distributed: bool = True, prompt_tokens: int | None = None,
             sequence_tokens: int | None = None, started: float | None = None) -> runtime.Dist | None:
        """Every input is checked: the memory plan (sized by the data's longest prompt / example) may stop the run
        here, before anything is built or written (align.engine.plan); then take --out (checked when the run was
        made: `outdir.check`; refused here if another run holds it), start the process group and write
        artifact.json ("running"; `started`: when the work began, if before this call)."""
        if distributed:
            plan.preflight(self.cfg, self.stage, plan.Data(prompt_tokens, sequence_tokens))
        if getattr(self.cfg, "resume", False):
            state = checkpoint.read_state(self.out)
            self._check_resumable(state)
            checkpoint.check_world_size(self.out, state, runtime.world_size())
        main = runtime.rank() == 0
        if main:
            self._untouched = disk.Untouched(self.out)
            self.lock = outdir.lock(self.out)
        self._handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        if distributed:
            self.dist = runtime.init()
            keep = getattr(self.cfg, "offload_optimizer", False) or getattr(self.cfg, "offload_frozen", False)
            self.precision = resolve_precision(self.dist.device, self.cfg.precision, offload=keep)
            self.dtype = compute_dtype(self.dist.device, self.precision)
            if self.monitor is not None:
                self.monitor.set_precision(self.precision)  # rollout_mismatch's tolerance
            self.zero_stage, note = engine_stage(self.cfg.zero_stage, self.dist.world_size, self.dist.device, keep,
                                                 self.cfg.deepspeed)
            if note:
                info(note)
            self.compile = compiles(getattr(self.cfg, "compile", False), self.dist.device, self.zero_stage,
                                    self.dist.world_size)
            if self.compile:
                info("torch.compile: every engine's transformer blocks are compiled (the first steps compile, a "
                     f"later run reuses the code cached in {os.environ.get('TORCHINDUCTOR_CACHE_DIR')}; "
                     "--no-compile runs eagerly)")
            seed_all(self.cfg.seed)
        self.writer = ArtifactWriter(self.out, self.stage, as_dict(self.cfg), inputs, main, started)
        names = trackers.parse(getattr(self.cfg, "report_to", ""))
        if main and names:  # the experiment trackers: metrics.jsonl's rows and RLMonitor's events, on rank 0
            resume = getattr(self.cfg, "resume", False)
            self.writer.sinks.append(trackers.Trackers(names, self.out, self.writer.record, resume))
        return self.dist

    def _on_signal(self, signum, frame) -> None:
        """Ctrl-C / SIGTERM: inside the step loop the step finishes, every rank learns of it through the step's
        all-reduce, and the run checkpoints and stops; anywhere else, or Ctrl-C a second time, it stops at once.
        SIGTERM is one request however often it comes: a worker told of its launcher's death (PR_SET_PDEATHSIG)
        gets one SIGTERM per thread of the dead launcher, and a repeat must not break off the graceful stop (one
        rank gone mid-collective would fail its peers) nor the failure report being written."""
        if signum == signal.SIGTERM and self.sigterm:
            return
        self.sigterm = self.sigterm or signum == signal.SIGTERM
        if not self.in_loop or self.stop_signal is not None:
            raise KeyboardInterrupt if signum == signal.SIGINT else Terminated()
        self.stop_signal = signum
        again = "Ctrl-C again" if signum == signal.SIGINT else "SIGKILL"
        info(f"[yellow]{signal.Signals(signum).name}: stopping after this step (checkpoint, then exit); "
             f"{again} to stop at once[/]")

    # ---- engines

    def check_lora(self, *sources) -> None:
        """With --lora-r, before open(): --lora-targets names Linear layers of each model that gets adapters
        (`sources`: models.ModelSource), checked on weightless copies."""
        if getattr(self.cfg, "lora_r", 0):
            for source in sources:
                check_targets(self.cfg, skeleton(source, self.cfg.trust_remote_code), source.spec)

    def train(self, name: str, load, optim: Optim, *, micro: int = 1, accum: int = 1, prefix: str = "") -> Trained:
        """A trained engine of the model `load(dtype)` returns (loaded straight into ZeRO-3 shards), with AdamW
        and `optim`'s schedule; `accum` micro-batches of `micro` rows make one optimiser step."""
        cfg = self.cfg
        ds = ds_config(zero_stage=self.zero_stage, micro_batch=micro, grad_accum=accum,
                       world_size=self.dist.world_size, dtype=self.dtype, grad_clip=cfg.grad_clip,
                       user_config=cfg.deepspeed, precision=self.precision, offload_optimizer=cfg.offload_optimizer)
        clip = own_clipping(ds)
        model, self._link = load_partitioned(ds, with_lora(load, cfg), self.dtype)
        opt = adamw(model, optim.lr, optim.weight_decay, optim.betas, offload=cfg.offload_optimizer,
                    stochastic_rounding=self.precision == "bf16-pure",
                    compile=bool(getattr(cfg, "compile", True)))
        schedule = lr_lambda(optim.schedule, optim.warmup_steps, optim.total_steps)
        eng = wrap(model, ds, opt, lambda o: torch.optim.lr_scheduler.LambdaLR(o, schedule), compile=self.compile)
        eng.train()
        if isinstance(getattr(eng.optimizer, "optimizer", eng.optimizer), AdamWSR):  # ZeRO wraps it; ZeRO-0 not
            info(f"{name}: AdamW writes the bf16 weights with stochastic rounding (--precision bf16-pure)")
        if is_peft(model):
            n = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
            info(f"{name}: LoRA r {cfg.lora_r}, α {cfg.lora_alpha:g} on {cfg.lora_targets}: {n / 1e6:.3f}M trained "
                 "parameters, the base frozen")
        self.engines[name] = Trained(eng, accum, self.dist.world_size, optim.lr, prefix, clip)
        return self.engines[name]

    def reference(self, policy: Trained, load, offload_params: bool = False):
        """The frozen reference of `policy`: under LoRA with no other reference model named (--ref-model), the
        policy with its adapters switched off (the base model, no second copy); else a frozen engine of `load`."""
        if is_peft(policy.module) and not getattr(self.cfg, "ref_model", ""):
            info("reference = the policy with its LoRA adapters off (no second copy of the model)")
            return AdaptersOff(policy)
        return self.frozen(load, offload_params)

    def frozen(self, load, offload_params: bool = False):
        """An inference-only engine of `load(dtype)` (a reference policy, a reward model, a model to evaluate)."""
        cfg = self.cfg
        ds = frozen_config(ds_config(zero_stage=self.zero_stage, micro_batch=1, grad_accum=1,
                                     world_size=self.dist.world_size, dtype=self.dtype, user_config=cfg.deepspeed,
                                     precision=self.precision), offload_params)
        model, self._link = load_partitioned(ds, load, self.dtype)
        return wrap(model, ds, compile=self.compile)

    def indices(self, n: int, size: int, step: int, seed: int | None = None) -> list[int]:
        """This rank's share of global batch `step` of `size` indices into `n` items."""
        seed = self.cfg.seed if seed is None else seed
        return runtime.shard(step_indices(n, size, step, seed), self.dist)

    # ---- the step loop

    def fit(self, algo) -> None:
        cfg = self.cfg
        self._check_disk(checkpoint.read_state(self.out)["step"] if cfg.resume else 0)
        start = self._resume(algo) if cfg.resume else 0
        if start == 0 and getattr(algo, "eval_at_start", False):
            self.start_eval = self._evaluate(algo, 0)
            self.writer.log_events(self.monitor.update(0, self.start_eval))  # rules that compare with the start
        if start == 0:
            self.alarms.at_start(algo)  # --on-alarm rollback: step 0's checkpoint, to go back to
        self.t_fit = time.time()
        with TrainProgress(self.stage, cfg.max_steps, start, keys=getattr(algo, "progress", ())) as bar:
            self.in_loop = True  # a signal from here on stops the run at the end of a step
            step = start
            while step < cfg.max_steps:
                metrics, stop = self._step(algo, step)
                done = step + 1
                if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.max_steps:
                    metrics.update(self._evaluate(algo, done))
                self._end_step(done, metrics, bar, algo)
                if stop:
                    self._stop(done, algo, bar)
                step, self._rollback_to = (done if self._rollback_to is None else self._rollback_to), None
            self.in_loop = False
            self._end_training(algo, bar)

    def _end_training(self, algo, bar) -> None:
        """The model first, into model/ (nothing that could still fail can lose it), then the last evaluation,
        which is logged and seen by RLMonitor as the step's own metrics were."""
        step = self.cfg.max_steps
        self.output = self._save_model(algo)
        # (resumed from this very run's final checkpoint: evaluated already)
        m = {} if self.evaluated_at == step else self._evaluate(algo, step)
        if m:
            self.last = {**self.last, **m}
            self._watch(step, m, bar, algo)
        self._report(step, self.monitor.end(step), bar, algo)  # the rules judged over the whole run

    def _step(self, algo, step: int) -> tuple[dict, bool]:
        """One step of the algorithm and its reduced metrics; and whether any rank was asked to stop."""
        t, compiled = time.time(), compile_seconds()
        seed_all(self.cfg.seed * 1_000_003 + step * 101 + self.dist.rank)
        stats = algo.step(step)
        stats.sum("_stop", float(self.stop_signal is not None))  # in the one all-reduce: every rank learns of it
        metrics = stats.reduce(self.dist.device)
        for eng in self.engines.values():
            metrics.update(eng.metrics())
        metrics["time/step"] = time.time() - t
        metrics["time/compile"] = max(0.0, compile_seconds() - compiled)  # of time/step: torch.compile's share
        self.train_seconds += metrics["time/step"]
        for k in RATES:
            if k in metrics:
                self.counted[k] = self.counted.get(k, 0.0) + metrics[k]
                metrics[f"{k}_per_s"] = metrics[k] / metrics["time/step"]
        return metrics, metrics.pop("_stop") > 0

    def _stop(self, step: int, algo, bar) -> None:
        """Ctrl-C / SIGTERM during the loop: checkpoint the finished step, say how to continue, exit 130 / 143."""
        sigterm = self.stop_signal == signal.SIGTERM or self.stop_signal is None  # None: another rank's SIGTERM
        self.checkpoint(step, algo)
        reason = (f"{'terminated (SIGTERM)' if sigterm else 'interrupted (SIGINT)'} at step {step}; checkpoint "
                  "saved: continue with --resume")
        self.writer.fail(reason, self.last, self.monitor.summary())
        bar.print(f"[yellow]{reason}[/]")
        raise SystemExit(143 if sigterm else 130)

    def _evaluate(self, algo, step: int) -> dict:
        if not hasattr(algo, "evaluate"):
            return {}
        seed_all(self.cfg.seed * 7919 + 1 + self.dist.rank)  # the same eval samples at every evaluation
        for eng in self.engines.values():
            eng.eng.eval()
        m = algo.evaluate(step)
        for eng in self.engines.values():
            eng.eng.train()
        if m:
            self.writer.log(step, m)
            self.alarms.after_eval(step, m, algo)  # --on-alarm stop|rollback: the best held-out weights kept
        self.last_eval = m
        return m

    def _end_step(self, step: int, metrics: dict, bar, algo) -> None:
        """Log the step (eval lines are logged where they are computed), feed RLMonitor and print its events, move
        the progress bar; on a `stop` event checkpoint, mark the artifact failed and exit 1; else checkpoint
        every --save-every steps."""
        self.last = metrics
        self.writer.log(step, {k: v for k, v in metrics.items() if not k.startswith("eval/")})
        self._watch(step, metrics, bar, algo, shown={**self.last_eval, **metrics})
        if (self.cfg.save_every and step % self.cfg.save_every == 0 and step < self.cfg.max_steps
                and self._rollback_to is None):
            self.checkpoint(step, algo)

    def _watch(self, step: int, metrics: dict, bar, algo, shown: dict | None = None) -> None:
        """RLMonitor sees `metrics`: its events are logged and printed, the progress bar shows `shown`, and a
        `stop` event ends the run."""
        events = self.monitor.update(step, metrics)
        if shown is not None:
            bar.update(step, shown)
        self._report(step, events, bar, algo)

    def _report(self, step: int, events: list, bar, algo) -> None:
        """RLMonitor's new events: to health.jsonl and the console; a `stop` event ends the run."""
        self.writer.log_events(events)
        for e in events:
            bar.print(f"[{'red' if e.severity == 'stop' else 'yellow'}]health {e.severity}: {e.rule} at step "
                      f"{step}: {e.detail}. {e.message}[/]")
        acting = self.alarms.acting(events)  # --on-alarm: a stop event, or under stop|rollback any event
        if acting is not None:
            self._rollback_to = self.alarms.act(step, acting, algo, bar)

    def _monitor_stop(self, step: int, event, algo, bar) -> None:
        """An RLMonitor `stop`: mark the artifact failed and exit 1 (2 for `reward_errors`: the user's reward function
        failed on every row, bad input like any other). Weights that went non-finite are not saved: the last good
        checkpoint stays the one to resume from; otherwise this step is checkpointed."""
        if event.rule == "nan":
            good = checkpoint.latest(self.out)
            where = (f"the last good checkpoint ({good}) is kept: --resume from it, with a lower --lr" if good else
                     "no checkpoint was saved before it (--save-every N keeps one): rerun with a lower --lr")
        else:
            self.checkpoint(step, algo)
            where = (f"checkpoint saved at step {step}: fix the cause, then --resume or rerun" if step < self.cfg.max_steps
                     else "fix the cause and rerun")
        reason = f"RLMonitor stop at step {step}: {event.rule} ({event.detail}): {event.message} ({where})"
        self.writer.fail(reason, self.last, self.monitor.summary())
        bar.print(f"[bold red]{reason}[/]")
        raise SystemExit(2 if event.rule == "reward_errors" else 1)

    # ---- checkpoints

    def checkpoint(self, step: int, algo, final: bool = False) -> None:
        """Checkpoint `step` (every rank), after a check that it fits on the disk. disk.DiskFull (saying what to do
        unless `final`) when it does not, or when the disk fills up while it is written: nothing partial is left
        and the checkpoints already there are kept."""
        state = {"config": as_dict(self.cfg), "monitor": self.monitor.state_dict(), "start_eval": self.start_eval,
                 "last_eval": self.last_eval, "last": self.last, "final": final, "resumed": self.resumed,
                 "algorithm": algo.state_dict() if hasattr(algo, "state_dict") else {},
                 "alarm": self.alarms.state_dict()}
        try:
            short = disk.shortage(self._shares(), checkpoints=1)
            if short is not None:
                raise disk.NoRoom(f"{self.out / checkpoint.DIR}: not enough free disk space for the checkpoint at "
                                  f"step {step}: it needs {disk.fmt(short.need)} ({short.what()}) and "
                                  f"{disk.fmt(short.free)} are free; nothing was written.")
            checkpoint.save(self.out, step, {n: e.eng for n, e in self.engines.items()}, state, self.dist,
                            self.cfg.keep_checkpoints)
        except disk.DiskFull as e:
            if final:
                raise
            hints = self._hints(writes=1, final=False)
            raise type(e)(f"{e} {self._after_disk_full()}{f'; or save less: {hints}' if hints else ''}.") from None

    def _shares(self, ckpt: bool = True, model: int = 0) -> list[disk.Share]:
        """Every rank's bytes of one checkpoint (all its trained engines) and rank 0's of the model (collective)."""
        c = sum(disk.checkpoint_bytes(e.eng) for e in self.engines.values()) if ckpt else 0
        return disk.gather(self.out / checkpoint.DIR, c, self.out, model if self.dist.is_main else 0)

    def _check_disk(self, start: int) -> None:
        """Before training (every rank): room on the disk for everything the run will save, at its peak — the
        model, the checkpoints kept and the one written beside them — measured from the built engines. If not,
        disk.NoRoom (exit 2) with what is needed, what is free and the flags that save less; --out is put back as
        it was before the run (a directory the run made is removed)."""
        cfg = self.cfg
        if self.dist.is_main:
            checkpoint.remove_partial(self.out)
        runtime.barrier()
        present = len(checkpoint.steps(self.out))
        every = cfg.save_every
        writes = max(0, (cfg.max_steps - 1) // every - start // every) if every else 0
        writes += start == 0 and self.alarms.mode == "rollback"  # its step-0 checkpoint (Alarms.at_start)
        peak, at_end = disk.run_peak(present, writes, cfg.final_checkpoint, cfg.keep_checkpoints)
        model = max(disk.model_bytes(e.module, getattr(cfg, "merge", True)) for e in self.engines.values())
        short = disk.shortage(self._shares(model=model), checkpoints=at_end, model=True, present=present,
                              mid_peak=peak)
        if short is None:
            return
        hints = self._hints(writes, cfg.final_checkpoint)
        msg = (f"{self.out}: not enough free disk space for what this run saves: {short.what()} need "
               f"{disk.fmt(short.need)} more and {disk.fmt(short.free)} are free; nothing was written. Make room, "
               f"{f'or save less: {hints}, ' if hints else ''}or choose an --out on a larger disk.")
        if self.dist.is_main:
            self.writer = None  # its files closed, put back as they were: the run did not happen
            self._untouched.restore()
        raise disk.NoRoom(msg)

    def _hints(self, writes: int, final: bool) -> str:
        """The flags that make the saves of this run smaller (for a message)."""
        cfg, hints = self.cfg, []
        if final:
            hints.append("--no-final-checkpoint (model/ needs no checkpoint: it only serves a --resume to more steps)")
        if writes:
            hints.append("a larger --save-every (or 0: no checkpoint before the end)")
        if cfg.keep_checkpoints > 1:
            hints.append("--keep-checkpoints 1")
        if not cfg.lora_r:
            hints.append("--lora-r 16 (LoRA: the optimiser state of the adapters alone)")
        return ", ".join(hints)

    def _after_disk_full(self) -> str:
        tag = checkpoint.latest(self.out)
        return (f"The last complete checkpoint ({tag}) is kept: make room, then rerun with --resume" if tag else
                "No checkpoint of this run exists: make room, then rerun")

    def _check_resumable(self, state: dict) -> None:
        """A --resume continues the checkpoint's run: settings that change its path are refused, not ignored (a
        new --lr / --vf-lr is applied from the resume point on); a new --max-steps only where the learning rate
        does not depend on it (checkpoint.budget_conflict)."""
        saved, now = state["config"], as_dict(self.cfg)
        changed = checkpoint.conflicts(saved, now)
        if changed:
            diff = ", ".join(f"--{k.replace('_', '-')} {saved[k]!r} -> {now.get(k)!r}" for k in changed)
            raise UserError(f"{self.out}: the checkpoint was trained with other settings ({diff}); resume with "
                            "the checkpoint's values, or start a new run in another --out.")
        why = checkpoint.budget_conflict(saved, now, state["step"])
        if why:
            old, new = saved["max_steps"], now["max_steps"]
            raise UserError(f"{self.out}: --max-steps {old} -> {new}: {why}. Resume with --max-steps {old}, or start "
                            f"over with --max-steps {new} (without --resume).")

    def _resume(self, algo) -> int:
        state = checkpoint.load(self.out, {n: e.eng for n, e in self.engines.items()}, self.dist)
        for k in checkpoint.APPLIED:
            if state["config"].get(k) != getattr(self.cfg, k, None) and hasattr(self.cfg, k):
                info(f"--{k.replace('_', '-')} {state['config'][k]} -> {getattr(self.cfg, k)} from step {state['step']} on")
        for eng in self.engines.values():
            eng.apply_lr()  # the checkpoint's schedule carried the old base learning rate
        self.monitor.load_state_dict(state["monitor"])
        self.alarms.load_state_dict(state.get("alarm", {}))
        self.alarms.reapply()
        self.start_eval, self.last_eval, self.last = state["start_eval"], state["last_eval"], state["last"]
        # every resume, with the budget its checkpoint was written under, goes into artifact.json
        self.resumed = [*state.get("resumed", []), {"step": state["step"], "max_steps": state["config"]["max_steps"]}]
        if self.writer.is_main:
            self.writer.record["resumed"] = self.resumed
        if state["config"]["max_steps"] != self.cfg.max_steps:
            info(f"--max-steps {state['config']['max_steps']} -> {self.cfg.max_steps}: the learning rate is constant, "
                 f"so the run continues to step {self.cfg.max_steps} as a {self.cfg.max_steps}-step run would")
        if hasattr(algo, "load_state_dict"):
            algo.load_state_dict(state["algorithm"])
        self.writer.rewind(state["step"])
        self.evaluated_at = state["step"] if state.get("final") else None
        info(f"resumed from the checkpoint at step {state['step']}")
        return state["step"]

    # ---- the end

    def _save_model(self, algo) -> Output:
        """`algo.output()` saved to model/ through model.tmp/ (safetensors in files of at most --max-shard-size),
        after a check that it fits on the disk; disk.DiskFull if it does not, or if the disk fills up while it is
        written (model.tmp/ removed)."""
        cfg, dist = self.cfg, self.dist
        out = algo.output()
        merge = getattr(cfg, "merge", True)
        short = disk.shortage(self._shares(ckpt=False, model=disk.model_bytes(out.engine.module, merge)), model=True)
        if short is not None:
            raise disk.NoRoom(f"{self.out}: not enough free disk space for the model: it needs {disk.fmt(short.need)} "
                              f"and {disk.fmt(short.free)} are free; nothing was written. {self._after_disk_full()}.")
        try:
            runtime.save_model(out.engine, out.tokenizer, self.writer.begin_model(), dist, extra_config=out.config,
                               merge=merge, max_shard_size=cfg.max_shard_size)
        except Exception as e:
            if not disk.is_disk_full(e):
                raise
            if dist.is_main:
                shutil.rmtree(self.writer.model_tmp, ignore_errors=True)
            raise disk.DiskFull(f"{self.out}: the disk filled up while the model was written ({str(e).strip()[:200]}); "
                                f"its partial files were removed. {self._after_disk_full()}.") from None
        self.writer.land_model()
        return out

    def finish(self, algo) -> dict:
        """The final checkpoint (a later --resume with a larger --max-steps continues from here; skipped with a
        warning if the disk has no room left for it: model/ is saved already), the report, and artifact.json
        "complete"."""
        cfg, dist = self.cfg, self.dist
        wall = time.time() - self.t_fit
        out, extra = self.output, {}
        if cfg.final_checkpoint:
            try:
                self.checkpoint(cfg.max_steps, algo, final=True)
            except disk.DiskFull as e:
                if dist.world_size > 1 and not isinstance(e, disk.NoRoom):
                    raise  # a write failed on some ranks only: the others cannot carry on with this one
                warn(f"{e} The end-of-run checkpoint is skipped: the model is saved in model/ (the checkpoint "
                     "only serves a --resume to more steps).")
                extra["final_checkpoint"] = f"skipped: {e}"
        if dist.is_main and checkpoint.steps(self.out) == [0]:  # only --on-alarm rollback's start: nothing to resume
            shutil.rmtree(self.out / checkpoint.DIR, ignore_errors=True)
        rates = {f"{k}_per_s": round(v / max(self.train_seconds, 1e-9), 1) for k, v in self.counted.items()}
        final = {**algo.final_metrics(self.last, self.start_eval), **rates, "steps": cfg.max_steps,
                 "wall_seconds": round(wall, 1), "train_seconds": round(self.train_seconds, 1),
                 "time/compile": round(compile_seconds(), 1),  # this process's, the evaluations' included
                 "peak_memory_gib_per_rank": [round(m, 3) for m in runtime.all_gather_objects(runtime.peak_memory_gib(dist))]}
        if dist.is_main:
            from align.report import plot_report

            plot_report(self.out / "metrics.jsonl", self.out / "report.png", f"{self.stage} — {cfg.model}",
                        xy=getattr(algo, "report_xy", None))
        if self.alarms.rollback:
            extra["rollback"] = self.alarms.rollback
        self.writer.complete(final, self.monitor.summary(),
                             extra={"model_kind": out.kind, "world_size": dist.world_size, **out.extra, **extra})
        if dist.is_main:
            shutil.rmtree(self.out / BEST_DIR, ignore_errors=True)  # model/ is the run's model
        summary_table(f"{self.stage} complete → {self.out}", final)
        return final

    def complete(self, metrics: dict, title: str, extra: dict | None = None) -> dict:
        """The end of a stage that trains nothing (eval, rm eval/score): metrics into artifact.json, a table."""
        self.writer.log(0, metrics)
        self.writer.complete(metrics, extra=extra)
        summary_table(title, metrics)
        return metrics


def train(cfg, stage: str, algorithm) -> dict:
    """Run a training stage: `algorithm(cfg, run)` builds it, the run trains it, saves it and says how it went."""
    with StageRun(cfg, stage) as run:
        algo = algorithm(cfg, run)
        close = getattr(algo, "close", lambda failed=False: None)  # what it holds beside its engines (decoder ranks)
        try:
            run.fit(algo)
        except BaseException:
            close(failed=True)  # no goodbye: a peer may be mid-exchange, and the failure must be written first
            raise
        close()
        return run.finish(algo)
