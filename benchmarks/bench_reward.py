"""Benchmark-only reward: uniform noise, so every group has reward variance and no completion is dropped
from the loss (a constant reward would let a trainer skip work)."""

import random


def noise(prompt, completion, **row) -> float:
    return random.random()


def trl_noise(prompts, completions, **kwargs) -> list[float]:
    return [random.random() for _ in completions]
