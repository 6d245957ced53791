"""Masked batch statistics shared by the advantage estimators and PPO's whitening: sufficient statistics that
sum over ranks (an all-reduce) into the global batch's."""

from __future__ import annotations

import torch


def masked_sums(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[Σ m·x, Σ m·x², Σ m] in float64: the sufficient statistics of a masked mean/variance. Sum them over
    ranks (all-reduce) to get the moments of the global batch."""
    m, x = mask.to(torch.float64), x.to(torch.float64)
    return torch.stack([(m * x).sum(), (m * x * x).sum(), m.sum()])


def moments(sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, unbiased variance) from `masked_sums`."""
    s, s2, n = sums[0], sums[1], sums[2].clamp(min=1)
    mean = s / n
    var = ((s2 - n * mean * mean) / (n - 1).clamp(min=1)).clamp(min=0)
    return mean, var
