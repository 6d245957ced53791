"""StageRun: the life of one stage run, written once for every stage.

    with StageRun(cfg, "sft") as run:
        algo = SFT(cfg, run)      # checks its inputs, then run.open(inputs, SFTPlan(cfg), ...) (the memory plan
                                  # and the layout, run.layout; from here --out is written) and builds its
                                  # engines with run.train(...) / run.frozen(...)
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

StageRun holds the run's state; its concerns live in modules of their own: the step loop (align.engine.loop), the
saves — checkpoints, resume, disk, model/ — (align.engine.saves), Ctrl-C / SIGTERM (align.engine.signals),
--on-alarm (align.engine.alarm), the layout (align.engine.layout) and the memory plan (align.engine.plan).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from rich.markup import escape

from align import runtime, trackers
from align.artifacts import ArtifactWriter, describe_code
from align.config import Options, StageConfig, TrainConfig, as_dict, held_out_choices, load_toml
from align.console import info, summary_table
from align.engine import checkpoint, disk, outdir, plan
from align.engine.alarm import Alarms
from align.engine.build import (Optim, Trained, adamw, compute_dtype, ds_config, frozen_config, load_partitioned,
                                lr_lambda, own_clipping, wrap)
from align.engine.layout import Layout, engines
from align.engine.loop import RATES, StepLoop, seed_all
from align.engine.saves import Saves
from align.engine.signals import Signals
from align.errors import Terminated, UserError
from align.lora import AdaptersOff, check_targets, is_peft, with_lora
from align.models import skeleton
from align.moe import router_aux
from align.optim import AdamWSR
from align.reward_http import redacted
from align.vision import with_tower

__all__ = ["RATES", "Output", "StageRun", "chunks", "seed_all", "step_indices", "train"]


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


@dataclass
class Output:
    """What a finished stage saves: `engine`'s weights with `tokenizer` as model/, `config` added to the model's
    config.json, `kind` (policy | reward) and `extra` in artifact.json."""

    engine: object
    tokenizer: object
    kind: str = "policy"
    config: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)


def fmt_choice(value) -> str:
    """A chosen value as the choices line shows it (a learning rate as 2e-05, not 2.0000000000000002e-05)."""
    if isinstance(value, str) and os.path.isabs(value) and not os.path.relpath(value).startswith(".."):
        return os.path.relpath(value)  # a shipped file, under the current directory: data/arithmetic/test.jsonl
    return f"{value:g}" if isinstance(value, float) else str(value)


def failure(exc: BaseException) -> str:
    """What artifact.json says of a run that ended with `exc`."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (SIGINT)"
    if isinstance(exc, Terminated):
        return "terminated (SIGTERM)"
    if isinstance(exc, SystemExit):
        return f"exited with code {exc.code}"
    if isinstance(exc, UserError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class StageRun(StepLoop, Saves):
    """One run of a stage (or of a command that writes an artifact: eval, rm eval / score, model init, data make):
    --out checked and locked, the process group, the run's layout, its engines and artifact.json; a training run
    also trains (StepLoop) and saves (Saves). `cfg` is read, never written: what the run derives is `layout`,
    and `settings` is the config as the run uses it (artifact.json, checkpoints)."""

    def __init__(self, cfg: Options, stage: str):
        # the options left to the run made concrete, once (the stage reads them as run.cfg); said and recorded
        self.choices = {name: {"value": value, "why": why} for name, (value, why) in cfg.automatic().items() if why}
        self.choices |= held_out_choices(cfg)
        cfg = cfg.resolved()
        if isinstance(cfg, TrainConfig) and (note := cfg.held_out_note()):
            info(note)  # which held-out data the run uses and why, in words
        self.cfg, self.stage, self.out = cfg, stage, Path(cfg.out)
        self.training: TrainConfig | None = cfg if isinstance(cfg, TrainConfig) else None
        outdir.check(cfg, stage)  # at once: a refused --out is said before the inputs are read
        self.settings = redacted(as_dict(cfg))  # a reward URL's credentials hidden (align.reward_http)
        self.layout: Layout | None = None  # set by open (distributed)
        self.dist: runtime.Dist | None = None
        self.writer: ArtifactWriter | None = None
        self.engines: dict[str, Trained] = {}  # the trained engines, checkpointed by name
        self.start_eval: dict = {}  # the evaluation at step 0 (the "before" numbers)
        self.last_eval: dict = {}
        self.last: dict = {}  # the last step's metrics
        self.train_seconds = 0.0
        self.counted: dict[str, float] = {}  # RATES counted since this process started
        self._link = None  # transformers' ZeRO-3 loading link, alive while engines are built
        self.lock: Path | None = None
        self.signals = Signals()
        self._untouched = None  # --out before open() wrote to it (rank 0: disk.Untouched)
        self.output: Output | None = None  # the saved model's Output, once model/ is written
        self.evaluated_at: int | None = None  # the step of a final evaluation a resumed checkpoint holds
        self.resumed: list[dict] = []  # the resumes of this run: {step, max_steps of the checkpoint}
        self.alarms = Alarms(self, self.training.on_alarm if self.training else "warn")  # --on-alarm
        self._rollback_to: int | None = None  # set by an --on-alarm rollback: the step the loop continues from
        self.monitor = None
        if self.training is not None:
            from align.monitor import RLMonitor

            overrides = load_toml(self.training.monitor) if self.training.monitor else None
            self.monitor = RLMonitor(overrides=overrides.get("monitor", overrides) if overrides else None)

    # ---- lifecycle

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        try:
            if exc is not None and self.writer is not None and self.writer.running:
                self.writer.fail(failure(exc), self.last, self.monitor.summary() if self.monitor else None)
        finally:
            if self.lock is not None:
                self.lock.unlink(missing_ok=True)
            self.signals.restore()
        return False

    def open(self, inputs: dict, stage: plan.StagePlan | None = None, *, lora: tuple = (), distributed: bool = True,
             prompt_tokens: int | None = None, sequence_tokens: int | None = None,
             started: float | None = None, notes: dict | None = None) -> runtime.Dist | None:
        """Every input is checked: a training `stage` (its StagePlan) has its batch laid out (refused if it does
        not divide), --lora-targets checked on the models of `lora` (models.ModelSource) and its memory plan
        (sized by the data's longest prompt / example) may stop the run here, before anything is built or written
        (align.engine.plan); then take --out (checked when the run was made: `outdir.check`; refused here if
        another run holds it), start the process group, make the run's layout (`run.layout`) and write
        artifact.json ("running"; `started`: when the work began, if before this call; `notes`: more of its keys,
        e.g. the verifier the stage chose). Its inputs gain the sha256 of every user Python file the config names
        (`code`: --reward / --verifier file.py:FUNCTION) and of its other user files (`chat_template`: {path:
        sha256})."""
        batch = self._plan(stage, lora, plan.Data(prompt_tokens, sequence_tokens)) if stage else (0, 0)
        resume = self.training is not None and self.training.resume
        if resume:
            state = checkpoint.read_state(self.out)
            self._check_resumable(state)
            checkpoint.check_world_size(self.out, state, runtime.world_size())
        main = runtime.rank() == 0
        if main:
            self._untouched = disk.Untouched(self.out)
            self.lock = outdir.lock(self.out)
        self.signals.install()
        if distributed:
            self.dist = runtime.init()
            self._lay_out(stage.offloaded if stage else False, batch)
            seed_all(self.cfg.seed)
        code = describe_code(self.cfg.user_code())
        inputs = {**inputs, "code": code} if code else inputs
        inputs = {**inputs, **{name: describe_code([path]) for name, path in self.cfg.user_files().items()}}
        self.writer = ArtifactWriter(self.out, self.stage, self.settings, inputs, main, started, notes, self.choices)
        names = trackers.parse(self.cfg.report_to if isinstance(self.cfg, StageConfig) else "")
        if main and names:  # the experiment trackers: metrics.jsonl's rows and RLMonitor's events, on rank 0
            self.writer.sinks.append(trackers.Trackers(names, self.out, self.writer.record, resume))
        return self.dist

    def _plan(self, stage: plan.StagePlan, lora: tuple, data: plan.Data) -> tuple[int, int]:
        """The training stage's batch (micro-batch, accumulation), after the checks and the memory plan, which
        may choose a smaller micro-batch for --micro-batch-size 0 (then in `settings`, as the run uses it)."""
        batch = stage.batch(runtime.world_size(), stage.cfg.micro_batch_size, data)
        self.check_lora(*lora)
        planned = plan.preflight(stage, data)
        if planned is None:
            return batch
        self.settings = {**self.settings, "micro_batch_size": planned}
        self.choose("micro_batch_size", planned, "auto: smaller, to fit the memory plan")
        return stage.batch(runtime.world_size(), planned, data)

    def _lay_out(self, offloaded: bool, batch: tuple[int, int]) -> None:
        """The run's layout on its devices (precision, ZeRO stage, compiled blocks; the batch), said in the log."""
        self.layout = replace(engines(self.cfg, self.dist.device.type, self.dist.world_size, offloaded),
                              micro=batch[0], accum=batch[1])
        self.dtype = compute_dtype(self.dist.device, self.layout.precision)
        if self.monitor is not None:
            self.monitor.set_precision(self.layout.precision,  # rollout_mismatch's tolerance
                                       self.cfg.decode_precision() or "auto")
        self._layout_choices(offloaded)
        if self.choices:
            info(escape("choices: " + ", ".join(f"--{k.replace('_', '-')} {fmt_choice(c['value'])} ({c['why']})"
                                                for k, c in self.choices.items())))
        if self.layout.compile:
            info("torch.compile: every engine's transformer blocks are compiled (the first steps compile, a "
                 f"later run reuses the code cached in {os.environ.get('TORCHINDUCTOR_CACHE_DIR')}; "
                 "--no-compile runs eagerly)")

    def choose(self, name: str, value, why: str) -> None:
        """Record an automatic choice (an option left to the run, and what it became): said in the run's
        "choices:" line and recorded in artifact.json (a stage adds its own before `open`)."""
        self.choices[name] = {"value": value, "why": why}

    def choose_verifier(self, verifier) -> None:
        """The verifier --verifier auto became (a rewards.Verifier; None: no held-out rows), as a choice."""
        if verifier is not None and verifier.why:
            self.choose("verifier", verifier.name, f"auto: {verifier.why}")

    def _layout_choices(self, offloaded: bool) -> None:
        """The layout's automatic choices: the precision `auto` became, a ZeRO stage other than asked, the
        micro-batch of `--micro-batch-size 0`."""
        cfg, layout, kind = self.cfg, self.layout, self.dist.device.type
        choices = {}
        if cfg.precision == "auto":
            choices["precision"] = (layout.precision, f"auto: {'CUDA' if kind == 'cuda' else kind.upper()}"
                                                      f"{', an offload' if offloaded and kind == 'cuda' else ''}")
        if layout.zero_stage != cfg.zero_stage:
            choices["zero_stage"] = (layout.zero_stage, "--deepspeed file" if cfg.deepspeed else
                                     f"one GPU process: ZeRO-{cfg.zero_stage} would partition nothing")
        if self.training is not None and cfg.micro_batch_size == 0 and "micro_batch_size" not in self.choices:
            choices["micro_batch_size"] = (layout.micro, "auto")
        self.choices = {**{k: {"value": v, "why": w} for k, (v, w) in choices.items()}, **self.choices}

    # ---- engines

    def check_lora(self, *sources) -> None:
        """With --lora-r, before anything is written: --lora-targets names Linear layers of each model that gets
        adapters (`sources`: models.ModelSource), checked on weightless copies."""
        if self.training is not None and self.training.lora_r:
            for source in sources:
                check_targets(self.cfg, skeleton(source, self.cfg.trust_remote_code), source.spec)

    def train(self, name: str, load, optim: Optim, *, micro: int = 1, accum: int = 1, prefix: str = "") -> Trained:
        """A trained engine of the model `load(dtype)` returns (loaded straight into ZeRO-3 shards), with AdamW
        and `optim`'s schedule; `accum` micro-batches of `micro` rows make one optimiser step."""
        cfg, layout = self.training, self.layout
        ds = ds_config(zero_stage=layout.zero_stage, micro_batch=micro, grad_accum=accum,
                       world_size=self.dist.world_size, dtype=self.dtype, grad_clip=cfg.grad_clip,
                       user_config=cfg.deepspeed, precision=layout.precision, offload_optimizer=cfg.offload_optimizer)
        clip = own_clipping(ds)
        model, self._link = load_partitioned(ds, with_lora(with_tower(load, cfg.train_vision), cfg), self.dtype)
        opt = adamw(model, optim.lr, optim.weight_decay, optim.betas, offload=cfg.offload_optimizer,
                    stochastic_rounding=layout.precision == "bf16-pure", compile=cfg.compile)
        schedule = lr_lambda(optim.schedule, optim.warmup_steps, optim.total_steps)
        eng = wrap(model, ds, opt, lambda o: torch.optim.lr_scheduler.LambdaLR(o, schedule), compile=layout.compile)
        eng.train()
        if isinstance(getattr(eng.optimizer, "optimizer", eng.optimizer), AdamWSR):  # ZeRO wraps it; ZeRO-0 not
            info(f"{name}: AdamW writes the bf16 weights with stochastic rounding (--precision bf16-pure)")
        if is_peft(model):
            n = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
            info(f"{name}: LoRA r {cfg.lora_r}, α {cfg.lora_alpha:g} on {cfg.lora_targets}: {n / 1e6:.3f}M trained "
                 "parameters, the base frozen")
        self.engines[name] = Trained(eng, accum, self.dist.world_size, optim.lr, prefix, clip,
                                     router_aux(eng.module, cfg.router_aux_coef))
        return self.engines[name]

    def reference(self, policy: Trained, load, offload_params: bool = False, ref_model: str = ""):
        """The frozen reference of `policy`: under LoRA with no other reference model named (`ref_model`: the
        stage's --ref-model), the policy with its adapters switched off (the base model, no second copy); else a
        frozen engine of `load`."""
        if is_peft(policy.module) and not ref_model:
            info("reference = the policy with its LoRA adapters off (no second copy of the model)")
            return AdaptersOff(policy)
        return self.frozen(load, offload_params)

    def frozen(self, load, offload_params: bool = False):
        """An inference-only engine of `load(dtype)` (a reference policy, a reward model, a model to evaluate)."""
        ds = frozen_config(ds_config(zero_stage=self.layout.zero_stage, micro_batch=1, grad_accum=1,
                                     world_size=self.dist.world_size, dtype=self.dtype, user_config=self.cfg.deepspeed,
                                     precision=self.layout.precision), offload_params)
        model, self._link = load_partitioned(ds, load, self.dtype)
        return wrap(model, ds, compile=self.layout.compile)

    def indices(self, n: int, size: int, step: int, seed: int | None = None) -> list[int]:
        """This rank's share of global batch `step` of `size` indices into `n` items."""
        seed = self.cfg.seed if seed is None else seed
        return runtime.shard(step_indices(n, size, step, seed), self.dist)

    def complete(self, metrics: dict, title: str, extra: dict | None = None) -> dict:
        """The end of a stage that trains nothing (eval, rm eval/score): metrics into artifact.json, a table."""
        self.writer.log(0, metrics)
        self.writer.complete(metrics, extra=extra)
        summary_table(title, metrics)
        return metrics


def train(cfg: TrainConfig, stage: str, algorithm) -> dict:
    """Run a training stage: `algorithm(cfg, run)` builds it, the run trains it, saves it and says how it went.
    StageRun makes the config's automatic values concrete (the stage reads them as run.cfg), says which held-out
    data the run uses and why, and says the choices in its "choices:" line."""
    with StageRun(cfg, stage) as run:
        algo = algorithm(run.cfg, run)  # the config as the run resolved it
        close = getattr(algo, "close", lambda failed=False: None)  # what it holds beside its engines (decoder ranks)
        try:
            run.fit(algo)
        except BaseException:
            close(failed=True)  # no goodbye: a peer may be mid-exchange, and the failure must be written first
            raise
        close()
        return run.finish(algo)
