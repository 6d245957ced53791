"""--on-alarm: what an RLMonitor event does to a run (StageRun calls it; align/engine/run.py).

  warn      a warn rule warns, a stop rule stops the run (failed), as always;
  stop      any event ends the run: model/ holds the weights of the best held-out evaluation so far (kept in
            best-model/ whenever an evaluation beats the previous best), or this step's when no held-out evaluation
            ran; artifact.json says "stopped", the rule, the step and which weights were kept; exit 1;
  rollback  the first event with an advised change (the rule's `remedy`: lr ×0.5, the KL coefficient ×2) sends
            the run back to its newest checkpoint — before the first --save-every one, to the checkpoint of step 0
            that a rollback run writes before its first step (its input weights, a fresh optimiser) — which
            continues with that change, logged in health.jsonl and artifact.json; a second event (or one without a
            remedy) stops as under `stop`.
A rule that says the run cannot learn at all (reward_errors, no_signal) fails the run under any mode; its warning
over a run shorter than its window (no_signal's) is only said.
"""

from __future__ import annotations

import os
import shutil

from align import runtime
from align.console import info
from align.engine import checkpoint
from align.monitor import Event

BEST_DIR = "best-model"
HOPELESS = ("reward_errors", "no_signal")  # nothing a stop with the best weights or a rollback would fix


class Alarms:
    """A run's --on-alarm `mode` (warn | stop | rollback): what it does with RLMonitor's events, the best held-out
    weights it keeps and the rollback it made."""

    def __init__(self, run, mode: str = "warn"):
        self.run, self.mode = run, mode
        self.best: dict | None = None  # {"step", "key", "value"} of the weights in best-model/
        self.rollback: dict | None = None  # {"at", "to", "rule", "changes", "lr_factor"} once rolled back

    def state_dict(self) -> dict:
        return {"best": self.best, "rollback": self.rollback}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.rollback = state.get("best"), state.get("rollback")

    def at_start(self, algo) -> None:
        """Before the first step of a fresh run: under rollback, checkpoint step 0 (the run's input weights, its
        optimiser and schedule before any update, the monitor and stage state after the first evaluation), so an
        alarm before the first --save-every checkpoint has a state to go back to (the next checkpoint replaces it,
        as any older one beyond --keep-checkpoints)."""
        if self.mode == "rollback":
            self.run.checkpoint(0, algo)

    def acting(self, events: list) -> Event | None:
        """The event of `events` this mode acts on (None: only warnings to print). A hopeless rule's warning (its
        verdict over a run shorter than its window: RLMonitor.end) is only said, under every mode."""
        events = [e for e in events if not (e.rule in HOPELESS and e.severity == "warn")]
        stops = [e for e in events if e.severity == "stop"]
        if self.mode == "warn" or stops:
            return stops[0] if stops else None
        return events[0] if events else None

    def after_eval(self, step: int, metrics: dict, algo) -> None:
        """Under stop / rollback: the policy's weights into best-model/ when this held-out evaluation beats the
        best so far (the first one always does). The held-out key: the stage's `heldout_key`, else greedy pass@1."""
        key = getattr(algo, "heldout_key", "eval/pass@1/greedy")
        if self.mode == "warn" or key not in metrics or (self.best and metrics[key] <= self.best["value"]):
            return
        run, out = self.run, algo.output()
        tmp, final = run.out / (BEST_DIR + ".tmp"), run.out / BEST_DIR
        if run.dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        runtime.save_model(out.engine, out.tokenizer, tmp, run.dist, extra_config=out.config,
                           merge=run.cfg.merge, max_shard_size=run.cfg.max_shard_size)
        if run.dist.is_main:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        runtime.barrier()
        self.best = {"step": step, "key": key, "value": float(metrics[key]),
                     "metrics": {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}}

    def act(self, step: int, event: Event, algo, bar) -> int | None:
        """Do what the mode says with `event`; returns the step to continue from after a rollback, else None
        (the run has ended: SystemExit)."""
        run = self.run
        if self.mode == "warn" or event.rule in HOPELESS:
            run._monitor_stop(step, event, algo, bar)
        remedy = next((r.remedy for r in run.monitor.rules if r.name == event.rule), {})
        if (self.mode == "rollback" and self.rollback is None and remedy and run.signals.in_loop
                and checkpoint.latest(run.out)):
            return self._roll_back(step, event, algo, remedy, bar)
        if event.rule == "nan" and not self.best:  # never keep non-finite weights: the plain nan stop
            run._monitor_stop(step, event, algo, bar)
        self._stop(step, event, algo, bar)

    def _roll_back(self, step: int, event: Event, algo, remedy: dict, bar) -> int:
        run = self.run
        events = list(run.monitor.events)
        state = checkpoint.load(run.out, {n: e.eng for n, e in run.engines.items()}, run.dist)
        back = state["step"]
        run.monitor.load_state_dict(state["monitor"])
        run.monitor.events = events  # what happened stays on the record
        run.start_eval, run.last_eval, run.last = state["start_eval"], state["last_eval"], state["last"]
        if hasattr(algo, "load_state_dict"):
            algo.load_state_dict(state["algorithm"])
        changes, lr_factor = [], remedy.get("lr", 1.0)
        if lr_factor != 1.0:
            for eng in run.engines.values():
                eng.lr *= lr_factor
                eng.apply_lr()
            changes.append(f"learning rate x{lr_factor:g}")
        if "kl" in remedy and hasattr(algo, "raise_kl"):
            said = algo.raise_kl(remedy["kl"])
            if said:
                changes.append(said)
        self.rollback = {"at": step, "to": back, "rule": event.rule, "changes": changes, "lr_factor": lr_factor}
        run.writer.rewind(back, health=False)  # the abandoned steps' metrics go; the events that led here stay
        where = f"the checkpoint at step {back}" if back else "the run's start (its input weights, a fresh optimiser)"
        note = Event(step, "on_alarm", "rollback", event.rule, event.value, event.threshold,
                     f"rolled back to {where}, continuing with {', '.join(changes) or 'no change'}", event.detail)
        run.writer.log_events([note])
        if run.writer.is_main:
            run.writer.record["rollback"] = self.rollback
        bar.print(f"[bold yellow]--on-alarm rollback: {event.rule} at step {step}: {note.message}[/]")
        return back

    def reapply(self) -> None:
        """On --resume of a run that rolled back: its learning-rate change again (the KL change is the stage's
        own checkpointed state)."""
        if self.rollback and self.rollback["lr_factor"] != 1.0:
            for eng in self.run.engines.values():
                eng.lr *= self.rollback["lr_factor"]
                eng.apply_lr()
            info(f"--on-alarm rollback at step {self.rollback['at']}: learning rate x{self.rollback['lr_factor']:g}")

    def _stop(self, step: int, event: Event, algo, bar) -> None:
        """End the run on `event`: model/ = the best held-out evaluation's weights (else this step's), status
        "stopped", exit 1."""
        run = self.run
        if self.best:
            if run.dist.is_main:
                shutil.rmtree(run.writer.model_tmp, ignore_errors=True)
                shutil.copytree(run.out / BEST_DIR, run.writer.model_tmp)
            kept = (f"the weights of the best held-out evaluation (step {self.best['step']}, {self.best['key']} "
                    f"{self.best['value']:.4g})")
        else:
            run._save_model(algo)
            kept = f"the weights at step {step} (no held-out evaluation ran)"
        reason = f"stopped on an alarm (--on-alarm {self.mode}) at step {step}: {event.rule} ({event.detail}); model/ holds {kept}"
        if self.rollback:
            reason += (f"; it had rolled back once, at step {self.rollback['at']} to step {self.rollback['to']} "
                       f"({self.rollback['rule']})")
        metrics = kept_metrics(run.last, self.best)
        kept_record = {k: v for k, v in (self.best or {"step": step}).items() if k != "metrics"}
        run.writer.complete(metrics, run.monitor.summary(), extra={"reason": reason, "stopped": {
            "step": step, "rule": event.rule, "kept": kept_record}}, status="stopped")
        bar.print(f"[bold red]{reason}[/]")
        raise SystemExit(1)


def kept_metrics(last: dict, best: dict | None) -> dict:
    """A stopped run's artifact metrics: the last step's, with the held-out (eval/) figures of the evaluation whose
    weights model/ keeps (`best`: after_eval's record) instead of the last evaluation's."""
    kept = (best or {}).get("metrics") or {}
    return {**{k: v for k, v in last.items() if not (kept and k.startswith("eval/"))}, **kept}
