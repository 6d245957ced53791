"""What a training run writes besides its metrics (StageRun's half that saves; align/engine/run.py): checkpoints,
each after a check that the disk has room (and one before training for the run's peak), a --resume's checks and
its restore, and model/ at the end of training.
"""

from __future__ import annotations

import shutil

from align import runtime
from align.console import info
from align.engine import checkpoint, disk
from align.errors import UserError


class Saves:
    """Checkpoints, --resume and model/ of a StageRun (whose config, process group, engines, writer, monitor and
    alarms they read)."""

    def checkpoint(self, step: int, algo, final: bool = False) -> None:
        """Checkpoint `step` (every rank), after a check that it fits on the disk. disk.DiskFull (saying what to do
        unless `final`) when it does not, or when the disk fills up while it is written: nothing partial is left
        and the checkpoints already there are kept."""
        state = {"config": self.settings, "monitor": self.monitor.state_dict(), "start_eval": self.start_eval,
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
        model = max(disk.model_bytes(e.module, cfg.merge) for e in self.engines.values())
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
        saved, now = state["config"], self.settings
        changed = checkpoint.conflicts(saved, now)
        if changed:
            diff = ", ".join(f"--{k.replace('_', '-')} {saved[k]!r} -> {now.get(k)!r}" for k in changed)
            raise UserError(f"{self.out}: the checkpoint was trained with other settings ({diff}); resume with "
                            "the checkpoint's values, or start a new run in another --out.")
        why = checkpoint.budget_conflict(saved, now, state["step"])
        if why:
            old, new = saved["max_steps"], now["max_steps"]
            raise UserError(f"{self.out}: --max-steps {old} -> {new}: {why}. Resume with --max-steps {old}, or start "
                            f"over with --max-steps {new} (--overwrite instead of --resume).")

    def _resume(self, algo) -> int:
        state = checkpoint.load(self.out, {n: e.eng for n, e in self.engines.items()}, self.dist)
        for k in checkpoint.APPLIED:
            if k in self.settings and state["config"].get(k) != self.settings[k]:
                info(f"--{k.replace('_', '-')} {state['config'][k]} -> {self.settings[k]} from step {state['step']} on")
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

    def _save_model(self, algo):
        """`algo.output()` saved to model/ through model.tmp/ (safetensors in files of at most --max-shard-size),
        after a check that it fits on the disk; disk.DiskFull if it does not, or if the disk fills up while it is
        written (model.tmp/ removed)."""
        cfg, dist = self.cfg, self.dist
        out = algo.output()
        merge = cfg.merge
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

