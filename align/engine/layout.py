"""A run's layout: what it derives ONCE from its config and its machine, before anything is built.

The config is frozen once validated (align.config); what follows from it and the machine lives here instead:
the precision `--precision auto` becomes, the ZeRO stage the engines run, whether their blocks compile, the
processes, and a training stage's batch per process (rows per micro-batch, micro-batches per optimiser step,
with the micro-batch the memory plan chose for `--micro-batch-size 0`). The memory plan estimates with the same
rules (`engines`), `StageRun.open` makes the run's layout, and the stage reads it as `run.layout` (a micro-batch
the plan chose is also in `run.settings`, the config as artifact.json and the checkpoints record it).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from align.config import StageConfig
from align.engine.build import compiles, engine_stage, resolve_precision


@dataclass(frozen=True)
class Layout:
    """The run's layout (see the module docstring). `micro` / `accum`: 0 for a command that trains nothing."""

    precision: str  # as resolved: never "auto"
    zero_stage: int  # the stage every engine runs (a --deepspeed file's, or 0 for one CUDA process)
    compile: bool  # the engines' transformer blocks are compiled (build.compiles)
    world: int  # processes that train
    note: str = ""  # why the ZeRO stage is not the one asked for (for the log)
    micro: int = 0  # rows (pairs, episodes) per micro-batch and process of the update
    accum: int = 0  # micro-batches per optimiser step


def engines(cfg: StageConfig, kind: str, world: int, offloaded: bool = False) -> Layout:
    """The precision, ZeRO stage and compilation of a run of `cfg` on `world` processes of device `kind` ("cuda",
    "cpu"), by align.engine.build's rules; `offloaded`: something lives in CPU memory (--offload-optimizer, PPO's
    --offload-frozen), which keeps ZeRO and makes `--precision auto` bf16-mixed."""
    device = SimpleNamespace(type=kind)
    zero_stage, note = engine_stage(cfg.zero_stage, world, device, offloaded, cfg.deepspeed)
    return Layout(precision=resolve_precision(device, cfg.precision, offload=offloaded), zero_stage=zero_stage,
                  compile=compiles(cfg.compile, device, zero_stage, world), world=world, note=note)
