"""Building engines: THE one place a DeepSpeed engine is made, trained or frozen.

`trained(...)` wraps a model with AdamW, a warmup + decay schedule and the ZeRO config of the run; its
`backward(loss)` takes a loss already normalised by the GLOBAL batch (every rank, every micro-batch) and undoes
DeepSpeed's own averaging over ranks and accumulation steps — the data-parallel correction lives here and
nowhere else. `frozen(...)` makes an inference-only engine (reference policy, reward model, eval).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from align import ds_file
from align.config import PRECISIONS
from align.errors import UserError
from align.lora import is_peft
from align.models import mark_autocast
from align.moe import RouterAux


def resolve_precision(device: torch.device, precision: str = "auto", offload: bool = False) -> str:
    """The precision a run uses: "auto" is bf16-pure on CUDA (bf16 weights, gradients and Adam moments, AdamW
    with stochastic rounding: 8 bytes per trained parameter on one GPU, and it learns per step as fp32 master
    weights do, see align.optim), bf16-mixed there when something is offloaded to the CPU (`offload`: fp32
    master weights, which ZeRO-Offload keeps), and fp32 on CPU; anything else as asked."""
    if precision not in PRECISIONS:
        raise UserError(f"--precision must be one of {', '.join(PRECISIONS)}, not {precision!r}.")
    if precision == "auto":
        return ("bf16-mixed" if offload else "bf16-pure") if device.type == "cuda" else "fp32"
    return precision


def compute_dtype(device: torch.device, precision: str = "auto") -> torch.dtype:
    """The dtype the module's parameters are loaded in: bf16 for bf16 / bf16-pure (bf16 keeps fp32 master weights in
    the optimizer; bf16-pure keeps them in bf16, see ds_config), fp32 for fp32 and bf16-mixed (torch.autocast runs
    the matmuls in bf16)."""
    return torch.bfloat16 if resolve_precision(device, precision) in ("bf16", "bf16-pure") else torch.float32


def engine_stage(zero_stage: int, world_size: int, device: torch.device, keep: bool = False,
                 user_config: str | None = None) -> tuple[int, str]:
    """(the ZeRO stage to run, a note for the log when it is not the one asked for). ZeRO partitions across
    processes: with ONE process on a GPU, stages 1-3 hold the same bytes as stage 0 and add per-parameter hooks,
    gathers and flat-buffer copies to every micro-batch (most of a small model's update time), so a single CUDA
    process runs stage 0. `keep` (an offload was asked for: it needs ZeRO) and CPU runs (where the tests exercise
    ZeRO-3 on one process) keep the stage asked for; a --deepspeed file's zero_optimization.stage wins."""
    if user_config:
        stage = ds_file.read(user_config).get("zero_optimization", {}).get("stage")
        if stage is not None:
            return int(stage), ""
    if zero_stage == 0 or keep or world_size > 1 or device.type != "cuda":
        return zero_stage, ""
    return 0, (f"one GPU: ZeRO-{zero_stage} would partition nothing, so the engine runs as ZeRO-0 (the same memory, "
               "no gather or partition hooks); ZeRO applies from 2 processes on")


def ds_config(*, zero_stage: int, micro_batch: int, grad_accum: int, world_size: int, dtype: torch.dtype,
              grad_clip: float = 1.0, user_config: str | None = None, precision: str = "auto",
              offload_optimizer: bool = False) -> dict:
    """The DeepSpeed config for one engine. A user's --deepspeed JSON (`ds_file.read`: keys align sets itself,
    such as the optimizer, the batch layout and precision, are refused) is merged over it key by key.

    --precision bf16-pure: ZeRO's master weights, gradients and Adam moments in bf16 (DeepSpeed's
    bf16_master_weights_and_grads + bf16_optimizer_states): 2 + 2 + 2 + 4 = 10 bytes per trained parameter
    instead of 2 + 4 (fp32 grads) + 4 (fp32 master) + 8 (fp32 moments), with the coarser updates of bf16
    (small updates can round away). With ZeRO stage 0 there is no ZeRO optimizer to hold a master copy:
    DeepSpeed's mixed precision is off and AdamW updates the bf16 module itself (2 + 2 + 4 = 8 bytes, a plain
    bf16 PyTorch loop such as TRL's).
    --precision bf16-mixed: the module, its gradients and ZeRO's partitions are fp32 and DeepSpeed runs every
    forward under torch.autocast(bf16) (its `torch_autocast` section: Linear weights are also gathered and
    reduced in bf16). Unlike bf16 (a bf16 module stepped from fp32 masters), the residual stream, the norms and
    the embedding lookup stay fp32: in bf16 a norm gain near 1.0 moves in steps of 2^-7, which many small
    updates must add up to before the model sees any of them.
    offload_optimizer: ZeRO-Offload — master weights, gradients and moments live in (pinned) CPU memory and
    the optimizer steps there; the GPU keeps only the compute-dtype parameters and a small gradient bucket."""
    cfg = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch * grad_accum * world_size,
        "gradient_clipping": grad_clip,
        "zero_optimization": {
            "stage": zero_stage,
            "overlap_comm": False,
            "contiguous_gradients": True,
            "stage3_gather_16bit_weights_on_model_save": True,
            # ZeRO-3's memory-efficient linear re-implements F.linear in Python autograd: 2x slower steps
            # on small models for a saving that only matters for huge activations.
            "memory_efficient_linear": False,
            # DeepSpeed's default: tensors under 100k elements stay whole on every rank (gathering them each
            # forward costs more than they weigh). Set 0 in --deepspeed to shard everything.
            "stage3_param_persistence_threshold": 100_000,
            # DeepSpeed's 5e8-element gradient bucket would be 1-2 GB on the GPU; 5e7 is as fast at our sizes.
            "reduce_bucket_size": 50_000_000,
            "allgather_bucket_size": 50_000_000,
        },
        "bf16": {"enabled": dtype == torch.bfloat16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (on by default) synchronizes the device at the start of every forward
        # from the third optimizer step on: a drained GPU queue per micro-batch, which a launch-bound step (short
        # sequences, a large model) pays as idle GPU time. align times its phases itself.
        "timers": {"throughput": {"enabled": False}},
    }
    if precision == "bf16-pure" and dtype == torch.bfloat16:
        if zero_stage == 0:  # no ZeRO optimizer: AdamW steps the bf16 module itself (bf16 grads and moments)
            cfg["bf16"] = {"enabled": False}
        else:
            cfg["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    if precision == "bf16-mixed":
        cfg["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    if offload_optimizer:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        cfg["zero_force_ds_cpu_optimizer"] = False  # torch AdamW where DeepSpeedCPUAdam cannot be built (CPU-only)
    if user_config:  # every key of it applies (ds_file refuses those align sets itself)
        cfg = _deep_merge(cfg, ds_file.read(user_config, offload_optimizer))
    return cfg


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def frozen_config(cfg: dict, offload_params: bool = False) -> dict:
    """The config of an inference-only engine built beside a trained one: ZeRO stages 1 and 2 partition only
    gradients and optimiser states, which a frozen model has none of (stage 0: a plain replica); no optimiser
    offload and no master-weight settings. `offload_params` (ZeRO-3) keeps its parameters in CPU memory."""
    zero = {k: v for k, v in cfg["zero_optimization"].items() if k != "offload_optimizer"}
    if zero["stage"] in (1, 2):
        zero["stage"] = 0
    if offload_params and zero["stage"] == 3:
        zero["offload_param"] = {"device": "cpu"}
    return {**cfg, "zero_optimization": zero, "bf16": {"enabled": cfg["bf16"]["enabled"]}}


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer blocks: the modules of the classes it names in `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def set_block_leaves(model: torch.nn.Module) -> None:
    """ZeRO-3 fetches and releases each transformer block's parameters as one unit: one pair of hooks per block
    instead of one per Linear / norm inside it, ~10× fewer Python hook calls per forward and backward, the step's
    main CPU cost on one GPU."""
    from deepspeed.utils import set_z3_leaf_modules

    classes = list({type(m) for m in blocks(model)})
    if classes:
        set_z3_leaf_modules(model, classes)


def compiles(asked: bool, device: torch.device, zero_stage: int, world_size: int) -> bool:
    """Whether a run's engines compile their blocks (`compile_blocks`): asked for (--compile, the default), on a
    GPU (inductor's CPU code takes minutes to build on a small machine for steps that take milliseconds), under
    ZeRO-0 — the one-GPU default, and replicas on several GPUs (each process compiles its own copy; DeepSpeed
    all-reduces the gradients after the backward, outside the compiled blocks). ZeRO-3's gather hooks on each
    block would break the compiled graph; ZeRO-1/2 run eagerly (not measured compiled). `world_size` is kept for
    the callers' sake: it no longer decides."""
    return asked and device.type == "cuda" and zero_stage == 0


def compile_blocks(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Regional compilation: torch.compile each transformer block in place (state-dict keys unchanged). The
    blocks are one class, so one compiled graph serves all of them, for every batch size and length (dynamic
    shapes; recompiled only for a new kind of call: training or eval, grad or no grad). A small model's update and log-prob passes
    are bound by kernel launches and Python per layer; compiled, a block's norms, RoPE, activations and residual
    adds fuse into a few kernels. Generation outside the fast
    decoder runs the blocks eagerly (`eager`): a KV cache that grows every token would recompile. Returns the
    number of blocks compiled."""
    import torch._dynamo

    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, max(64, getattr(torch._dynamo.config, limit)))
    # A block's float attributes (norm ε, attention scaling) are constants: specialised, not turned into 0-d CPU
    # tensors. Under dynamic shapes those tensors went into the checkpointed block's graph as CPU ops, and the
    # first step compiled them as C++ kernels one by one (53 of its 62 s of compile at 135M on an H200).
    torch._dynamo.config.specialize_float = True
    # transformers >= 5.25 routes a layer's hub-kernel functions through a context variable that its forward sets
    # and resets (the `kernels` package): a side effect inside the checkpointed block, which dynamo refuses to trace
    # under checkpointing unless told not to replay it in the recompute, and then runs the whole block eagerly,
    # uncompiled and with no word. The variable only selects which kernel runs; the recompute's ops are the traced
    # ones.
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    found = blocks(model)
    checkpointed = bool(getattr(model, "is_gradient_checkpointing", False))
    if checkpointed:  # recompute INSIDE the compiled block (transformers' wrapper may sit outside it)
        model.gradient_checkpointing_disable()
    for b in found:
        if checkpointed:
            b.forward = _recomputed(b, b.forward)
        b.compile(backend=backend, dynamic=True)
    return len(found)


def _recomputed(block: torch.nn.Module, forward):
    """`forward` under activation checkpointing when training with gradients (Chen et al. 2016, "Training Deep
    Nets with Sublinear Memory Cost": keep the block's inputs, recompute the rest in the backward). Traced by
    torch.compile with the block, the recompute is part of the compiled backward: no saved-tensor hooks or
    second Python forward per block, as transformers' own checkpointing wrapper costs."""
    from torch.utils.checkpoint import checkpoint

    from align.models import uses_dropout

    rng = uses_dropout(block)  # else no RNG state to save: inside a compiled block with dynamic shapes, saving it
    # put CPU tensors (torch.get_rng_state) into the graph and cost ~50 s of C++ compile on the first step (H200)

    def run(*args, **kwargs):
        if block.training and torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=rng, **kwargs)
        return forward(*args, **kwargs)

    return run


def load_partitioned(cfg: dict, load, dtype):
    """`load(dtype)` with transformers' ZeRO-3 link set to `cfg`, so `from_pretrained` loads straight into shards
    (no rank holds a full copy), marked for the config's autocast (`mark_autocast`). Returns (model, link): keep
    the link alive while the engine lives."""
    link = None
    if cfg["zero_optimization"]["stage"] == 3:
        from transformers.integrations.deepspeed import HfDeepSpeedConfig

        link = HfDeepSpeedConfig(cfg)
    model = load(dtype)
    mark_autocast(model, cfg)
    return model, link


def _without_muon() -> None:
    """DeepSpeed's ZeRO optimizers import its Muon optimizer only to ask `isinstance(optimizer, MuonWithAuxAdam)`,
    and that module applies torch.compile when imported: 2-3 s of torch._inductor imports in every process. align
    builds AdamW only, so a placeholder class (nothing is an instance of it) answers the question; the real module
    still loads if something imported it first."""
    import sys
    import types

    name = "deepspeed.runtime.zero.muon.muon_optimizer"
    if name not in sys.modules:
        placeholder = types.ModuleType(name)
        placeholder.MuonWithAuxAdam = type("MuonWithAuxAdam", (), {})
        sys.modules[name] = placeholder


def wrap(model: torch.nn.Module, cfg: dict, optimizer=None, lr_scheduler=None, compile: bool = False):
    """A DeepSpeed engine around `model`; without an optimizer an inference-only (frozen) one. `compile`: its
    transformer blocks compiled (`compile_blocks`)."""
    import deepspeed

    _without_muon()
    if optimizer is None:
        model.requires_grad_(False)
        cfg = frozen_config(cfg)
    elif "offload_optimizer" in cfg["zero_optimization"]:
        hint = offload_threads_hint(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.get_num_threads(),
                                    len(os.sched_getaffinity(0)))
        if hint:
            from align.console import warn

            warn(hint)
    if cfg["zero_optimization"]["stage"] == 3 and not is_peft(model):  # LoRA: the backward met partitioned adapters
        set_block_leaves(model)
    eng, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=cfg)
    if compile:
        compile_blocks(eng.module)
    if optimizer is None:
        eng.eval()
    return eng


def offload_threads_hint(local_world: int, threads: int, cores: int) -> str | None:
    """A warning when CPU Adam would run on fewer threads than this process's share of the cores (torchrun's
    default OMP_NUM_THREADS=1 under a launcher that is not `align --nproc`), else None."""
    share = max(1, cores // max(1, local_world))
    if threads >= share:
        return None
    return (f"--offload-optimizer: the CPU Adam step runs on {threads} thread(s) per process, {share} cores "
            f"are this process's share; set OMP_NUM_THREADS={share} (torchrun sets 1) or launch with align --nproc.")


# ---- optimisation


@dataclass
class Optim:
    """AdamW and its schedule: linear warmup, then cosine or linear decay to 10% of `lr` over `total_steps`, or
    constant."""

    lr: float
    total_steps: int
    warmup_steps: int = 0
    schedule: str = "constant"
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)


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


def adamw(model, lr: float, weight_decay: float, betas=(0.9, 0.95), offload: bool = False,
          stochastic_rounding: bool = False, compile: bool = True):
    """AdamW, weight decay on matrices only (the fused kernel on GPU machines). `stochastic_rounding` (--precision
    bf16-pure: the optimizer steps bf16 weights): `align.optim.AdamWSR`, one compiled kernel per tensor on a GPU
    unless `compile` is off (--no-compile: its multi-tensor path). With --offload-optimizer on a GPU
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
    if stochastic_rounding:
        # bf16 weights stepped in bf16 (--precision bf16-pure): stochastic rounding keeps updates far below a
        # bf16 ulp (lr 1e-5 on weights near 1) alive in expectation, where round-to-nearest drops them.
        from align.optim import AdamWSR

        return AdamWSR(groups, lr=lr, betas=betas, fused=None if compile else False)
    # GPU machines: the fused kernel (a few launches per step, no parameter-sized temporaries as the default
    # foreach AdamW allocates); on CPU-only machines torch's default, which the CPU tests pin down.
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=torch.cuda.is_available() or None)


def rows_within(n: int, length: int, token_budget: int) -> int:
    """The micro-batch size for `n` rows of at most `length` tokens each: the largest divisor of `n` whose padded
    size (rows x length) fits `token_budget` tokens (at least 1). Few, large micro-batches: a small model's
    update is bound by kernel launches and Python per micro-batch, not by its FLOPs."""
    return max([d for d in range(1, n + 1) if n % d == 0 and d * length <= token_budget] or [1])


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


class Trained:
    """A trained engine: forward like the model, `backward(loss)` once per micro-batch (the optimiser steps
    after the `accum`-th), `metrics()` its last gradient norm and learning rate. `clip`: the global-norm clip this
    class applies itself (None: DeepSpeed's optimizer clips and reports the norm; see `own_clipping`). `router`:
    an MoE model's load-balancing loss (align.moe.RouterAux), added to each backward and reported by `record`."""

    def __init__(self, eng, accum: int, world: int, lr: float, prefix: str = "", clip: float | None = None,
                 router: RouterAux | None = None):
        self.eng, self.accum, self.world, self.lr, self.prefix, self.clip = eng, accum, world, lr, prefix, clip
        self.router = router
        self.params = [p for p in eng.module.parameters() if p.requires_grad] if clip is not None else []
        self.norm: torch.Tensor | None = None
        if world == 1 and clip is not None:
            # one process, no ZeRO optimizer: DeepSpeed's gradient "all-reduce" would flatten every gradient into
            # one bucket and an fp32 copy of it (2.8 GiB at 0.5B: the GRPO update's peak) to average over 1 rank
            eng.enable_backward_allreduce = False

    @property
    def module(self):
        return self.eng.module

    def __call__(self, *args, **kwargs):
        if self.router is not None:
            return self.router.forward(self.eng, *args, **kwargs)
        return self.eng(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """`loss` is this micro-batch's share of the global objective (summed terms / global count). DeepSpeed
        divides by its accumulation steps and averages gradients over ranks; multiplying by both first leaves
        the gradient of the global objective itself, whatever the number of processes and micro-batches. An MoE
        model's router loss of the forwards since the last backward is added as the same share of its mean."""
        if self.router is not None:
            loss = loss + self.router.pending(self.world * self.accum)
        self.eng.backward(loss * self.world * self.accum)
        if self.clip is not None and self.eng.is_gradient_accumulation_boundary():  # gradients are reduced by now
            self.norm = (torch.nn.utils.clip_grad_norm_(self.params, self.clip) if self.clip > 0
                         else torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None]))
        self.eng.step()

    def apply_lr(self) -> None:
        """Make `lr` the schedule's base learning rate (after a checkpoint restored another one)."""
        sched = self.eng.lr_scheduler
        sched.base_lrs = [self.lr for _ in sched.base_lrs]
        for group, base, f in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = base * f(sched.last_epoch)
        sched._last_lr = [g["lr"] for g in sched.optimizer.param_groups]

    def record(self, stats) -> None:
        """The step's router loss into the step's `stats` (reduced with them over the ranks), if the model is MoE."""
        if self.router is not None:
            self.router.record(stats, f"{self.prefix}router/aux_loss")

    def metrics(self) -> dict[str, float]:
        norm = self.norm if self.clip is not None else self.eng.get_global_grad_norm()
        return {f"{self.prefix}grad_norm": float(norm if norm is not None else 0.0),
                f"{self.prefix}lr": self.eng.lr_scheduler.get_last_lr()[0]}


def own_clipping(cfg: dict) -> float | None:
    """With no ZeRO optimizer and no DeepSpeed mixed precision (stage 0 with fp32 parameters: --precision fp32 or
    bf16-mixed, or bf16-pure), DeepSpeed clips the gradients but keeps no norm to report: then `Trained` clips
    and measures them itself, and DeepSpeed's clipping is turned off in `cfg` (in place). Returns the clip value
    for `Trained`, or None where DeepSpeed's optimizer does both."""
    if cfg["zero_optimization"]["stage"] != 0 or cfg.get("bf16", {}).get("enabled") or cfg.get("fp16", {}).get("enabled"):
        return None
    clip, cfg["gradient_clipping"] = cfg.get("gradient_clipping", 0.0), 0.0
    return clip
