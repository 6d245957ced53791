"""A `--deepspeed FILE`: every key of it is applied to the run's engines, or refused (exit 2) with the flag to use
instead. DeepSpeed itself quietly ignores keys it does not read, and parts of a config align builds itself (the
optimiser, the LR schedule, the batch layout, precision, clipping) would be ignored or contradict the flags the
artifact records: those are refused up front, when the stage's config is checked, before anything is written.

Light on purpose (json only; DeepSpeed's ZeRO schema is imported only for a file with a `zero_optimization`
table): stage configs call `read` from their `validate`, which `align pipeline validate` runs too.
"""

from __future__ import annotations

import json
from pathlib import Path

from align.errors import UserError

_BATCH = ("align sets the batch layout from the stage's flags: use --batch-size (RL stages: --prompts-per-step, "
          "ppo --minibatch-size), --micro-batch-size and --nproc")
_PRECISION = "align sets precision from --precision (auto, bf16, bf16-mixed, bf16-pure, fp32)"

# keys align sets itself or cannot honour -> what to do instead ("zero_optimization.X": a key of that table)
REFUSED = {
    "optimizer": "align builds its own AdamW (weight decay on matrices only, bf16 stochastic rounding): use --lr "
                 "and --weight-decay",
    "scheduler": "align builds the LR schedule itself: use --lr, --schedule and --warmup-steps",
    "train_batch_size": _BATCH,
    "train_micro_batch_size_per_gpu": _BATCH,
    "gradient_accumulation_steps": _BATCH,
    "elasticity": _BATCH,
    "gradient_clipping": "align sets it from --grad-clip (0: off)",
    "fp16": _PRECISION,
    "bf16": _PRECISION,
    "bfloat16": _PRECISION,
    "amp": _PRECISION,
    "torch_autocast": _PRECISION,
    "compile": "align compiles the transformer blocks itself: use --compile / --no-compile",
    "activation_checkpointing": "DeepSpeed's activation checkpointing applies only to models written against "
                                "deepspeed.checkpointing, which align's are not (grpo: --gradient-checkpointing)",
    "zero_optimization.offload_optimizer": "use --offload-optimizer (ZeRO-Offload to CPU memory)",
    "zero_optimization.cpu_offload": "use --offload-optimizer (ZeRO-Offload to CPU memory)",
}

# top-level keys DeepSpeed applies to align's engines as written
APPLIED = ("zero_optimization", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "communication_data_type",
           "prescale_gradients", "gradient_predivide_factor", "data_types", "steps_per_print", "wall_clock_breakdown",
           "memory_breakdown", "dump_state", "log_level", "flops_profiler", "tensorboard", "wandb", "csv_monitor",
           "comet", "comms_logger", "timers", "checkpoint", "aio")


def read(path: str | Path, offload_optimizer: bool = False) -> dict:
    """The file's config, every key of which DeepSpeed applies; a UserError naming the first key that align sets
    itself (with the flag to use), that it does not apply, or that DeepSpeed's ZeRO schema rejects."""
    path = Path(path)
    try:
        user = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: DeepSpeed config not found (--deepspeed).") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read the DeepSpeed config (--deepspeed): {e}.") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}: not valid JSON ({e.msg}).") from None
    if not isinstance(user, dict):
        raise UserError(f"{path}: a DeepSpeed config is a JSON object of keys (--deepspeed).")
    zero = user.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise UserError(f"{path}: zero_optimization must be a JSON object.")
    for key in [*user, *(f"zero_optimization.{k}" for k in zero)]:
        if key in REFUSED:
            raise UserError(f"{path}: {key}: {REFUSED[key]}; remove it from the file.")
        if "." not in key and key not in APPLIED:
            raise UserError(f"{path}: {key}: not a DeepSpeed setting align applies (it applies: "
                            f"{', '.join(APPLIED)}); remove it from the file.")
    if zero:
        _check_zero(path, zero, offload_optimizer)
    return user


def _check_zero(path: Path, zero: dict, offload_optimizer: bool) -> None:
    """DeepSpeed's own schema of the zero_optimization table (an unknown or mistyped key fails here, not in the
    middle of building the engine); a file's ZeRO stage is the run's, so it must allow --offload-optimizer."""
    from pydantic import ValidationError

    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise UserError(f"{path}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}.")
    try:
        stage = int(DeepSpeedZeroConfig(**zero).stage)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(["zero_optimization", *map(str, err["loc"])])
        raise UserError(f"{path}: {where}: {err['msg']} (DeepSpeed's ZeRO options).") from None
    if offload_optimizer and stage == 0:
        raise UserError(f"{path}: zero_optimization.stage 0: --offload-optimizer needs ZeRO stage 1, 2 or 3.")
