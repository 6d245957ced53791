"""The step loop of a training run (StageRun's half that trains; align/engine/run.py): each step seeded from (seed,
step, rank), the algorithm's Stats reduced in one all-reduce, the evaluations when due, metrics.jsonl, RLMonitor
and --on-alarm, the progress bar, a checkpoint every --save-every steps and a graceful stop on a signal; at the
end model/ first, then the last evaluation, the final checkpoint, the report and artifact.json "complete".
"""

from __future__ import annotations

import random
import shutil
import signal
import time

import torch

from align import runtime
from align.compile_cache import compile_seconds
from align.console import TrainProgress, summary_table, warn
from align.engine import checkpoint, disk
from align.engine.alarm import BEST_DIR

RATES = ("tokens", "pairs")  # Stats.sum counts a stage may log: the run adds <name>_per_s per step and overall


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # every device


class StepLoop:
    """`fit` trains an algorithm (stages/*.py) for --max-steps steps and `finish` ends the run; StageRun's state
    (its config, process group, engines, writer, monitor, signals and alarms) is theirs."""

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
            self.signals.in_loop = True  # a signal from here on stops the run at the end of a step
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
            self.signals.in_loop = False
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
        stats.sum("_stop", float(self.signals.requested is not None))  # in the one all-reduce: every rank learns of it
        for eng in self.engines.values():
            eng.record(stats)  # an MoE model's router/aux_loss
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
        sigterm = self.signals.requested in (signal.SIGTERM, None)  # None: another rank's SIGTERM
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
            where = (f"checkpoint saved at step {step}: fix the cause, then --resume, or rerun with --overwrite"
                     if step < self.cfg.max_steps else "fix the cause and rerun with --overwrite")
        reason = f"RLMonitor stop at step {step}: {event.rule} ({event.detail}): {event.message} ({where})"
        self.writer.fail(reason, self.last, self.monitor.summary())
        bar.print(f"[bold red]{reason}[/]")
        raise SystemExit(2 if event.rule == "reward_errors" else 1)

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

