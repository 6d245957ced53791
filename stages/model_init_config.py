"""`align model init`'s options (stages/model_init.py runs them): a module of its own, light (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from align.config import SEED_MAX, Options, opt
from align.models import PRESETS


@dataclass(frozen=True)
class ModelInitConfig(Options):
    preset: str = opt("tiny", "Model preset: tiny (~0.5M params, CPU), small (~63M, GPU) or tiny-vl (a ~0.2M random "
                              "Qwen2.5-VL that reads images: docs/vision.md).", choices=(*PRESETS, "tiny-vl"))
    out: str = opt("runs/base", "Output artifact directory.", path=True)
    overwrite: bool = opt(False, "Replace the complete artifact already in --out.")
    seed: int = opt(0, "Initialisation seed.", ge=0, le=SEED_MAX)
