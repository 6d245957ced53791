"""Advantage estimators (kind "advantage"): rewards [P prompts, G samples] -> advantages [P, G].

`valid` [P, G] (default: all) marks the samples whose reward exists (a reward function that failed under
--on-reward-error skip): the others neither enter any statistic nor get an advantage. `reduce` (an all-reduce sum)
makes a batch statistic the global batch's. Trait `group_baseline`: whether a group whose rewards are all equal
gets A = 0 (no signal).
"""

from __future__ import annotations

import torch

from align.objectives.moments import masked_sums, moments
from align.objectives.registry import register


def zero_spread(rewards: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """[P] bool: groups whose valid rewards are all equal (no signal; tested exactly, not by a std near 0)."""
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.bool()
    hi = rewards.masked_fill(~valid, float("-inf")).max(dim=1).values
    lo = rewards.masked_fill(~valid, float("inf")).min(dim=1).values
    return (hi <= lo) | ~valid.any(dim=1)


def group_moments(rewards: torch.Tensor, valid: torch.Tensor | None = None):
    """(mean, unbiased std, count) of each group's valid rewards, each [P, 1], in float64."""
    r = rewards.double()
    m = torch.ones_like(r) if valid is None else valid.double()
    n = m.sum(dim=1, keepdim=True)
    mean = (r * m).sum(dim=1, keepdim=True) / n.clamp(min=1)
    var = (((r - mean) * m) ** 2).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)
    return mean, var.sqrt(), n


def _centred(rewards: torch.Tensor, valid: torch.Tensor | None):
    """(r − group mean, std, count), float64; exactly 0 for invalid samples and for groups without spread."""
    mean, std, n = group_moments(rewards, valid)
    keep = ~zero_spread(rewards, valid)[:, None] & (True if valid is None else valid.bool())
    return torch.where(keep, rewards.double() - mean, 0.0), std, n


@register("advantage", "zscore", help="(r − mean) / std within the group, GRPO", group_baseline=True)
def zscore_advantages(rewards: torch.Tensor, valid=None, reduce=None, eps: float = 1e-4) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): A_ij = (r_ij − mean_j r_ij) / (std_j r_ij + eps), std the unbiased
    sample std of the group (as in TRL). A group whose rewards are all equal gets A = 0."""
    centred, std, _ = _centred(rewards, valid)
    return (centred / (std + eps)).to(rewards.dtype)


@register("advantage", "mean", help="r − group mean, Dr. GRPO", group_baseline=True)
def mean_advantages(rewards: torch.Tensor, valid=None, reduce=None) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025; nanochat): A_ij = r_ij − mean_j r_ij, no division by the group's std."""
    return _centred(rewards, valid)[0].to(rewards.dtype)


@register("advantage", "batch", help="group-centred reward / the batch's std", group_baseline=True)
def batch_advantages(rewards: torch.Tensor, valid=None, reduce=None, eps: float = 1e-4) -> torch.Tensor:
    """The group-centred reward over the std of the WHOLE batch (REINFORCE++-style, Hu 2025):
    A_ij = (r_ij − mean_j r_ij) / (std(r) + eps), std unbiased over every valid sample of every rank."""
    sums = masked_sums(rewards, torch.ones_like(rewards) if valid is None else valid)
    std = moments(reduce(sums) if reduce else sums)[1].sqrt()
    return (_centred(rewards, valid)[0] / (std + eps)).to(rewards.dtype)


@register("advantage", "rloo", help="leave-one-out baseline", group_baseline=True)
def rloo_advantages(rewards: torch.Tensor, valid=None, reduce=None) -> torch.Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free!"; Ahmadian
    et al. 2024, RLOO): each sample's baseline is the mean reward of the OTHER G − 1 samples of its group,
    A_ij = r_ij − (1/(G−1)) Σ_{k≠j} r_ik  (= G/(G−1) · (r_ij − mean_j r_ij)): an unbiased baseline."""
    centred, _, n = _centred(rewards, valid)
    return (centred * n / (n - 1).clamp(min=1)).to(rewards.dtype)


@register("advantage", "reinforce++", help="rewards whitened over the global batch, no group baseline",
          group_baseline=False)
def reinforce_pp_advantages(rewards: torch.Tensor, valid=None, reduce=None, eps: float = 1e-4) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): no per-prompt baseline; the rewards are whitened over the WHOLE global batch,
    A_ij = (r_ij − mean(r)) / (std(r) + eps), mean and unbiased std over every valid sample of every rank. A group
    whose rewards are all equal still carries signal here (its samples sit above or below the batch)."""
    v = torch.ones_like(rewards) if valid is None else valid
    sums = masked_sums(rewards, v)
    mean, var = moments(reduce(sums) if reduce else sums)
    return torch.where(v.bool(), (rewards.double() - mean) / (var.sqrt() + eps), 0.0).to(rewards.dtype)
